"""Bad input: a clear ValueError/TypeError naming the argument, what was received and expected."""

from __future__ import annotations

import pytest
import torch

import relpos
from relpos import (
    MultiheadAttention,
    MusicConfig,
    Positions,
    RotaryConfig,
    ShawConfig,
    Transformer,
    TransformerConfig,
)


def model(scheme, **kw) -> Transformer:
    sizes = {"vocab_size": 7, "d_model": 8, "num_heads": 2, "num_layers": 1, **kw}
    return Transformer(TransformerConfig(scheme=scheme, **sizes))


CASES = [
    (
        "x of wrong rank",
        lambda: MultiheadAttention(8, 2)(torch.randn(3, 8)),
        ValueError,
        r"x must have shape \(b, n, d_model=8\), got \(3, 8\)",
    ),
    (
        "x of wrong width",
        lambda: MultiheadAttention(8, 2)(torch.randn(1, 3, 6)),
        ValueError,
        r"got \(1, 3, 6\)",
    ),
    (
        "tokens of wrong rank",
        lambda: model("nope")(torch.zeros(1, 2, 3, dtype=torch.long)),
        ValueError,
        r"tokens must have shape \(b, n\), got \(1, 2, 3\)",
    ),
    (
        "d_model not divisible",
        lambda: MultiheadAttention(10, 3),
        ValueError,
        r"d_model \(10\) must be divisible by num_heads \(3\)",
    ),
    ("model d_model not divisible", lambda: model("nope", num_heads=3), ValueError, "divisible"),
    (
        "odd sinusoidal width",
        lambda: relpos.make_scheme("sinusoidal", d_model=7, num_heads=1, causal=True),
        ValueError,
        "even d_model, got 7",
    ),
    ("odd rotary dim", lambda: RotaryConfig(rotary_dim=3), ValueError, "rotary_dim must be even"),
    (
        "rotary dim past head dim",
        lambda: relpos.make_scheme(
            {"name": "rope", "rotary_dim": 8}, d_model=8, num_heads=2, causal=True
        ),
        ValueError,
        r"<= head_dim \(4\), got 8",
    ),
    (
        "past the learned table",
        lambda: model({"name": "learned", "max_len": 4})(torch.zeros(1, 6, dtype=torch.long)),
        ValueError,
        r"position 5 is past the learned table \(max_len=4\)",
    ),
    (
        "negative Shaw k",
        lambda: ShawConfig(max_distance=-1),
        ValueError,
        "max_distance must be >= 0, got -1",
    ),
    (
        "negative music distance",
        lambda: MusicConfig(max_distance=-2),
        ValueError,
        "max_distance must be >= 0",
    ),
    ("non-int k", lambda: ShawConfig(max_distance=2.5), TypeError, "max_distance must be an int"),
    (
        "mask shape mismatch",
        lambda: MultiheadAttention(8, 2)(
            torch.randn(2, 5, 8), padding_mask=torch.ones(2, 4, dtype=torch.bool)
        ),
        ValueError,
        r"padding_mask must have shape \(b, n\) = \(2, 5\), got \(2, 4\)",
    ),
    (
        "segment shape mismatch",
        lambda: MultiheadAttention(8, 2)(
            torch.randn(2, 5, 8), segment_ids=torch.zeros(5, dtype=torch.long)
        ),
        ValueError,
        r"segment_ids must have shape \(b, n\) = \(2, 5\), got \(5,\)",
    ),
    (
        "positions shape mismatch",
        lambda: MultiheadAttention(8, 2)(torch.randn(2, 5, 8), Positions.from_length(4)),
        ValueError,
        r"positions have shape \(b, n\) = \(1, 4\); expected \(2, 5\) or \(1, 5\)",
    ),
    (
        "float positions",
        lambda: Positions(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long)),
        TypeError,
        "pos must hold integers, got dtype torch.float32",
    ),
    (
        "float segment ids",
        lambda: MultiheadAttention(8, 2)(torch.randn(1, 3, 8), segment_ids=torch.zeros(1, 3)),
        TypeError,
        "segment_ids must hold integers",
    ),
    (
        "two position sources",
        lambda: MultiheadAttention(8, 2)(
            torch.randn(1, 3, 8),
            Positions.from_length(3),
            padding_mask=torch.ones(1, 3, dtype=torch.bool),
        ),
        ValueError,
        "at most one of",
    ),
    (
        "unknown scheme",
        lambda: relpos.make_scheme("rotary9", d_model=8, num_heads=2, causal=True),
        ValueError,
        "unknown scheme 'rotary9'; registered schemes",
    ),
    (
        "unknown scheme key",
        lambda: relpos.config_from_dict({"name": "t5", "buckets": 3}),
        ValueError,
        r"unknown key\(s\) \['buckets'\] for scheme 't5'",
    ),
    (
        "unknown model key",
        lambda: TransformerConfig.from_dict({"vocab_size": 3, "layers": 2}),
        ValueError,
        r"unknown model config key\(s\) \['layers'\]",
    ),
    (
        "scheme built for other geometry",
        lambda: MultiheadAttention(
            8, 2, relpos.make_scheme("t5", d_model=16, num_heads=2, causal=False)
        ),
        ValueError,
        "scheme was built for d_model=16",
    ),
    (
        "token out of vocab",
        lambda: model("nope")(torch.tensor([[1, 9]])),
        ValueError,
        r"token ids must lie in \[0, 7\)",
    ),
    (
        "odd T5 buckets bidirectional",
        lambda: relpos.make_scheme(
            {"name": "t5", "num_buckets": 7}, d_model=8, num_heads=2, causal=False
        ),
        ValueError,
        "even num_buckets",
    ),
    (
        # One bucket per direction leaves no exact bucket to scale the log buckets by: this used
        # to divide by zero inside t5_buckets at the first forward pass.
        "two T5 buckets bidirectional",
        lambda: relpos.make_scheme(
            {"name": "t5", "num_buckets": 2, "max_distance": 4},
            d_model=8,
            num_heads=2,
            causal=False,
        ),
        ValueError,
        r"even num_buckets >= 4 .*got 2",
    ),
    (
        "two T5 buckets bidirectional, functional",
        lambda: relpos.functional.t5_buckets(torch.arange(3), bidirectional=True, num_buckets=2),
        ValueError,
        r"even and >= 4 when bidirectional.*got 2",
    ),
    (
        "unknown backend",
        lambda: MultiheadAttention(8, 2, backend="cuda-magic"),
        ValueError,
        "unknown backend 'cuda-magic'",
    ),
    (
        "bad dropout",
        lambda: MultiheadAttention(8, 2, dropout=1.5),
        ValueError,
        r"dropout must be in \[0, 1\)",
    ),
    (
        "float offset",
        lambda: relpos.Positions.from_length(4, offset=1.5),
        TypeError,
        "offset must be an int or an integer tensor, got float",
    ),
    (
        "list offset",
        lambda: relpos.Positions.from_length(4, offset=[1, 2]),
        TypeError,
        "offset must be an int or an integer tensor, got list",
    ),
    (
        "float continued",
        lambda: relpos.Positions.from_length(3).continued(1.5),
        TypeError,
        r"n must be an int, got float \(1.5\)",
    ),
]


@pytest.mark.parametrize(("what", "call", "error", "match"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(what, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_step_of_another_batch_than_the_cache_is_refused():
    attn = MultiheadAttention(8, 2, "alibi", causal=True)
    cache = relpos.KVCache()
    attn(torch.randn(2, 3, 8), cache=cache)
    with pytest.raises(ValueError, match=r"the cache holds 2 rows; the new tokens come in 3 rows"):
        attn(torch.randn(3, 1, 8), cache=cache)


def test_mask_with_a_non_empty_cache_is_refused():
    attn = MultiheadAttention(8, 2, "rope", causal=True)
    cache = relpos.KVCache()
    attn(torch.randn(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="cannot be combined with a non-empty KV cache"):
        attn(torch.randn(1, 1, 8), padding_mask=torch.ones(1, 1, dtype=torch.bool), cache=cache)
    with pytest.raises(ValueError, match="batch, heads and head dim must match"):
        attn(torch.randn(2, 1, 8), cache=cache)
