"""Parity with Hugging Face ``transformers`` for the schemes whose public implementation lives
there (built from small configs, no downloads; skipped where ``transformers`` is not installed):

* T5's bucketed bias (Raffel et al., 2020, §2.1): the bucket function against HF's
  ``T5Attention._relative_position_bucket`` (mesh-tensorflow's ``_relative_position_bucket``),
  and the ``t5`` scheme's ``score_bias``, with HF's table copied in, against
  ``T5Attention.compute_bias`` for the encoder (bidirectional buckets) and the decoder
  (``is_decoder=True``: causal buckets), lengths past ``max_distance``, and a decoding step;
* ALiBi (Press et al., 2022): ``alibi_slopes`` against Bloom's and MPT's slopes for head counts
  that are and are not powers of two, and the ``alibi`` scheme's bias against Bloom's
  ``build_alibi_tensor`` on a batch with padding;
* RoPE (Su et al., 2021): the ``rope`` scheme's half-split rotation against Llama's rotary
  embedding and ``apply_rotary_pos_emb`` under left padding (HF generation's ``position_ids``),
  prompt and decoding step, and its ``interleaved`` option (partial rotary) against GPT-J's.

DeBERTa, M-RoPE and the RoPE scalings' frequencies are compared with HF in their own files
(``test_deberta.py``, ``test_multi_axis.py``, ``test_rope_scaling.py``).
"""

from __future__ import annotations

import pytest
import torch

import relpos
from relpos import Positions
from relpos.functional import alibi_slopes, t5_buckets

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.usefixtures("one_thread"),
]

#: ``(num_buckets, max_distance)``: T5's default, small tables whose log buckets short rows reach,
#: and the smallest ``max_distance`` each direction allows (one exact bucket past the half).
T5_TABLES = [(32, 128), (16, 20), (10, 40), (8, 9), (4, 3)]
directions = pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])


def _batch_mask() -> torch.Tensor:
    """Rows: no padding, left padding (3 and 7 tokens), and left padding with a hole in the middle
    (where a position is not the index minus the padding: distances differ from index ones)."""
    return torch.tensor(
        [
            [1] * 12,
            [0] * 3 + [1] * 9,
            [0] * 7 + [1] * 5,
            [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1],
        ],
        dtype=torch.bool,
    )


def _hf_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """HF generation's ``position_ids`` for a padded prompt: ``cumsum(mask) − 1``, padding at 1."""
    return (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)


# ------------------------------------------------------------------------------ T5
def _hf_t5_attention(num_buckets: int, max_distance: int, *, decoder: bool):
    """HF's first T5 self-attention layer (the one with the table), table filled at random."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    config = transformers.T5Config(
        d_model=16,
        d_kv=8,
        num_heads=2,
        num_layers=1,
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
        is_decoder=decoder,
    )
    layer = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    g = torch.Generator().manual_seed(num_buckets * 1000 + max_distance)
    with torch.no_grad():
        layer.relative_attention_bias.weight.copy_(torch.randn(num_buckets, 2, generator=g))
    return layer


@pytest.mark.parametrize(
    ("num_buckets", "max_distance", "bidirectional"),
    [(*t, b) for t in T5_TABLES for b in (True, False)] + [(7, 30, False), (3, 5, False)],
)
def test_t5_buckets_equal_hf(num_buckets, max_distance, bidirectional):
    """``t5_buckets(k − q)`` equals HF's ``_relative_position_bucket(memory − query)`` bucket for
    bucket on every distance in ±1500 (far past ``max_distance``), odd tables too when causal.
    The range reaches every bucket either function can give (bidirectional never uses bucket
    ``R/2``: distance 0 sits in the lower half), so a shifted log bucket or a swapped direction
    shows."""
    hf = pytest.importorskip("transformers.models.t5.modeling_t5")
    d = torch.arange(-1500, 1501)
    want = hf.T5Attention._relative_position_bucket(d, bidirectional, num_buckets, max_distance)
    got = t5_buckets(
        d, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert got.dtype == torch.long and torch.equal(got, want)
    assert got.unique().numel() == num_buckets - bidirectional


@directions
@pytest.mark.parametrize(("num_buckets", "max_distance"), T5_TABLES)
def test_t5_bias_equals_hf_compute_bias(num_buckets, max_distance, bidirectional):
    """The ``t5`` scheme with HF's ``relative_attention_bias.weight`` copied into its ``table``
    (both ``(buckets, heads)``) gives ``compute_bias``'s ``(1, h, i, j)`` bias exactly: the encoder
    (bidirectional) as a non-causal scheme, the decoder (``is_decoder``) as a causal one, over rows
    longer than ``max_distance`` (the shared far buckets) and every pair, masked or not. Then a
    decoding step: 3 queries after ``past_seen_tokens`` cached keys, ours at positions continuing
    the keys'."""
    hf = _hf_t5_attention(num_buckets, max_distance, decoder=not bidirectional)
    spec = {"name": "t5", "num_buckets": num_buckets, "max_distance": max_distance}
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=not bidirectional)
    assert scheme.table.shape == hf.relative_attention_bias.weight.shape
    with torch.no_grad():
        scheme.table.copy_(hf.relative_attention_bias.weight)
    n = max_distance + 23
    q = torch.zeros(1, 2, n, 8)
    p = Positions.from_length(n)
    with torch.no_grad():
        want = hf.compute_bias(n, n)
        got = scheme.score_bias(q, p, p)
        assert torch.equal(got, want)
        past = n - 3
        want = hf.compute_bias(3, n, past_seen_tokens=past)
        got = scheme.score_bias(q[:, :, :3], Positions.from_length(3, offset=past), p)
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------ ALiBi
ALIBI_HEADS = [*range(1, 13), 16, 20]


@pytest.mark.parametrize("num_heads", ALIBI_HEADS)
def test_alibi_slopes_equal_bloom_and_mpt(num_heads):
    """``alibi_slopes(h)`` equals Bloom's slopes (read from ``build_alibi_tensor`` at position 1)
    and MPT's (``build_mpt_alibi_tensor`` with its default ``alibi_bias_max=8``, read at distance
    −1), head by head: the paper's geometric sequence for a power of two, and otherwise the
    nearest lower power's slopes followed by every other slope of twice it (Press et al.'s
    ``get_slopes``). Bloom and MPT agree here for every head count (MPT interleaves the same two
    ladders), so relpos follows both. Bloom raises a float32 base to integer powers where relpos
    rounds the float64 value once: a few ulps apart from 11 heads on, hence ``rtol=1e-6``."""
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ours = alibi_slopes(num_heads)
    bloom = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)
    torch.testing.assert_close(ours, bloom.reshape(num_heads, 2)[:, 1], rtol=1e-6, atol=0)
    mpt = build_mpt_alibi_tensor(num_heads, 2)  # (h, 1, n): slope · (j − (n − 1))
    torch.testing.assert_close(ours, -mpt[:, 0, 0], rtol=1e-6, atol=0)
    scheme = relpos.make_scheme("alibi", d_model=8 * num_heads, num_heads=num_heads, causal=True)
    assert torch.equal(scheme.slopes, ours)


@pytest.mark.parametrize("num_heads", ALIBI_HEADS)
def test_alibi_bias_equals_bloom_up_to_a_per_query_constant(num_heads):
    """Bloom adds ``slope_h · p_j`` per key, ``p`` from the attention mask's ``cumsum − 1``; the
    causal ``alibi`` scheme (``Positions.from_padding_mask``) adds ``slope_h · (p_j − p_i)``. They
    differ by ``−slope_h · p_i``, a constant per query, which softmax ignores. The comparison
    removes that constant from Bloom's bias by subtracting its value at the query's own key
    (always allowed), and asks for ours as it is, over every allowed pair (both real, key not
    after the query): ``ours[i, j] = bloom[j] − bloom[i]``. It is exact in real arithmetic, so it
    would fail on a wrong slope (the smallest, ``2⁻⁸``, times a distance of 1 is far above the
    tolerance) or on positions that count padding (the row with a hole in the middle). Bloom has no
    bidirectional form; the symmetric ``−slope·|p_j − p_i|`` is not compared here."""
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = _batch_mask()
    b, n = mask.shape
    bloom = build_alibi_tensor(mask.long(), num_heads, torch.float32).reshape(b, num_heads, n)
    want = bloom[:, :, None, :] - bloom[:, :, :, None]  # (b, h, i, j): bloom[j] − bloom[i]
    scheme = relpos.make_scheme("alibi", d_model=8 * num_heads, num_heads=num_heads, causal=True)
    p = Positions.from_padding_mask(mask)
    got = scheme.score_bias(torch.zeros(b, num_heads, n, 8), p, p)
    allowed = mask[:, None, :] & mask[:, :, None] & torch.ones(n, n, dtype=torch.bool).tril()
    allowed = allowed[:, None].expand_as(got)
    assert got.shape == (b, num_heads, n, n) and allowed.sum() > 0
    torch.testing.assert_close(got[allowed], want[allowed], rtol=1e-6, atol=2e-6)


# ------------------------------------------------------------------------------ RoPE
def _real(mask: torch.Tensor, x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """The real tokens' values of ``x``, whose sequence axis is ``seq_dim``."""
    shape = [1] * x.ndim
    shape[0], shape[seq_dim] = mask.shape
    return x[mask.view(shape).expand_as(x)]


def test_rope_equals_llama_under_left_padding():
    """Llama's ``LlamaRotaryEmbedding`` (theta 5e5, head dim 32) and ``apply_rotary_pos_emb``, fed
    the ``position_ids`` HF generation builds from a padded mask, rotate every real token's query
    and key as the ``rope`` scheme does with ``Positions.from_padding_mask``: the half-split
    layout (pairs ``(x[m], x[m + d/2])``, relpos's default, ``interleaved=False``), float32 to
    ``2e-5``. Padding is left out (HF gives it position 1, relpos 0; it is masked). Then a decoding
    step of 2 tokens: HF's ``cumsum − 1`` of the extended mask, ours ``continued(2)``."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as hf

    theta = 500000.0
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    rotary = hf.LlamaRotaryEmbedding(config)
    spec = {"name": "rope", "theta": theta}
    scheme = relpos.make_scheme(spec, d_model=64, num_heads=2, causal=True)
    assert not scheme.config.interleaved
    torch.testing.assert_close(scheme.inv_freq, rotary.inv_freq, rtol=2e-6, atol=0)
    mask = _batch_mask()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(4, 2, 12, 32, generator=g) for _ in range(2))  # (b, h, n, d)
    cos, sin = rotary(q, _hf_position_ids(mask))
    want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    p = Positions.from_padding_mask(mask)
    got_q, got_k = scheme.rotate(q, k, p, p)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        torch.testing.assert_close(_real(mask, got, 2), _real(mask, want, 2), rtol=1e-5, atol=2e-5)

    # Decoding: two new tokens per row continue each row's positions.
    step_q, step_k = (torch.randn(4, 2, 2, 32, generator=g) for _ in range(2))
    extended = torch.cat([mask, torch.ones(4, 2, dtype=torch.bool)], dim=1)
    cos, sin = rotary(step_q, _hf_position_ids(extended)[:, -2:])
    want_q, want_k = hf.apply_rotary_pos_emb(step_q, step_k, cos, sin)
    step = p.continued(2)
    got_q, got_k = scheme.rotate(step_q, step_k, step, step)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=2e-5)


def test_interleaved_rope_equals_gptj_partial_rotary():
    """GPT-J's rotary (``GPTJRotaryEmbedding`` over ``create_sinusoidal_positions``, then
    ``apply_rotary_pos_emb`` on the first ``rotary_dim`` features, the rest passed through) under
    left padding equals the ``rope`` scheme with ``interleaved=True`` (pairs ``(x[2m], x[2m+1])``,
    the paper's layout) and the same ``rotary_dim`` (16 of head dim 32), on every real token."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gptj import modeling_gptj as hf

    config = transformers.GPTJConfig(n_embd=64, n_head=2, rotary_dim=16, n_positions=64)
    rotary = hf.GPTJRotaryEmbedding(config)
    spec = {"name": "rope", "rotary_dim": 16, "interleaved": True}
    scheme = relpos.make_scheme(spec, d_model=64, num_heads=2, causal=True)
    mask = _batch_mask()
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(4, 12, 2, 32, generator=g) for _ in range(2))  # GPT-J's (b, n, h, d)
    sin, cos = rotary(q, _hf_position_ids(mask))
    want_q, want_k = (
        torch.cat([hf.apply_rotary_pos_emb(x[..., :16], sin, cos), x[..., 16:]], dim=-1)
        for x in (q, k)
    )
    p = Positions.from_padding_mask(mask)
    got_q, got_k = scheme.rotate(q.transpose(1, 2), k.transpose(1, 2), p, p)
    for got, want in ((got_q.transpose(1, 2), want_q), (got_k.transpose(1, 2), want_k)):
        torch.testing.assert_close(_real(mask, got, 1), _real(mask, want, 1), rtol=1e-5, atol=2e-5)
