"""Every backend on CUDA against ``eager`` in float64 on the CPU: outputs and gradients.

Skipped cleanly where no CUDA device is present (``RELPOS_TEST_DEVICE`` names another device to
run the same cases there, e.g. ``cpu`` for a dry run of the file).

Each case runs ``eager`` in float64 on the CPU (the reference), then the backend on the device in
float32 and in bfloat16 over the same inputs, parameters and positions (rounded to that dtype first,
so the reference computes exactly the function the device is given) (plain, packed documents with
padding, a KV cache after a left-padded prompt). The error of every tensor (the output, the
gradients of ``q``, ``k``, ``v`` and of every parameter) is measured against the reference's norm:
``‖x − ref‖ / max(‖ref‖, 1)``, at most :data:`TOLERANCE` ``[dtype]``: ``1e-4`` for float32 (no TF32:
the matmul flag is left off), ``5e-2`` for bfloat16 (8-bit mantissa inputs; a softmax and a few
matmuls in between). A NaN never passes.

``fused`` (the Triton kernel; ``tests/fused`` checks it on CPU through Triton's interpreter)
runs every relative scheme it supports. ``flex`` (FlexAttention with a backward pass: CUDA
only) runs every scheme it supports, its masks as ``BlockMask``; each case compiles once, so
Dynamo's recompile limit is raised for the file and a hit of it fails the test instead of running
unfused.
"""

from __future__ import annotations

import copy
import os
import random
import zlib

import pytest
import torch

import relpos
from relpos.attention.backends import BACKENDS
from relpos.attention.flex import flex_available, flex_supports
from relpos.attention.fused import fused_supports
from relpos.kernels import interpreted
from tests.helpers import (
    BACKEND_SPECS,
    has_value_term,
    make_layout,
    randomize_parameters,
    skip_if_refused_deterministic,
    spec_id,
)

DEVICE = os.environ.get("RELPOS_TEST_DEVICE", "cuda")
#: Largest ``‖x − ref‖ / ‖ref‖`` per tensor, by dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
LAYOUTS = ["plain", "packed", "cached"]


def _device_present() -> bool:
    if DEVICE.startswith("cuda"):
        return torch.cuda.is_available()
    return DEVICE == "cpu"


pytestmark = [
    pytest.mark.skipif(not _device_present(), reason=f"no {DEVICE} device"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def compiled_for_real():
    """Every ``flex`` call runs its compiled kernel: past Dynamo's recompile limit it would run
    unfused, silently; here that is an error."""
    with torch._dynamo.config.patch(
        recompile_limit=256, accumulated_recompile_limit=4096, fail_on_recompile_limit_hit=True
    ):
        yield


def relative_error(x: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """``‖x − ref‖ / max(‖ref‖, 1)`` in float64 on the CPU: a gradient that is zero in exact
    arithmetic (DeBERTa's key-projection bias: softmax cancels it) is held to the tolerance in
    absolute terms. An absent tensor counts as zeros."""
    if x is None or ref is None:
        other = ref if x is None else x
        return 0.0 if other is None else float(other.double().abs().max())
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    scale = ref.norm().clamp_min(1.0)
    return float((x - ref).norm() / scale)


def run_on_device(backend: str, spec: dict, causal: bool, layout: str, dtype: torch.dtype):
    """``[(name, error)]`` for the output and every gradient of ``backend`` on :data:`DEVICE` in
    ``dtype`` against ``eager`` in float64 on the CPU."""
    seed = zlib.crc32(f"{spec_id(spec)}{causal}{layout}{backend}".encode())
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, h, d, n = rng.randint(1, 3), rng.randint(1, 3), 8 * rng.randint(1, 2), rng.randint(24, 48)
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal).double()
    randomize_parameters(scheme, seed)
    qp, kp = make_layout(layout, rng, b, n)
    q = torch.randn(b, h, len(qp), d, dtype=torch.float64)
    k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn(b, h, len(qp), d, dtype=torch.float64)
    # The reference sees the same numbers as the device: inputs and parameters rounded to dtype.
    q, k, v, grad_out = (t.to(dtype).double() for t in (q, k, v, grad_out))
    scheme = scheme.to(dtype).double()

    def forward_backward(name, scheme, q, k, v, qp, kp, grad_out):
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        qr, kr = scheme.rotate(q, k, qp, kp)
        out = BACKENDS[name](qr, kr, v, scheme, qp, kp, causal=causal)
        assert out.dtype == q.dtype and out.device == q.device
        params = list(scheme.parameters())
        grads = torch.autograd.grad(out, [q, k, v, *params], grad_out, allow_unused=True)
        return [out, *grads]

    ref = forward_backward("eager", scheme, q, k, v, qp, kp, grad_out)
    moved = copy.deepcopy(scheme).to(device=DEVICE, dtype=dtype)
    got = forward_backward(
        backend,
        moved,
        *(t.to(DEVICE, dtype) for t in (q, k, v)),
        qp.to(DEVICE),
        kp.to(DEVICE),
        grad_out.to(DEVICE, dtype),
    )
    names = ["out", "dq", "dk", "dv", *(f"d{p}" for p, _ in scheme.named_parameters())]
    return [(name, relative_error(x, r)) for name, x, r in zip(names, got, ref, strict=True)]


def check(backend: str, spec: dict, causal: bool, layout: str, dtype: torch.dtype) -> None:
    if layout == "cached" and not causal:
        pytest.skip("a KV cache is for causal decoding")
    errors = run_on_device(backend, spec, causal, layout, dtype)
    bad = [(name, e) for name, e in errors if not e <= TOLERANCE[dtype]]
    assert not bad, f"relative errors over {TOLERANCE[dtype]:g}: {bad}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_on_device_matches_eager(dtype, backend, spec, causal, layout):
    if backend == "sdpa" and has_value_term(spec):
        pytest.skip("sdpa does not support a value term (auto picks chunked)")
    check(backend, spec, causal, layout, dtype)


def _flex_runs(spec: dict, causal: bool) -> bool:
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=1, causal=causal)
    return flex_supports(scheme, device=torch.device(DEVICE), needs_grad=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_on_device_matches_eager(dtype, spec, causal, layout):
    if not flex_available() or not _flex_runs(spec, causal):
        pytest.skip(f"flex does not run {spec_id(spec)} with gradients on {DEVICE}")
    if dtype == torch.bfloat16 and layout != "packed":
        pytest.skip("bfloat16: the packed layout stands for the others (one compile each)")
    check("flex", spec, causal, layout, dtype)


def _fused_runs(spec: dict, causal: bool) -> bool:
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=1, causal=causal)
    return "fused" in BACKENDS and fused_supports(scheme, device=DEVICE)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", BACKEND_SPECS, ids=spec_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_on_device_matches_eager(dtype, spec, causal, layout):
    if not _fused_runs(spec, causal):
        pytest.skip(f"fused does not run {spec_id(spec)} on {DEVICE}")
    if dtype == torch.bfloat16 and interpreted():
        pytest.skip("Triton's interpreter gets bfloat16 products wrong (tests/fused: float16)")
    check("fused", spec, causal, layout, dtype)


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "t5"},
        {"name": "alibi"},
        {"name": "learned_alibi"},
        {"name": "shaw", "max_distance": 8},
        {"name": "music", "max_distance": 24},
        {"name": "music", "max_distance": 200},  # past fused's register rows: atomic adds
    ],
    ids=spec_id,
)
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flex", "fused"])
def test_deterministic_mode_repeats_every_gradient_bit_for_bit(backend, spec, deterministic):
    """Under ``torch.use_deterministic_algorithms(True)`` a backend gives the same gradients, bit
    for bit, on a second run (the learned tables' included, which ``fused`` sums across pairs),
    or refuses where those sums are atomic: ``fused`` past its register rows, ``flex`` for any
    term with a gradient (a refusal by PyTorch's own kernels is a skip that names it)."""
    causal = True
    if backend == "flex" and not _flex_runs(spec, causal):
        pytest.skip(f"flex does not run {spec_id(spec)} with gradients on {DEVICE}")
    if backend == "fused" and not _fused_runs(spec, causal):
        pytest.skip(f"fused does not run {spec_id(spec)} on {DEVICE}")
    if backend == "sdpa" and has_value_term(spec):
        pytest.skip("sdpa has no value term")
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=64, num_heads=2, causal=causal).to(DEVICE)
    randomize_parameters(scheme, 0)
    qp = relpos.Positions.from_segments(torch.tensor([[0] * 170 + [1] * 130], device=DEVICE))
    q, k, v, grad_out = (torch.randn(2, 2, 300, 32, device=DEVICE) for _ in range(4))
    deterministic(True)

    def gradients() -> list[torch.Tensor]:
        inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
        qr, kr = scheme.rotate(*inputs[:2], qp, qp)
        out = BACKENDS[backend](qr, kr, inputs[2], scheme, qp, qp, causal=causal)
        return [out, *torch.autograd.grad(out, [*inputs, *scheme.parameters()], grad_out)]

    rows = spec["max_distance"] + 1 if spec["name"] == "music" else 0  # causal: 0..M
    atomic = {
        "fused": rows > 128,  # past relative_attention.MAX_LOOP_ROWS
        "flex": spec["name"] != "alibi",  # a learned table, learned slopes, q·Eᵀ: all summed
    }
    if atomic.get(backend):
        with pytest.raises(RuntimeError, match="not deterministic"):
            gradients()
        return
    try:
        first = gradients()
    except RuntimeError as e:  # PyTorch's own kernels (sdpa's) may refuse the mode too
        skip_if_refused_deterministic(e, f"{backend} refuses deterministic mode")
    second = gradients()
    names = ["out", "dq", "dk", "dv", *(f"d{p}" for p, _ in scheme.named_parameters())]
    differ = [n for n, a, b in zip(names, first, second, strict=True) if not torch.equal(a, b)]
    assert not differ, f"{backend} repeats these only to rounding: {differ}"


def peak_bytes(backend: str, scheme, n: int, b: int = 1, h: int = 2, d: int = 32) -> int:
    """Peak bytes the CUDA allocator hands out during one forward+backward pass at length ``n``,
    above the inputs; measured on a second call (the first compiles and caches a BlockMask)."""
    pos = relpos.Positions.from_length(n, device=DEVICE)
    q, k, v = (torch.randn(b, h, n, d, device=DEVICE, requires_grad=True) for _ in range(3))
    peak = 0
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        scheme.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        BACKENDS[backend](q, k, v, scheme, pos, pos, causal=True).sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return peak


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "alibi"},
        {"name": "t5", "num_buckets": 32, "max_distance": 128},
        {"name": "shaw", "max_distance": 16, "values": False},
        {"name": "shaw", "max_distance": 16},
        {"name": "music", "max_distance": 256},
        {"name": "kerple"},
    ],
    ids=spec_id,
)
@pytest.mark.parametrize("backend", ["flex", "chunked", "fused"])
def test_no_square_tensor_on_device(backend, spec):
    """Memory grows linearly with ``L``: doubling 2048 -> 4096 less than triples the peak of a
    forward+backward pass (an ``(i, j)`` tensor would quadruple it), and at 4096 the peak stays
    under half of one ``(b, h, L, L)`` float32 tensor."""
    if not DEVICE.startswith("cuda"):
        pytest.skip("peak allocator memory is measured on CUDA")
    if backend == "flex" and not _flex_runs(spec, True):
        pytest.skip("flex does not run this scheme")
    if backend == "fused" and not _fused_runs(spec, True):
        pytest.skip("fused does not run this scheme")
    scheme = relpos.make_scheme(spec, d_model=64, num_heads=2, causal=True).to(DEVICE)
    short, long = peak_bytes(backend, scheme, 2048), peak_bytes(backend, scheme, 4096)
    square = 2 * 4096 * 4096 * 4
    assert long < 3 * short, f"peak {short / 2**20:.1f} -> {long / 2**20:.1f} MiB"
    assert long < square / 2, f"peak {long / 2**20:.1f} MiB vs (b, h, L, L) {square / 2**20:.0f}"
