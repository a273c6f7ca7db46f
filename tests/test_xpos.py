"""xPos (Sun et al., 2022): RoPE with a decay ``ζ_m^((n-m)/γ)`` split over q and k.

Causal only, so it is not in the shared ``SCHEME_SPECS`` (whose suites run both directions); the
same checks run here: the loop oracle (outputs and gradients), padded, packed and cached parity on
every backend the parity suite uses, config round trips, and the dtype guard.
"""

import json
import random

import pytest
import torch

import relpos
from relpos import Positions, Transformer, TransformerConfig, checks
from relpos.functional import xpos_max_position
from relpos.spec.rope import check_xpos_position
from tests.helpers import randomize_parameters
from tests.test_oracle import check_against_oracle

SPEC = {"name": "rope", "xpos_scale_base": 8.0}  # a small γ: the decay shows over a few tokens
VOCAB = 13


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("plain", [True, False], ids=["plain", "padded-packed"])
@pytest.mark.parametrize("spec", [SPEC, {**SPEC, "interleaved": True, "rotary_dim": 4}])
def test_attention_matches_oracle(spec, plain, seed):
    check_against_oracle(spec, True, seed, plain=plain)
    check_against_oracle(spec, True, seed, cached=True)


def model(backend: str) -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=VOCAB, d_model=16, num_heads=2, num_layers=2, dropout=0.0, causal=True,
        scheme=SPEC, backend=backend,
    )  # fmt: skip
    m = Transformer(cfg).eval()
    randomize_parameters(m)
    return m


@pytest.mark.filterwarnings("ignore::UserWarning")
# xPos scales q and k before any backend sees them, so one backend checks the rows by default
# (the backends' own equality with eager is tested in test_backends.py); all under test-all.
@pytest.mark.parametrize(
    "backend",
    ["auto", *(pytest.param(b, marks=pytest.mark.slow) for b in ("eager", "sdpa", "chunked"))],
)
def test_every_row_gets_what_it_gets_alone(backend):
    rng = random.Random(0)
    docs = [torch.tensor([rng.randrange(VOCAB) for _ in range(n)]) for n in (9, 4, 6)]
    m = model(backend)
    assert checks.padded_gap(m, docs, side="left") < 1e-5
    assert checks.padded_gap(m, docs, side="right") < 1e-5
    assert checks.packed_gap(m, [docs[:2], docs[2:]]) < 1e-5
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    assert checks.cached_gap(m, tokens, chunk=1) < 1e-5
    assert checks.cached_gap(m, tokens, chunk=3) < 1e-5
    assert checks.left_padded_decoding_gap(m, docs, tokens[:3, :4].repeat(2, 1)[:3]) < 1e-5


def test_the_logits_decay_with_distance_only():
    """Shifting every position leaves attention unchanged; with identical keys, a query weighs
    nearer keys more (the decay), which plain RoPE does not do."""
    torch.manual_seed(0)
    attn = relpos.MultiheadAttention(16, 2, SPEC, causal=True, backend="eager").eval()
    x = torch.randn(1, 12, 16)
    with torch.no_grad():
        a = attn(x, Positions.from_length(12))
        b = attn(x, Positions.from_length(12, offset=50))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    scheme = relpos.make_scheme(SPEC, d_model=16, num_heads=2, causal=True)
    q = k = torch.ones(1, 1, 8, 8)  # pairs (1, 1): rotation would change the logits too
    pos = Positions.from_length(8)
    qr, kr = scheme.rotate(q, k, pos, pos)
    # Pair m of the product: cos((n-m')·ω)·ζ^((n-m')/γ); at distance 0 that is 1 for every pair.
    logits = qr[0, 0] @ kr[0, 0].T
    torch.testing.assert_close(logits.diagonal(), torch.full((8,), 8.0))


def test_positions_past_the_dtype_range_are_refused():
    limit = xpos_max_position(torch.float16, 8.0)
    attn = relpos.MultiheadAttention(16, 2, SPEC, causal=True).to(torch.float16)
    x = torch.randn(1, 2, 16, dtype=torch.float16)
    assert torch.isfinite(attn(x, Positions.from_length(2, offset=limit - 1))).all()
    with pytest.raises(
        ValueError, match=rf"xPos scales overflow torch.float16 beyond position {limit}"
    ):
        attn(x, Positions.from_length(2, offset=limit))
    # bf16 has float32's range: far positions stay finite.
    bf = relpos.MultiheadAttention(16, 2, {**SPEC, "xpos_scale_base": 512.0}, causal=True)
    y = bf.to(torch.bfloat16)(x.bfloat16(), Positions.from_length(2, offset=15000))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize(
    ("dtype", "position", "advice"),
    [
        ("float16", 3000, "use bfloat16 or float32 or float64, or an xpos_scale_base of at least"),
        ("bfloat16", 30000, "use float64, or an xpos_scale_base of at least 848$"),
        ("float64", 10**7, r"position 10000000: an xpos_scale_base of at least 35301$"),
    ],
)
def test_the_overflow_advice_names_what_reaches_the_position(dtype, position, advice):
    """Issue 45 item 7: a bfloat16 input was told to "use float32 or bfloat16"; the advice now
    lists the dtypes whose range reaches the position (none past float64's) and the scale base
    that does."""
    with pytest.raises(ValueError, match=advice):
        check_xpos_position(position, dtype, 512.0)


def test_config_and_errors():
    config = relpos.RotaryConfig(xpos_scale_base=512.0)
    assert relpos.config_from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="xPos needs causal attention"):
        relpos.MultiheadAttention(16, 2, SPEC, causal=False)
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="xpos_scale_base must be a finite number > 0"):
            relpos.RotaryConfig(xpos_scale_base=bad)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_torch_compile_smoke():
    m = model("auto")
    tokens = torch.randint(0, VOCAB, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]).bool()
    compiled = torch.compile(m, dynamic=False)
    torch.testing.assert_close(compiled(tokens, padding_mask=mask), m(tokens, padding_mask=mask))
