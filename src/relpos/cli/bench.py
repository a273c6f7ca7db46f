"""Attention speed and memory per scheme × backend: ``relpos bench``.

``python -m relpos.cli.bench`` is the same (it runs :func:`relpos.cli.main` with ``bench``): the
options are checked before anything runs, and a bad one is refused in one line naming it (status 2).

For every configuration (scheme, implementation, length ``L``, batch ``B``, causal or not) it
measures, on inputs ``q, k, v`` of shape ``(B, H, L, d)`` (``H=8``, ``d=64`` by default):

* forward time and forward+backward time: the median of ``--repeats`` (>= 5) runs after
  ``--warmup`` runs, each also printed as a ratio to plain SDPA with no bias (``sdpa-plain``) at
  the same shape: every run alternates with a run of plain SDPA, and the ratio is the median of
  the run-by-run ratios, so that a drift in the machine's speed hits both alike;
* the first forward+backward call at the shape, before any warm-up: for ``flex`` it includes
  compiling the kernels for that shape (``first s``);
* on CUDA, where the forward+backward time goes (:mod:`.profiling`): the device's busy time
  (``device ms``, the profiler's kernels and copies added up, and its ratio to plain SDPA's,
  ``device × plain``: the kernels' own speed, whatever the host costs), the host's time to issue
  the pass (``host ms``: a training loop issuing passes back to back takes at least this long),
  and ``kernels.md``, the device time per kernel;
* peak memory of one forward+backward pass above the inputs: on CPU in a fresh subprocess per
  configuration, the peak resident set size (``ru_maxrss``) minus the resident size once the
  inputs exist (after a small warm-up that loads the kernels); on CUDA in the same process,
  ``torch.cuda.max_memory_allocated`` minus the memory allocated before the pass (the caching
  allocator's reserve is not counted).

``--tokens N`` fixes ``B·L``: each length runs with ``B = N // L`` (the GPU protocol: the same
work per step at every length).

Implementations: the library's backends (``eager``, ``sdpa``, ``chunked``, and ``flex`` on CUDA,
where FlexAttention has a backward pass; the table says which one ``auto`` picks) and peers:
``naive-shaw`` (Shaw et al. as written, the ``(L, L, d)`` relative embeddings materialised),
``sdpa-bias`` (SDPA with the bias materialised as a ``(B, H, L, L)`` float mask) and, for the Music
Transformer, ``eager`` is the skew of Huang et al. Configurations that would not fit in memory or
time are skipped with the reason; so is a requested (scheme, implementation) that cannot run here at
all (the library's own refusal: ``flex`` with gradients on CPU, ``chunked`` for CoPE, ...), once,
before the measurements and below the table. Where none of ``--impls`` runs any of ``--schemes``,
the command is refused (status 2).

Results: ``bench.md`` (markdown table), ``bench.png`` (time and memory vs ``L``), ``bench.json``
and, on CUDA, ``kernels.md`` in ``--out``, each written atomically (temporary file, then
``os.replace``). The tables are rewritten after every configuration and ``bench.png`` is drawn
at the end: until then (and for good with ``--no-plot``, or when a run is cut short) no
``bench.png`` is left beside them, so that every file in ``--out`` is of the same run.

Shape legend: ``B`` batch, ``H`` heads, ``L`` tokens, ``d`` head dim.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..atomic import atomic_path
from ..runtime import cpu_name, flush_denormals, retain_freed_memory
from .checks import CLIError, Parser, output_folder
from .profiling import device_split, wait_for_device

__all__ = [
    "IMPLEMENTATIONS",
    "Config",
    "NotRun",
    "Result",
    "Setup",
    "backend_call",
    "check_args",
    "cuda_peak_bytes",
    "main",
    "make_setup",
    "measure_memory",
    "measure_time",
    "not_run",
    "render_markdown",
    "run",
    "sdpa_plain",
    "skip_reason",
    "wall_times",
]

SCHEMES = [
    "rope",
    "alibi",
    "t5",
    "shaw",
    "music",
    "transformer_xl",
    "deberta",
    "cope",
    "kerple",
    "learned_alibi",
    "dpb",
    "forgetting",
    "fire",
    "sandwich",
]
DEFAULT_LENGTHS = [256, 1024, 2048]
ALL_LENGTHS = [256, 1024, 2048, 4096, 8192]


# ----------------------------------------------------------------------------- implementations
@dataclass
class Setup:
    """Inputs of one configuration: ``q, k, v (B, H, L, d)``, the scheme and the positions."""

    q: Tensor
    k: Tensor
    v: Tensor
    scheme: Any
    positions: Any
    causal: bool
    #: The layer input ``(B, L, H·d)`` a contextual scheme (the forget gate) reads, else None.
    x: Tensor | None = None


def _positions(s: Setup) -> Any:
    """The call's positions: a contextual scheme computes its values from ``x`` at every call
    (part of its cost, and a fresh graph for every backward)."""
    if s.x is None:
        return s.positions
    return s.scheme.contextualize(s.x, s.positions)


def _backend(name: str) -> Callable[..., Tensor]:
    """The backend ``name``: the registered one, or for ``flex`` and ``fused`` (registered only
    where they can run at all) their own function, whose error says why it cannot run here."""
    from ..attention.backends import BACKENDS

    if name in BACKENDS:
        return BACKENDS[name]
    from ..attention import flex, fused

    return {"flex": flex.flex_attention_backend, "fused": fused.fused_attention}[name]


def backend_call(name: str) -> Callable[[Setup], Tensor]:
    """The backend ``name`` as a function of a :class:`Setup` (rotating ``q, k``)."""

    def fn(s: Setup) -> Tensor:
        p = _positions(s)
        q, k = s.scheme.rotate(s.q, s.k, p, p)
        return _backend(name)(q, k, s.v, s.scheme, p, p, causal=s.causal)

    return fn


def sdpa_plain(s: Setup) -> Tensor:
    """Plain SDPA with no bias (NoPE, ``is_causal``): the baseline every ratio divides by."""
    return F.scaled_dot_product_attention(s.q, s.k, s.v, is_causal=s.causal)


def _sdpa_bias(s: Setup) -> Tensor:
    """SDPA with the score bias materialised as a contiguous ``(B, H, L, L)`` float mask."""
    b, h, n, _ = s.q.shape
    bias = s.scheme.score_bias(s.q, s.positions, s.positions).to(s.q.dtype)
    allowed = s.positions.allowed(s.positions, causal=s.causal).unsqueeze(1)
    mask = bias.masked_fill(~allowed, torch.finfo(s.q.dtype).min).expand(b, h, n, n).contiguous()
    return F.scaled_dot_product_attention(s.q, s.k, s.v, attn_mask=mask)


def _naive_shaw(s: Setup) -> Tensor:
    """Shaw et al. (2018) eqs. 3-5 as written: ``a^K_ij, a^V_ij`` materialised ``(L, L, d)``."""
    sc = s.scheme
    n, d = s.q.shape[-2], s.q.shape[-1]
    index = sc.relative_index(s.positions, s.positions)[0]  # (L, L)
    a_k, a_v = sc.key_table[index], sc.value_table[index]  # (L, L, d) each
    logits = (s.q @ s.k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", s.q, a_k)) / math.sqrt(d)
    if s.causal:
        future = torch.ones(n, n, dtype=torch.bool, device=s.q.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
    p = logits.softmax(-1)
    return p @ s.v + torch.einsum("bhij,ijd->bhid", p, a_v)


@dataclass(frozen=True)
class Impl:
    """One implementation: how to run it and a rough upper estimate of its memory (bytes) for a
    forward+backward pass (used to skip what cannot fit)."""

    name: str
    run: Callable[[Setup], Tensor]
    memory: Callable[[str, int, int, int, int], float]  # (scheme, B, H, L, d) -> bytes
    schemes: tuple[str, ...] = tuple(SCHEMES)


def _lld(b: int, h: int, n: int, d: int) -> float:
    return 4.0 * n * n * d * 4  # a^K, a^V and their gradients, fp32


def _sdpa_memory(scheme: str, b: int, h: int, n: int, d: int) -> float:
    if scheme in ("rope", "none"):
        return 8.0 * b * h * n * d * 4  # plain positions, no bias: no mask at all
    if scheme == "alibi":
        return 4.0 * h * n * n * 4  # one (1, H, L, L) mask (and the bias it is built from)
    return _bias_memory(scheme, b, h, n, d)  # a learned bias: the math kernel differentiates it


def _bias_memory(scheme: str, b: int, h: int, n: int, d: int) -> float:
    """A materialised ``(B, H, L, L)`` bias and its probabilities; CoPE also keeps its gates,
    contextual positions, their row indices and interpolation weights for the backward pass."""
    return (21.0 if scheme == "cope" else 7.0) * b * h * n * n * 4


IMPLEMENTATIONS: dict[str, Impl] = {
    "sdpa-plain": Impl("sdpa-plain", sdpa_plain, lambda s, b, h, n, d: 8.0 * b * h * n * d * 4, ()),
    "eager": Impl("eager", backend_call("eager"), _bias_memory),
    "sdpa": Impl("sdpa", backend_call("sdpa"), _sdpa_memory),
    "chunked": Impl(
        "chunked", backend_call("chunked"), lambda s, b, h, n, d: 40.0 * b * h * n * d * 4
    ),
    "sdpa-bias": Impl(
        "sdpa-bias",
        _sdpa_bias,
        lambda s, b, h, n, d: 7.0 * b * h * n * n * 4,
        ("alibi", "t5", "music"),
    ),
    "naive-shaw": Impl(
        "naive-shaw",
        _naive_shaw,
        lambda s, b, h, n, d: _lld(b, h, n, d) + 7.0 * b * h * n * n * 4,
        ("shaw",),
    ),
    # FlexAttention: O(L·R) relative logits and O(L) statistics; never (B, H, L, L).
    "flex": Impl("flex", backend_call("flex"), lambda s, b, h, n, d: 40.0 * b * h * n * d * 4),
    # The fused Triton kernel (relative schemes, CUDA): O(L·R) logits and mass, O(L) statistics.
    "fused": Impl("fused", backend_call("fused"), lambda s, b, h, n, d: 40.0 * b * h * n * d * 4),
}


#: ``--impls`` by default: every implementation but the baseline, each where it runs.
DEFAULT_IMPLS = [i for i in IMPLEMENTATIONS if i != "sdpa-plain"]


def _supported(impl: str, scheme: str, causal: bool = True, device: str = "cpu") -> bool:
    if impl == "flex":
        return _flex_runs(scheme, causal, device)
    if impl == "fused":
        return _fused_runs(scheme, causal, device)
    if impl == "sdpa" and scheme == "shaw":
        return False  # Shaw's value term: sdpa declines it (auto picks chunked)
    if not causal and _causal(scheme):
        return False  # causal only (CoPE, the forget gate)
    if scheme == "cope" and impl == "chunked":
        return False  # its key bias has no relative form (auto picks sdpa)
    return scheme in IMPLEMENTATIONS[impl].schemes


@functools.cache
def skip_reason(
    impl: str,
    scheme: str,
    *,
    causal: bool = True,
    device: str = "cpu",
    layout: str = "plain",
    dtype: str = "float32",
) -> str:
    """Why ``impl`` cannot run ``scheme`` here at any shape, or ``""`` where it can: for a backend,
    the library's own refusal (its error on a tiny input)."""
    peer_of = IMPLEMENTATIONS[impl].schemes
    if scheme not in peer_of:
        return f"{impl} is a peer for {', '.join(peer_of)} only"
    if impl == "naive-shaw" and layout != "plain":
        return "naive-shaw masks the future only (no padding, no documents): --layout plain only"
    if _supported(impl, scheme, causal, device):
        return ""
    try:
        s = make_setup(
            scheme, 4, 1, causal=causal, heads=1, head_dim=8, device=device,
            dtype=getattr(torch, dtype), grad=True,
        )  # fmt: skip
        IMPLEMENTATIONS[impl].run(s)
    except ValueError as e:  # the backend's refusal, or the scheme's (causal only)
        return " ".join(str(e).split())
    mask = "causal" if causal else "bidirectional"
    return f"{impl} does not run {scheme} ({mask}) on {device}"


@dataclass(frozen=True)
class NotRun:
    """Requested schemes that ``impl`` cannot run here at any shape, for one reason."""

    schemes: tuple[str, ...]
    impl: str
    causal: bool
    reason: str


def not_run(args: argparse.Namespace) -> list[NotRun]:
    """What the arguments request that cannot run here (:func:`skip_reason`), the schemes of one
    implementation, mask and reason together."""
    groups: dict[tuple[str, bool, str], list[str]] = {}
    for causal in args.causal_modes:
        for impl in args.impls:
            for scheme in args.schemes:
                why = _skip(args, impl, scheme, causal)
                if why:
                    groups.setdefault((impl, causal, why), []).append(scheme)
    return [NotRun(tuple(sc), impl, causal, why) for (impl, causal, why), sc in groups.items()]


def _skip(args: argparse.Namespace, impl: str, scheme: str, causal: bool) -> str:
    return skip_reason(
        impl, scheme, causal=causal, device=args.device, layout=args.layout, dtype=args.dtype
    )


def _built(scheme: str, causal: bool):
    """The scheme as a backend's support check sees it, or None where it cannot be built so
    (a causal-only scheme, bidirectional)."""
    import relpos

    if not causal and _causal(scheme):
        return None
    return relpos.make_scheme(scheme, d_model=64, num_heads=1, causal=causal)


def _flex_runs(scheme: str, causal: bool, device: str) -> bool:
    """Whether ``flex`` runs ``scheme`` forward and backward on ``device`` (CUDA only)."""
    from ..attention.flex import flex_supports

    built = _built(scheme, causal)
    return built is not None and flex_supports(built, device=torch.device(device), needs_grad=True)


def _fused_runs(scheme: str, causal: bool, device: str) -> bool:
    """Whether the Triton kernel runs ``scheme`` on ``device`` (CUDA; Triton installed)."""
    from ..attention.fused import fused_supports

    built = _built(scheme, causal)
    return built is not None and fused_supports(built, device=torch.device(device))


def _causal(scheme: str) -> bool:
    """Whether a scheme runs causal attention only (its bidirectional rows are left out)."""
    from ..schemes.base import SCHEMES

    return scheme in SCHEMES and SCHEMES[scheme].causal_only


def make_setup(
    scheme_name: str,
    n: int,
    b: int,
    *,
    causal: bool,
    heads: int,
    head_dim: int,
    device: str,
    dtype: torch.dtype,
    grad: bool,
    seed: int = 0,
    layout: str = "plain",
) -> Setup:
    """Random inputs and a scheme with non-trivial parameters, at the positions of ``layout``
    (:func:`layout_positions`)."""
    import relpos

    torch.manual_seed(seed)
    name = "nope" if scheme_name == "none" else scheme_name
    scheme = relpos.make_scheme(name, d_model=heads * head_dim, num_heads=heads, causal=causal)
    scheme = scheme.to(device)
    with torch.no_grad():
        for p in scheme.parameters():
            p.normal_(0.0, 0.5)
            p.requires_grad_(grad)
    q, k, v = (
        torch.randn(b, heads, n, head_dim, device=device, dtype=dtype).requires_grad_(grad)
        for _ in range(3)
    )
    positions = layout_positions(layout, b, n, device)
    x = None
    if "contextualize" in scheme.hooks:
        x = torch.randn(b, n, heads * head_dim, device=device, dtype=dtype).requires_grad_(grad)
    return Setup(q, k, v, scheme, positions, causal, x)


LAYOUTS = ["plain", "padded", "packed"]


def layout_positions(layout: str, b: int, n: int, device: str) -> Any:
    """``plain``: ``0..L-1`` in every row; ``padded``: a quarter of each row left padding (a
    batch of prompts); ``packed``: four documents of ``L/4`` tokens per row."""
    from ..positions import Positions

    if layout == "plain":
        return Positions.from_length(n, device=device)
    if layout == "padded":
        mask = torch.ones(b, n, dtype=torch.bool, device=device)
        mask[:, : n // 4] = False
        return Positions.from_padding_mask(mask)
    if layout == "packed":
        seg = (torch.arange(n, device=device) * 4 // n).expand(b, n)
        return Positions.from_segments(seg)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# ----------------------------------------------------------------------------- measuring
def _step(fn: Callable[[Setup], Tensor], s: Setup, backward: bool) -> None:
    if backward:
        for t in (s.q, s.k, s.v, *s.scheme.parameters(), *([] if s.x is None else [s.x])):
            t.grad = None
        out = fn(s)
        out.backward(torch.ones_like(out))
    else:
        with torch.no_grad():
            fn(s)


def step_of(fn: Callable[[Setup], Tensor], s: Setup, *, backward: bool) -> Callable[[], None]:
    """One pass of ``fn`` on ``s`` as a call of no arguments (forward, or forward+backward with
    the gradients cleared first), not waiting for the device."""
    return functools.partial(_step, fn, s, backward)


def wall_times(
    fn: Callable[[], object], *, repeats: int, warmup: int, device: str = "cpu"
) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls (each waits for
    the device); the benchmark scripts time their cases with it too."""
    for _ in range(warmup):
        fn()
    wait_for_device(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        wait_for_device(device)
        times.append(time.perf_counter() - start)
    return times


def measure_time(
    fn: Callable[[Setup], Tensor],
    s: Setup,
    *,
    backward: bool,
    repeats: int,
    warmup: int,
    device: str,
) -> list[float]:
    """Wall-clock seconds of ``repeats`` runs after ``warmup`` runs."""
    step = step_of(fn, s, backward=backward)
    return wall_times(step, repeats=repeats, warmup=warmup, device=device)


def measure_paired(
    fn: Callable[[Setup], Tensor],
    s: Setup,
    base_fn: Callable[[Setup], Tensor],
    base: Setup,
    *,
    backward: bool,
    repeats: int,
    warmup: int,
    device: str,
) -> tuple[list[float], list[float]]:
    """Seconds of ``repeats`` runs of ``fn`` and of the baseline, alternating run by run, so that
    a drift in the machine's speed (other jobs, frequency) hits both alike: ``(fn, baseline)``."""
    for _ in range(warmup):
        _step(fn, s, backward)
        _step(base_fn, base, backward)
    wait_for_device(device)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for f, setup, out in ((fn, s, times[0]), (base_fn, base, times[1])):
            start = time.perf_counter()
            _step(f, setup, backward)
            wait_for_device(device)
            out.append(time.perf_counter() - start)
    return times


def paired_ratio(times: list[float], base: list[float]) -> float:
    """The median of the run-by-run ratios."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def _status_bytes(field_name: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field_name} in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: peak memory of one forward+backward pass above the inputs."""
    device, impl = spec["device"], IMPLEMENTATIONS[spec["impl"]]
    dtype = getattr(torch, spec["dtype"])
    torch.set_num_threads(spec["threads"])
    flush_denormals(spec.get("flush_denormals", True))  # as the parent, before any parallel op
    # Not retain_freed_memory(): memory the warm-up freed would stay mapped, be counted in the
    # base and reused by the pass, hiding part of its peak.
    kw = dict(heads=spec["heads"], head_dim=spec["head_dim"], device=device, dtype=dtype)
    # Warm up on a small shape: kernels, thread pools and allocator arenas exist before the base.
    small = make_setup(
        spec["scheme"], min(spec["L"], 256), 1, causal=spec["causal"], grad=True, **kw
    )
    _step(impl.run, small, True)
    del small
    s = make_setup(
        spec["scheme"],
        spec["L"],
        spec["B"],
        causal=spec["causal"],
        grad=True,
        layout=spec.get("layout", "plain"),
        **kw,
    )
    if device.startswith("cuda"):
        return {"peak_bytes": cuda_peak_bytes(impl.run, s)}
    # The peak is the kernel's high-water mark of resident memory, reset once the inputs exist
    # (import-time peaks would hide small deltas); ru_maxrss is the fallback without a reset.
    reset = _reset_peak_rss()
    base = _status_bytes("VmRSS")
    _step(impl.run, s, True)
    if reset:
        peak = _status_bytes("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_bytes": max(0, peak - base)}


def cuda_peak_bytes(fn: Callable[[Setup], Tensor], s: Setup) -> int:
    """Peak bytes the CUDA caching allocator handed out during one forward+backward pass of
    ``fn``, above what was allocated before it (the inputs)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(fn, s, True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _first_call(fn: Callable[[Setup], Tensor], s: Setup, device: str) -> float:
    """Seconds of the first forward+backward call at this shape (a compile for ``flex``)."""
    start = time.perf_counter()
    _step(fn, s, True)
    wait_for_device(device)
    return time.perf_counter() - start


_CHILD = "import sys; from relpos.cli.bench import main; sys.exit(main(sys.argv[1:]))"


def measure_memory(spec: dict[str, Any], timeout: float) -> tuple[float | None, str]:
    """Peak bytes of one configuration in a fresh subprocess, or ``(None, reason)``."""
    # Not through relpos.cli.main (python -m relpos.cli.bench): an error's last line is its own.
    cmd = [sys.executable, "-c", _CHILD, "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"memory run timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"memory run failed: {last[:120]}"
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]), ""


# ----------------------------------------------------------------------------- running
@dataclass(frozen=True)
class Config:
    """One benchmark configuration."""

    scheme: str  # "none" for the sdpa-plain baseline
    impl: str
    L: int
    B: int
    causal: bool
    layout: str = "plain"


@dataclass
class Result:
    """Measurements of one configuration (times in milliseconds, memory in MiB)."""

    config: Config
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_ratio: float | None = None
    fwdbwd_ratio: float | None = None
    peak_mib: float | None = None
    first_s: float | None = None
    #: CUDA only (:mod:`.profiling`): the device's busy time per forward+backward pass, its ratio
    #: to plain SDPA's, the host's time to issue one, and the device time per kernel (ms).
    fwdbwd_device_ms: float | None = None
    fwdbwd_device_ratio: float | None = None
    fwdbwd_host_ms: float | None = None
    kernels: dict[str, float] = field(default_factory=dict)
    auto: str = ""
    skipped: str = ""
    runs: dict[str, list[float]] = field(default_factory=dict)


def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8e9


def _auto_pick(s: Setup) -> str:
    from ..attention.auto import choose_backend

    p = _positions(s)
    return choose_backend(s.scheme, s.q, p, p, needs_grad=True)


def run(
    args: argparse.Namespace,
    log: Callable[[str], None] = print,
    on_result: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """Measure every configuration the arguments select; baseline first at each shape.
    ``on_result`` sees the results so far after each configuration."""
    device = args.device
    dtype = getattr(torch, args.dtype)
    budget_bytes = args.max_memory_gb * 2**30
    results: list[Result] = []
    slow: dict[tuple, tuple[int, float]] = {}  # (scheme, impl, B, causal) -> (L, s per fwd+fwdbwd)
    kw = dict(heads=args.heads, head_dim=args.head_dim, device=device, dtype=dtype)
    for causal in args.causal_modes:
        for b, n in _shapes(args):
            configs = [
                Config("none", "sdpa-plain", n, b, causal),
                *_kernel_family_reference(args, n, b, causal),
            ] + [
                Config(sc, impl, n, b, causal, args.layout)
                for sc in args.schemes
                for impl in args.impls
                if impl != "sdpa-plain" and not _skip(args, impl, sc, causal)  # see not_run
            ]
            # Every configuration is timed alternating with the baseline (measure_paired).
            base = make_setup("none", n, b, causal=causal, grad=True, **kw)
            for cfg in configs:
                res = _run_one(cfg, args, kw, budget_bytes, slow, log, base)
                results.append(res)
                log(_line(res))
                if on_result is not None:
                    on_result(results)
            del base
    return results


def _kernel_family_reference(
    args: argparse.Namespace, n: int, b: int, causal: bool
) -> list[Config]:
    """Where ``flex`` is timed: FlexAttention with no ``score_mod`` (scheme ``none``: the block
    mask of the layout alone), so that each ``flex`` row's ratio splits into the kernel family's
    own cost against flash SDPA and what a scheme's ``score_mod`` adds to it."""
    if "flex" not in args.impls or not _flex_runs("nope", causal, args.device):
        return []
    return [Config("none", "flex", n, b, causal, args.layout)]


def _shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(B, L)`` pairs: every ``--batch`` × ``--lengths``, or ``B = --tokens // L``."""
    if args.tokens:
        return [(args.tokens // n, n) for n in args.lengths]
    return [(b, n) for b in args.batch for n in args.lengths]


def _run_one(
    cfg: Config,
    args: argparse.Namespace,
    kw: dict[str, Any],
    budget_bytes: float,
    slow: dict[tuple, tuple[int, float]],
    log: Callable[[str], None],
    base: Setup,
) -> Result:
    impl = IMPLEMENTATIONS[cfg.impl]
    res = Result(cfg)
    need = impl.memory(cfg.scheme, cfg.B, args.heads, cfg.L, args.head_dim)
    if need > budget_bytes:
        res.skipped = f"needs ~{need / 2**30:.1f} GiB > --max-memory-gb {args.max_memory_gb:g}"
        return res
    key = (cfg.scheme, cfg.impl, cfg.B, cfg.causal)
    if key in slow:
        n0, per_run = slow[key]
        estimate = per_run * (cfg.L / n0) ** 2 * (args.repeats + args.warmup)
        if estimate > args.max_config_seconds:
            res.skipped = f"~{estimate:.0f} s estimated > --max-config-seconds"
            return res
    s = make_setup(cfg.scheme, cfg.L, cfg.B, causal=cfg.causal, grad=True, layout=cfg.layout, **kw)
    if cfg.scheme != "none":
        res.auto = _auto_pick(s)
    timing = dict(repeats=args.repeats, warmup=args.warmup, device=args.device)
    plain = IMPLEMENTATIONS["sdpa-plain"].run
    try:
        res.first_s = _first_call(impl.run, s, args.device)
        if cfg.impl == "sdpa-plain":
            fwd = measure_time(impl.run, s, backward=False, **timing)
            both = measure_time(impl.run, s, backward=True, **timing)
            fwd_base, both_base = fwd, both
        else:
            fwd, fwd_base = measure_paired(impl.run, s, plain, base, backward=False, **timing)
            both, both_base = measure_paired(impl.run, s, plain, base, backward=True, **timing)
        if args.device.startswith("cuda"):
            _profile(res, impl.run, s, plain, base, args, log)
    except (RuntimeError, MemoryError) as e:  # e.g. out of memory
        res.skipped = f"failed: {str(e).splitlines()[0][:100]}"
        return res
    finally:
        del s
    res.runs = {"fwd": fwd, "fwdbwd": both, "fwd_plain": fwd_base, "fwdbwd_plain": both_base}
    res.fwd_ms = statistics.median(fwd) * 1e3
    res.fwdbwd_ms = statistics.median(both) * 1e3
    if cfg.impl != "sdpa-plain":
        res.fwd_ratio = paired_ratio(fwd, fwd_base)
        res.fwdbwd_ratio = paired_ratio(both, both_base)
    slow[key] = (cfg.L, (res.fwd_ms + res.fwdbwd_ms) / 1e3)
    if args.memory and args.device.startswith("cuda"):
        s = make_setup(
            cfg.scheme, cfg.L, cfg.B, causal=cfg.causal, grad=True, layout=cfg.layout, **kw
        )
        res.peak_mib = cuda_peak_bytes(impl.run, s) / 2**20
        del s
    elif args.memory:
        spec = {
            "impl": cfg.impl,
            "scheme": cfg.scheme,
            "L": cfg.L,
            "B": cfg.B,
            "causal": cfg.causal,
            "layout": cfg.layout,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "device": args.device,
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "flush_denormals": args.flush_denormals,
        }
        peak, why = measure_memory(spec, timeout=max(120.0, 30 * res.fwdbwd_ms / 1e3))
        res.peak_mib = None if peak is None else peak / 2**20
        if why:
            log(f"  ({cfg.impl}/{cfg.scheme} L={cfg.L}: {why})")
    return res


#: The kernels ``kernels.md`` names per configuration (the rest are summed as "others").
TOP_KERNELS = 6


def _profile(
    res: Result,
    fn: Callable[[Setup], Tensor],
    s: Setup,
    base_fn: Callable[[Setup], Tensor],
    base: Setup,
    args: argparse.Namespace,
    log: Callable[[str], None],
) -> None:
    """Fill ``res``'s device and host times (:mod:`.profiling`); a profiler that fails here is
    logged, and the wall-clock figures stand."""
    step, base_step = step_of(fn, s, backward=True), step_of(base_fn, base, backward=True)
    try:
        split = device_split(step, base_step, repeats=args.repeats, device=args.device)
    except Exception as e:  # the profiler is a guest: never fatal to the bench
        log(f"  (device profile failed: {type(e).__name__}: {' '.join(str(e).split())[:200]})")
        return
    res.fwdbwd_device_ms = split.device * 1e3
    plain = res.config.impl == "sdpa-plain"
    res.fwdbwd_device_ratio = None if plain else split.device / split.base
    res.fwdbwd_host_ms = split.host * 1e3
    res.kernels = {name: t * 1e3 for name, t in split.kernels.items()}


# ----------------------------------------------------------------------------- reporting
def _ms(x: float | None) -> str:
    """Milliseconds to three significant figures or so (a GPU pass may take 0.1 ms)."""
    if x is None:
        return "–"
    return format(x, ".1f" if x >= 10 else ".2f" if x >= 1 else ".3f")


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _mask(c: Config) -> str:
    mask = "causal" if c.causal else "bidir "
    return mask if c.layout == "plain" else f"{mask.strip()}, {c.layout}"


def _line(r: Result) -> str:
    c = r.config
    head = f"{c.scheme:6s} {c.impl:11s} L={c.L:<5d} B={c.B} {_mask(c)}"
    if r.skipped:
        return f"{head}  skipped: {r.skipped}"
    device = ""
    if r.fwdbwd_device_ms is not None:
        device = (
            f"  device {_ms(r.fwdbwd_device_ms)} ms ({_fmt(r.fwdbwd_device_ratio, '.2f')}x)"
            f"  host {_ms(r.fwdbwd_host_ms)} ms"
        )
    return (
        f"{head}  fwd {_ms(r.fwd_ms):>8s} ms ({_fmt(r.fwd_ratio, '.2f')}x)  "
        f"fwd+bwd {_ms(r.fwdbwd_ms):>8s} ms ({_fmt(r.fwdbwd_ratio, '.2f')}x){device}  "
        f"peak {_fmt(r.peak_mib, '.1f')} MiB  first {_fmt(r.first_s, '.2f')} s"
    )


def _mask_word(causal: bool) -> str:
    return "causal" if causal else "bidirectional"


def _not_run_line(n: NotRun) -> str:
    return (
        f"{','.join(n.schemes):6s} {n.impl:11s} every L {_mask_word(n.causal)}  skipped: {n.reason}"
    )


def render_markdown(results: list[Result], header: str, not_run: list[NotRun] = ()) -> str:
    """A markdown table of every result (ratios to ``sdpa-plain`` at the same shape; on CUDA also
    the device and host times, :mod:`.profiling`), then what was requested and not run at any
    shape, with the reason."""
    profiled = any(r.fwdbwd_device_ms is not None for r in results)
    extra = " fwd+bwd device ms | device × plain | host ms |" if profiled else ""
    lines = [
        header,
        "",
        "| scheme | impl | L | B | mask | fwd ms | fwd × plain | fwd+bwd ms | fwd+bwd × plain |"
        f"{extra} peak MiB (fwd+bwd, above inputs) | first call s | auto picks | note |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|"
        + "---:|" * (3 * profiled)
        + "---:|---:|---|---|",
    ]
    for r in results:
        c = r.config
        device = ""
        if profiled:
            device = (
                f" {_ms(r.fwdbwd_device_ms)} | {_fmt(r.fwdbwd_device_ratio, '.2f')} "
                f"| {_ms(r.fwdbwd_host_ms)} |"
            )
        lines.append(
            f"| {c.scheme} | {c.impl} | {c.L} | {c.B} | {_mask(c).strip()} "
            f"| {_ms(r.fwd_ms)} | {_fmt(r.fwd_ratio, '.2f')} | {_ms(r.fwdbwd_ms)} "
            f"| {_fmt(r.fwdbwd_ratio, '.2f')} |{device} {_fmt(r.peak_mib, '.1f')} "
            f"| {_fmt(r.first_s, '.2f')} | {r.auto} "
            f"| {r.skipped} |"
        )
    if not_run:
        lines += [
            "",
            "Not run at any shape (the reason is the library's own refusal where it has one):",
            "",
        ]
        lines += [
            f"* {', '.join(n.schemes)} / {n.impl}, {_mask_word(n.causal)}: skipped: {n.reason}"
            for n in not_run
        ]
    return "\n".join(lines) + "\n"


def render_kernels(results: list[Result], header: str) -> str:
    """``kernels.md``: per profiled configuration, its forward+backward device time and the
    :data:`TOP_KERNELS` kernels (or copies) that took the most of it, in ms per pass."""
    lines = [header, "", "Device time per forward+backward pass (ms), by kernel:", ""]
    for r in results:
        if not r.kernels:
            continue
        c = r.config
        ranked = list(r.kernels.items())
        named = [f"`{name[:60]}` {_ms(t)}" for name, t in ranked[:TOP_KERNELS]]
        rest = ranked[TOP_KERNELS:]
        if rest:
            named.append(f"{len(rest)} others {_ms(sum(t for _, t in rest))}")
        lines.append(
            f"* {c.scheme} / {c.impl}, L={c.L}, B={c.B}, {_mask(c).strip()}: "
            f"{_ms(r.fwdbwd_device_ms)} = " + ", ".join(named)
        )
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def _plot(results: list[Result], path: Path) -> bool:
    """Draw ``path``; False (nothing drawn) where no configuration was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if not r.skipped]
    if not done:
        return False
    first = done[0].config
    pick = [r for r in done if r.config.B == first.B and r.config.causal == first.causal]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    series: dict[str, list[Result]] = {}
    for r in pick:
        series.setdefault(f"{r.config.scheme}/{r.config.impl}", []).append(r)
    colors = {sc: f"C{t}" for t, sc in enumerate(["none", *SCHEMES])}
    styles = {"chunked": "-", "sdpa": "--", "eager": ":", "sdpa-bias": "-.", "naive-shaw": ":"}
    for label, rs in sorted(series.items()):
        scheme, impl = label.split("/")
        style = {
            "color": "k" if scheme == "none" else colors[scheme],
            "linestyle": styles.get(impl, "-"),
            "marker": "o",
            "label": label,
        }
        ax_t.plot([r.config.L for r in rs], [r.fwdbwd_ms for r in rs], **style)
        # log axis: a zero RSS delta (memory reused within the allocator) cannot be drawn
        mem = [(r.config.L, r.peak_mib) for r in rs if r.peak_mib]
        if mem:
            ax_m.plot(*zip(*mem, strict=True), **style)
    mask = "causal" if first.causal else "bidirectional"
    ax_t.set(
        xscale="log",
        yscale="log",
        xlabel="L",
        ylabel="forward+backward ms",
        title=f"time (B={first.B}, {mask})",
    )
    ax_m.set(
        xscale="log",
        yscale="log",
        xlabel="L",
        ylabel="peak MiB above inputs",
        title="memory of one forward+backward",
    )
    ax_t.legend(fontsize=7, ncol=2)
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return True


def write_outputs(
    results: list[Result],
    out: Path,
    header: str,
    plot: bool = True,
    not_run: list[NotRun] = (),
) -> None:
    """``bench.md``, ``bench.json`` and, with ``plot``, ``bench.png`` in ``out``, atomically.

    Without ``plot`` (the tables of a run in progress, or ``--no-plot``), or with nothing measured
    to draw, a ``bench.png`` already there is removed first: it would be of an earlier run.
    """
    out.mkdir(parents=True, exist_ok=True)
    png = out / "bench.png"
    if not plot:
        png.unlink(missing_ok=True)
    _atomic_write(out / "bench.md", render_markdown(results, header, not_run).encode())
    payload = [{**asdict(r), "config": asdict(r.config)} for r in results]
    _atomic_write(out / "bench.json", json.dumps(payload, indent=1).encode())
    if any(r.kernels for r in results):
        _atomic_write(out / "kernels.md", render_kernels(results, header).encode())
    else:  # none profiled (yet): one left there would be of an earlier run
        (out / "kernels.md").unlink(missing_ok=True)
    if plot and not _plot(results, png):
        png.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- command line
def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated positive ints (``--lengths 256,1024``)."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _names(valid: list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in valid]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {valid}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The options of ``relpos bench``; argparse's errors raise :class:`~.checks.UsageError`
    (one line, status 2, from :func:`relpos.cli.main`)."""
    p = Parser(
        prog="relpos bench",
        description="Attention speed and memory per scheme and backend (see relpos.cli.bench).",
    )
    p.add_argument(
        "--lengths",
        type=positive_ints,
        default=None,
        help=f"comma-separated L (default {DEFAULT_LENGTHS}; --all: {ALL_LENGTHS})",
    )
    p.add_argument("--all", action="store_true", help="every L in 256..8192 and B in 1,4")
    p.add_argument("--batch", type=positive_ints, default=None, help="comma-separated B (1)")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="fix B·L: each length L runs with B = TOKENS // L (instead of --batch)",
    )
    p.add_argument("--mask", choices=["causal", "bidirectional", "both"], default="causal")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="plain",
        help="positions of every row: plain, padded (a quarter left padding) or packed (four "
        "documents); the sdpa-plain baseline stays plain",
    )
    p.add_argument("--schemes", type=_names(SCHEMES), default=SCHEMES)
    p.add_argument(
        "--impls",
        type=_names(DEFAULT_IMPLS),
        help="implementations besides the sdpa-plain baseline (default: every one that runs here)",
    )
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed runs (>= 5), median reported")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="default float32 on CPU, bfloat16 on CUDA",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--keep-denormals",
        dest="flush_denormals",
        action="store_false",
        help="measure without flush-to-zero (see relpos.runtime; slow on many x86 CPUs)",
    )
    p.add_argument(
        "--default-malloc",
        dest="retain_heap",
        action="store_false",
        help="measure with the C library's default allocator settings (see relpos.runtime)",
    )
    p.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the per-configuration memory subprocesses",
    )
    p.add_argument(
        "--max-memory-gb",
        type=float,
        default=None,
        help="skip configurations estimated to need more (default 60%% of free RAM)",
    )
    p.add_argument(
        "--max-config-seconds",
        type=float,
        default=120.0,
        help="skip a configuration whose estimated time (from a shorter L) is larger",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def _device_name(device: str) -> str:
    """The CPU's or the GPU's name, for the header."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name() if device == "cpu" else device


def check_args(args: argparse.Namespace) -> None:
    """Refuse a bad option before anything runs: a :class:`~.checks.CLIError` naming the flag, the
    value and what was expected (one line, status 2, from :func:`relpos.cli.main`).

    ``args.lengths`` is already resolved (``--lengths``, or the default of ``--all``).
    """
    from .limits import device_flag

    device_flag(args.device)
    for flag, value, minimum in (
        ("--heads", args.heads, 1),
        ("--head-dim", args.head_dim, 1),
        ("--repeats", args.repeats, 5),  # a median of at least 5 runs
        ("--warmup", args.warmup, 1),
        ("--threads", args.threads, 1),
    ):
        if value is not None and value < minimum:
            raise CLIError(f"{flag}: expected an integer >= {minimum}, got {value}")
    for flag, value in (
        ("--max-memory-gb", args.max_memory_gb),
        ("--max-config-seconds", args.max_config_seconds),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CLIError(f"{flag}: expected a finite number > 0, got {value}")
    if args.tokens is not None:
        if args.batch is not None:
            raise CLIError(
                f"--tokens {args.tokens} and --batch: --tokens fixes B·L (B = TOKENS // L at each "
                "length); expected one of them, not both"
            )
        if args.tokens < max(args.lengths):
            raise CLIError(
                f"--tokens: expected at least the longest of --lengths ({max(args.lengths)}), "
                f"got {args.tokens}"
            )
    output_folder("--out", args.out)


def _check_something_runs(args: argparse.Namespace, skipped: list[NotRun]) -> None:
    """Refuse ``--impls`` where none of them runs any of ``--schemes`` here (only the baseline
    would be measured)."""
    pairs = len(args.causal_modes) * len(args.impls) * len(args.schemes)
    if sum(len(n.schemes) for n in skipped) < pairs:
        return
    why = "; ".join(
        f"{n.impl} for {','.join(n.schemes)} ({_mask_word(n.causal)}): {n.reason}"
        for n in skipped[:4]
    )
    if len(skipped) > 4:
        why += f"; and {len(skipped) - 4} more"
    raise CLIError(
        f"--impls {','.join(args.impls)}: none of them runs any of --schemes "
        f"{','.join(args.schemes)} here (--device {args.device}, --mask {args.mask}, --layout "
        f"{args.layout}); expected at least one that does: {why}"
    )


def main(argv: list[str] | None = None) -> int:
    """``relpos bench`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    ``relpos bench`` and ``python -m relpos.cli.bench`` both run it through
    :func:`relpos.cli.main`, which prints a refused option in one line (status 2).

    Raises:
        CLIError: a bad option (:func:`check_args`; argparse's errors as
            :class:`~.checks.UsageError`), or ``--impls`` none of which runs any of
            ``--schemes`` here; raised before anything is measured or written.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(_memory_child(json.loads(args.child))))
        return 0
    args.lengths = args.lengths or (ALL_LENGTHS if args.all else DEFAULT_LENGTHS)
    impls_given, args.impls = args.impls is not None, args.impls or DEFAULT_IMPLS
    check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # Before any parallel op, so that the intra-op threads inherit it (relpos.runtime).
    flushed = flush_denormals(args.flush_denormals) and args.flush_denormals
    if args.flush_denormals and not flushed:
        print("relpos bench: flush-to-zero did not take effect; denormals are kept", flush=True)
    args.flush_denormals = flushed
    args.retain_heap = args.retain_heap and retain_freed_memory()
    args.batch = args.batch or ([1, 4] if args.all else [1])
    args.causal_modes = {"causal": [True], "bidirectional": [False], "both": [True, False]}[
        args.mask
    ]
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    skipped = not_run(args)
    _check_something_runs(args, skipped)
    if args.max_memory_gb is None:
        args.max_memory_gb = 0.6 * _available_bytes() / 2**30
    header = (
        f"relpos bench: H={args.heads}, d={args.head_dim}, {args.dtype} on {args.device} "
        f"({_device_name(args.device)}, "
        f"{torch.get_num_threads()} threads, denormals "
        f"{'flushed' if args.flush_denormals else 'kept'}, "
        f"{'freed memory retained' if args.retain_heap else 'default malloc'}, "
        f"torch {torch.__version__}); median of "
        f"{args.repeats} runs after {args.warmup} warm-up; ratios to sdpa-plain (no bias) at "
        "the same shape, the median of run-by-run ratios (each run alternates with one of "
        f"sdpa-plain).\n\nCommand: `{shlex.join(['relpos', 'bench', *argv])}`"
    )
    print(header.splitlines()[0], flush=True)
    if impls_given:  # asked for: say why each does not run
        for n in skipped:
            print(_not_run_line(n), flush=True)
    elif skipped:  # the defaults: every implementation, most of them for some schemes only
        count = sum(len(n.schemes) for n in skipped)
        print(
            f"{count} (scheme, implementation) pairs cannot run here: bench.md lists them and why",
            flush=True,
        )
    # The tables are rewritten after every configuration: a run cut short keeps what it measured
    # (and no plot of an earlier run: write_outputs).
    # Every shape of every scheme compiles its own FlexAttention kernels: past Dynamo's default
    # recompile limit (8) flex would be timed unfused.
    with torch._dynamo.config.patch(recompile_limit=512, accumulated_recompile_limit=4096):
        results = run(
            args,
            log=lambda line: print(line, flush=True),
            on_result=lambda done: write_outputs(done, args.out, header, False, skipped),
        )
    write_outputs(results, args.out, header, args.plot, skipped)
    print(
        f"wrote {args.out / 'bench.md'}, {args.out / 'bench.json'}"
        + (f", {args.out / 'bench.png'}" if args.plot else "")
    )
    return 0


if __name__ == "__main__":
    # The relpos command line's handling: one-line errors, Ctrl-C, a traceback for a bug.
    from . import main as relpos_main  # the package's (a child importing commands is a cycle)

    raise SystemExit(relpos_main(["bench", *sys.argv[1:]]))
