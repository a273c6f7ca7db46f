"""The batch properties of the PyTorch suite, on every Keras backend: a padded row equals the row
alone, packed documents equal separate rows, cached decoding equals the full forward. (RoPE whose
frequencies follow each row's length decodes as its prefix: tests/keras/test_parity_torch.py.)"""

import numpy as np
import pytest

from relpos.keras import (
    PositionEmbedding,
    RelativeMultiHeadAttention,
    RotaryEmbedding,
    SinePositionEncoding,
    T5RelativeBias,
)
from relpos.spec import config_class

from .util import COMPILED, decode, every_other, kt, np_

XPOS = {"name": "rope", "xpos_scale_base": 8.0}
SHAW = {"name": "shaw", "max_distance": 3}
DEBERTA = {"name": "deberta", "position_buckets": 4, "max_relative_positions": 8}
COPE = {"name": "cope", "npos_max": 4}
SCHEMES = [
    "nope",
    "rope",
    "alibi",
    {"name": "t5", "num_buckets": 8, "max_distance": 6},
    SHAW,
    {"name": "music", "max_distance": 5},
    XPOS,
    # Issue 17's family: one distance-function bias (learned ALiBi and DPB take KERPLE's path
    # with another function: tests/keras/test_parity_torch.py) and Transformer-XL
    "kerple",
    {"name": "transformer_xl", "max_distance": 3},
    # Issue 17's schemes that read the keys (DeBERTa's p2c, CoPE) or the layer input (FoX). On
    # JAX and TensorFlow their padded, packed and cached batches are checked against PyTorch in
    # tests/keras/test_parity_torch.py; here under ``slow`` (each row alone is a shape to compile).
    DEBERTA,
    COPE,
    "forgetting",
    # Sandwich: a distance bias without weights; FIRE: a per-pair MLP of the query's position
    # (causal only), whose threshold L = 4.5 lies inside the 8-token rows
    {"name": "sandwich", "dim": 32},
    {"name": "fire", "hidden": 8, "init_threshold": 4.5},
]
CONTEXTUAL = (DEBERTA, COPE, "forgetting")


def _compiled_duplicate(case) -> bool:
    spec = case[0] if isinstance(case, tuple) else case
    return COMPILED and any(spec is s for s in CONTEXTUAL)


B, N, WIDTH, HEADS = 3, 8, 16, 2
SPEC_CAUSAL = every_other(
    [(spec, causal) for spec in SCHEMES for causal in (False, True)],
    ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'bidirectional'}",
    slow=_compiled_duplicate,
)


def _layer(spec, causal, kv_heads=None):
    name = spec if isinstance(spec, str) else spec["name"]
    if not causal and (spec is XPOS or config_class(name).causal_only):
        pytest.skip("causal only")
    layer = RelativeMultiHeadAttention(
        HEADS, WIDTH // HEADS, scheme=spec, causal=causal, num_key_value_heads=kv_heads
    )
    layer.build((None, None, WIDTH))
    return layer


@pytest.mark.parametrize(("spec", "causal"), SPEC_CAUSAL)
def test_padded_row_equals_row_alone(spec, causal):
    layer = _layer(spec, causal)
    x = np.random.default_rng(0).normal(size=(B, N, WIDTH)).astype("float32")
    mask = np.ones((B, N), bool)
    mask[1, :3] = False  # left padding
    mask[2, 5:] = False  # right padding
    out = np_(layer(kt(x), query_mask=kt(mask)))
    for r in range(B):
        alone = np_(layer(kt(x[r : r + 1, mask[r]])))
        np.testing.assert_allclose(out[r, mask[r]], alone[0], atol=1e-5)
        assert (out[r, ~mask[r]] == 0).all()


@pytest.mark.parametrize(("spec", "causal"), SPEC_CAUSAL)
def test_packed_documents_equal_separate_rows(spec, causal):
    layer = _layer(spec, causal)
    x = np.random.default_rng(1).normal(size=(1, N, WIDTH)).astype("float32")
    seg = np.array([[0, 0, 0, 1, 1, 2, 2, -1]], "int32")
    out = np_(layer(kt(x), segment_ids=kt(seg)))
    for s in range(3):
        sel = seg[0] == s
        alone = np_(layer(kt(x[:, sel])))
        np.testing.assert_allclose(out[0, sel], alone[0], atol=1e-5)


@pytest.mark.parametrize(
    ("spec", "kv_heads"),
    every_other(
        [
            *((spec, None) for spec in SCHEMES),
            ({"name": "rope", "learned_freq": True}, None),
            # Multi-query: rotated keys, and a value term. Dynamic NTK and LongRoPE (raw keys in
            # the cache, each step equal to its prefix): tests/keras/test_parity_torch.py.
            ("rope", 1),
            (SHAW, 1),
        ],
        ids=str,
        slow=_compiled_duplicate,
    ),
)
def test_cached_decoding_equals_full_forward(spec, kv_heads):
    """Left-padded prompts, a prefill, then one token at a time: every step's output equals the
    full causal forward pass at that token. The cache holds the key/value heads."""
    layer = _layer(spec, True, kv_heads)
    x = np.random.default_rng(2).normal(size=(B, N, WIDTH)).astype("float32")
    mask = np.ones((B, N), bool)
    mask[1, :2] = False
    mask[2, :4] = False
    full = np_(layer(kt(x), query_mask=kt(mask)))
    np.testing.assert_allclose(decode(layer, x, mask, prompt=5), full, atol=1e-5)


@pytest.mark.parametrize("spec", every_other(SCHEMES, ids=str, slow=_compiled_duplicate))
def test_cache_index_per_row_continues_each_prompt(spec):
    """Right-padded prompts of different lengths: each row writes its next token at its own slot
    (``cache_update_index`` per row) and matches the row decoded alone."""
    layer = _layer(spec, causal=True)
    x = np.random.default_rng(3).normal(size=(B, N, WIDTH)).astype("float32")
    lengths = np.array([3, 5, 2])
    cache = layer.empty_cache(B, N, "float32")
    slots = np.arange(N)[None]
    prompt = np.where(slots < lengths[:, None], 1, 0).astype(bool)
    xs = x * prompt[..., None]
    _, cache = layer(
        kt(xs[:, :5]), cache=cache, cache_update_index=0, cache_mask=kt(prompt & (slots < 5))
    )
    new = x[np.arange(B), lengths][:, None]  # each row's next token
    out, cache = layer(kt(new), cache=cache, cache_update_index=kt(lengths.astype("int32")))
    for r in range(B):
        seq = np.concatenate([x[r, : lengths[r]], new[r]], 0)[None]
        alone = np_(layer(kt(seq)))
        np.testing.assert_allclose(np_(out)[r, 0], alone[0, -1], atol=1e-5)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PositionEmbedding(16),
        lambda: SinePositionEncoding(),
        lambda: RotaryEmbedding(),
        lambda: T5RelativeBias(2, 8, 6),
    ],
    ids=["learned", "sine", "rotary", "t5"],
)
def test_position_layers_read_each_rows_mask(make):
    layer = make()
    x = np.random.default_rng(4).normal(size=(2, 6, 4, 8)).astype("float32")
    if not isinstance(layer, RotaryEmbedding):
        x = x[:, :, 0]
    mask = np.array([[True] * 6, [False, False, True, True, True, True]])
    out = np_(layer(kt(x), mask=kt(mask)))
    alone = np_(layer(kt(x[1:, 2:])))
    got = out[1][:, 2:, 2:] if isinstance(layer, T5RelativeBias) else out[1, 2:]
    np.testing.assert_allclose(got, alone[0], atol=1e-6)
    # A start index per row is the same as explicit positions.
    starts = np.array([0, 3], "int32")
    pos = np.arange(6)[None] + starts[:, None]
    np.testing.assert_allclose(
        np_(layer(kt(x), start_index=kt(starts))), np_(layer(kt(x), positions=kt(pos))), atol=1e-6
    )
