"""Per-head control of the bias schemes (``heads``): the heads left out get exactly zero bias, on
every backend and its fast paths (T5's region path, ALiBi's fused parts, flex's score_mods, sdpa's
mask), and no gradient; the others get the bias they get with every head selected. Bad indices
fail when the scheme is built, naming the field, the index and ``num_heads``."""

from __future__ import annotations

import json
import random

import pytest
import torch

import relpos
from relpos import Positions
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import chunked_attention, chunked_path
from relpos.attention.flex import flex_available, flex_supports
from tests.helpers import random_segments, randomize_parameters

H, D = 3, 4
SELECTED = [1]
BIAS_SPECS = [
    {"name": "alibi"},
    {"name": "learned_alibi"},
    {"name": "t5", "num_buckets": 8, "max_distance": 12},
    {"name": "kerple"},
    {"name": "kerple", "variant": "power"},
    {"name": "dpb", "hidden": 8, "depth": 1},
    {"name": "sandwich", "dim": 16},
    {"name": "fire", "hidden": 8, "init_threshold": 4.5},
]
BACKEND_NAMES = ["eager", "sdpa", "chunked", "chunked-tiles", "auto"]


def spec_name(spec: dict) -> str:
    return spec["name"] + ("-power" if spec.get("variant") == "power" else "")


def pair(spec: dict, causal: bool) -> tuple[relpos.Scheme, relpos.Scheme]:
    """The scheme with ``heads=[1]`` and with every head, sharing their parameters."""
    some = relpos.make_scheme(
        {**spec, "heads": SELECTED}, d_model=H * D, num_heads=H, causal=causal
    )
    every = relpos.make_scheme(spec, d_model=H * D, num_heads=H, causal=causal)
    randomize_parameters(some, 3)
    every.load_state_dict(some.state_dict())
    return some.double(), every.double()


def run(backend: str, q, k, v, scheme, qp, kp, causal):
    if backend == "chunked-tiles":
        return chunked_attention(q, k, v, scheme, qp, kp, causal=causal, q_block=4, k_block=5)
    return BACKENDS[backend](q, k, v, scheme, qp, kp, causal=causal)


def layouts(n: int) -> dict[str, Positions]:
    seg = torch.tensor([random_segments(random.Random(5), n) for _ in range(2)])
    return {"plain": Positions.from_length(n), "packed": Positions.from_segments(seg)}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BIAS_SPECS, ids=spec_name)
def test_left_out_heads_get_no_bias_on_every_backend(spec, causal):
    if spec["name"] == "fire" and not causal:
        pytest.skip("FIRE is causal only")
    some, every = pair(spec, causal)
    nope = relpos.make_scheme("nope", d_model=H * D, num_heads=H, causal=causal)
    others = [h for h in range(H) if h not in SELECTED]
    for layout, pos in layouts(19).items():
        bias = some.score_bias(None, pos, pos)
        assert (bias[:, others] == 0).all(), layout
        torch.testing.assert_close(bias[:, SELECTED], every.score_bias(None, pos, pos)[:, SELECTED])
        b = pos.batch
        q, k, v = (torch.randn(b, H, 19, D, dtype=torch.float64) for _ in range(3))
        free = BACKENDS["eager"](q, k, v, nope, pos, pos, causal=causal)
        full = BACKENDS["eager"](q, k, v, every, pos, pos, causal=causal)
        for backend in BACKEND_NAMES:
            out = run(backend, q, k, v, some, pos, pos, causal)
            msg = f"{backend}, {layout}"
            torch.testing.assert_close(out[:, others], free[:, others], msg=msg)
            torch.testing.assert_close(out[:, SELECTED], full[:, SELECTED], msg=msg)


#: Each learned scheme's per-head parameters and the axis of their heads. (The MLPs' output
#: biases shift every logit of a head alike: no gradient even where selected, so not listed.)
PER_HEAD = {
    "t5": lambda s: [(s.table, 1)],
    "kerple": lambda s: [(s.r1, 0), (s.r2, 0)],
    "learned_alibi": lambda s: [(s.slopes, 0)],
    "dpb": lambda s: [(s.mlp[-1].weight, 0)],
    "fire": lambda s: [(s.mlp[2].weight, 0)],
}


@pytest.mark.parametrize("backend", ["eager", "chunked"])
@pytest.mark.parametrize("spec", [s for s in BIAS_SPECS if s["name"] in PER_HEAD], ids=spec_name)
def test_left_out_heads_get_no_parameter_gradient(spec, backend):
    some, _ = pair(spec, True)
    pos = layouts(9)["packed"]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, 9, D, dtype=torch.float64, generator=g) for _ in range(3))
    params = [*PER_HEAD[spec["name"]](some)]
    if spec["name"] in ("dpb", "fire"):
        params.append((some.mlp[-1].bias, 0))
    out = BACKENDS[backend](q, k, v, some, pos, pos, causal=True)
    grads = torch.autograd.grad(out.square().sum(), [p for p, _ in params])
    for t, (grad, (_, axis)) in enumerate(zip(grads, params, strict=True)):
        assert (grad.index_select(axis, torch.tensor([0, 2])) == 0).all()
        if t < len(PER_HEAD[spec["name"]](some)):
            assert (grad.select(axis, 1) != 0).any()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", ["t5", "alibi"])
def test_fused_cpu_paths_on_long_plain_rows(name, causal):
    """T5's region path (far field on the fused kernel) and ALiBi's fused parts, past the band."""
    spec = {"name": "t5", "num_buckets": 8, "max_distance": 12} if name == "t5" else {"name": name}
    some, every = pair(spec, causal)
    n = 160
    pos = Positions.from_length(n)
    assert chunked_path(some, torch.zeros(1, H, n, D), pos, pos) == (
        "region" if name == "t5" else "alibi"
    )
    q, k, v = (torch.randn(1, H, n, D, dtype=torch.float64) for _ in range(3))
    nope = relpos.make_scheme("nope", d_model=H * D, num_heads=H, causal=causal)
    out = BACKENDS["chunked"](q, k, v, some, pos, pos, causal=causal)
    free = BACKENDS["eager"](q, k, v, nope, pos, pos, causal=causal)
    full = BACKENDS["eager"](q, k, v, every, pos, pos, causal=causal)
    torch.testing.assert_close(out[:, [0, 2]], free[:, [0, 2]])
    torch.testing.assert_close(out[:, 1], full[:, 1])


@pytest.mark.parametrize(  # one score_mod by default (compiling FlexAttention takes seconds)
    "spec",
    [BIAS_SPECS[0], *(pytest.param(BIAS_SPECS[t], marks=pytest.mark.slow) for t in (2, 3))],
    ids=spec_name,
)
def test_flex_score_mods_in_inference(spec):
    if not flex_available():
        pytest.skip("FlexAttention is not available in this torch")
    some, every = pair(spec, True)
    some, every = some.float(), every.float()
    assert flex_supports(some, needs_grad=False)
    pos = layouts(24)["packed"]
    q, k, v = (torch.randn(2, H, 24, 8) for _ in range(3))
    with torch.no_grad():
        try:
            out = BACKENDS["flex"](q, k, v, some, pos, pos, causal=True)
        except Exception as e:  # no C++ compiler, unsupported build
            if isinstance(e, ValueError):
                raise
            pytest.skip(f"FlexAttention does not compile here: {type(e).__name__}: {e}")
        nope = relpos.make_scheme("nope", d_model=H * 8, num_heads=H, causal=True)
        free = BACKENDS["eager"](q, k, v, nope, pos, pos, causal=True)
        full = BACKENDS["eager"](q, k, v, every, pos, pos, causal=True)
    torch.testing.assert_close(out[:, [0, 2]], free[:, [0, 2]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 1], full[:, 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", BIAS_SPECS, ids=spec_name)
def test_config_round_trip_and_errors(spec):
    config = relpos.config_from_dict({**spec, "heads": [2, 0]})
    assert config.heads == (0, 2)  # a canonical, sorted tuple
    data = json.loads(json.dumps(config.to_dict()))
    assert data["heads"] == [0, 2] and relpos.config_from_dict(data) == config
    assert relpos.config_from_dict(spec).heads is None
    with pytest.raises(ValueError, match=r"heads \[0, 3\]: head 3 is out of range for num_heads=3"):
        relpos.make_scheme({**spec, "heads": [0, 3]}, d_model=12, num_heads=3, causal=True)
    for bad, message in [
        ([], "heads must be None .every head. or a non-empty list"),
        (1, "heads must be None"),
        ([0, -1], r"heads\[1\] must be an int >= 0 \(a head index\), got -1"),
        ([True], r"heads\[0\] must be an int >= 0"),
        ([1, 1], r"heads lists a head twice: \[1, 1\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            relpos.config_from_dict({**spec, "heads": bad})
