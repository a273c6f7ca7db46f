"""Grouped-query and multi-query attention (``num_kv_heads``).

The oracle is a plain multi-head layer whose key/value projections repeat each group's weights:
GQA must equal it on every backend, every layout, and in cached decoding; the cache holds only
``num_kv_heads`` heads.
"""

import pytest
import torch

import relpos
from relpos import KVCache, MultiheadAttention, Positions
from tests.helpers import gqa_and_repeated

D, H = 32, 4
SPECS = [
    "nope",
    "rope",
    "alibi",
    {"name": "t5", "num_buckets": 8, "max_distance": 12},
    {"name": "shaw", "max_distance": 2},
    {"name": "music", "max_distance": 4},
]


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("kvh", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.matrix
def test_gqa_equals_multi_head_with_repeated_kv_weights(spec, causal, kvh, backend):
    if backend == "sdpa" and isinstance(spec, dict) and spec["name"] == "shaw":
        pytest.skip("sdpa does not support a value term")
    gqa, full = gqa_and_repeated(spec, kvh, causal, backend, d_model=D, num_heads=H)
    x = torch.randn(3, 11, D)
    segments = torch.tensor([[0] * 11, [0] * 4 + [1] * 5 + [-1] * 2, [-1] * 3 + [0] * 8])
    with torch.no_grad():
        for kw in ({}, {"segment_ids": segments}):
            torch.testing.assert_close(gqa(x, **kw), full(x, **kw), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "spec", ["rope", {"name": "t5", "num_buckets": 8, "max_distance": 12}], ids=str
)
def test_gqa_cached_decoding_equals_full_forward(spec):
    gqa, _ = gqa_and_repeated(spec, 2, True, "auto", d_model=D, num_heads=H)
    x = torch.randn(2, 9, D)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left-padded prompt
    with torch.no_grad():
        full = gqa(x, padding_mask=mask)
        cache = KVCache()
        first = gqa(x[:, :5], padding_mask=mask[:, :5], cache=cache)
        steps = [first] + [gqa(x[:, t : t + 1], cache=cache) for t in range(5, 9)]
    assert cache.k.shape == (2, 2, 9, D // H)  # num_kv_heads heads, not num_heads
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=2e-5)


def test_gqa_gradients_match_the_repeated_oracle():
    gqa, full = gqa_and_repeated("rope", 2, True, "auto", d_model=D, num_heads=H)
    gqa, full = gqa.double().train(), full.double().train()  # float64: no rounding to blur it
    x = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(gqa(x).square().sum(), x)
    (fx,) = torch.autograd.grad(full(x).square().sum(), x)
    torch.testing.assert_close(gx, fx, atol=1e-10, rtol=1e-10)


def test_transformer_config_takes_num_kv_heads():
    cfg = relpos.TransformerConfig(
        vocab_size=10, d_model=32, num_heads=4, num_layers=1, num_kv_heads=1, scheme="rope"
    )
    assert relpos.TransformerConfig.from_dict(cfg.to_dict()) == cfg
    small = relpos.Transformer(cfg)
    big = relpos.Transformer(
        relpos.TransformerConfig.from_dict({**cfg.to_dict(), "num_kv_heads": None})
    )
    saved = 2 * (4 - 1) * (32 // 4) * (32 + 1)  # two projections lose 3 heads of weights + bias
    assert (
        sum(p.numel() for p in big.parameters()) - sum(p.numel() for p in small.parameters())
        == saved
    )
    tokens = torch.randint(0, 10, (2, 6))
    assert small(tokens, Positions.from_length(6)).shape == (2, 6, 10)


@pytest.mark.parametrize(
    ("kvh", "error", "match"),
    [
        (3, ValueError, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (0, ValueError, "num_kv_heads must be >= 1"),
        (2.0, TypeError, "num_kv_heads must be an int"),
    ],
)
def test_bad_num_kv_heads(kvh, error, match):
    with pytest.raises(error, match=match):
        MultiheadAttention(D, H, num_kv_heads=kvh)
    with pytest.raises(error, match=match):
        relpos.TransformerConfig(vocab_size=10, d_model=D, num_heads=H, num_kv_heads=kvh)
