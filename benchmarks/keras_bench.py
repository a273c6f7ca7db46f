"""Keras 3 attention speed per scheme: ``RelativeMultiHeadAttention`` against
``keras.layers.MultiHeadAttention`` on the active Keras backend, compiled.

Self-attention on ``x (b, L, d_model)``: the baseline is ``keras.layers.MultiHeadAttention`` with
no positions (``use_causal_mask=True`` when causal); each scheme is
``relpos.keras.RelativeMultiHeadAttention(num_heads, key_dim, scheme=..., causal=...)`` with the
same shapes. Two passes, each compiled once before timing:

* ``fwd``: the layer's output;
* ``fwd+bwd``: ``sum(output)`` and its gradients with respect to the input and every trainable
  weight (projections and the scheme's tables).

Per backend (``KERAS_BACKEND``, or ``--backend``):

* ``jax``: ``layer.stateless_call`` under ``jax.jit`` (``jax.value_and_grad`` for the backward
  pass), compiled ahead of time (``jit(...).lower(...).compile()``); each run ends with
  ``jax.block_until_ready``. Memory: XLA's buffer assignment, ``compiled.memory_analysis()``
  (temporaries of one call, arguments and outputs excluded), reported in MiB and in units of
  one float32 ``(b, h, L, L)`` array.
* ``tensorflow``: the layer called in ``tf.function(jit_compile=True)`` (XLA), ``tf.GradientTape``
  for the backward pass; TF's eager execution is synchronous on CPU. No memory figure.
* ``torch``: eager (no compilation), ``torch.no_grad`` forward, ``.backward()``. No memory figure.

Timing follows ``relpos bench``: after compilation and ``--warmup`` runs, every timed run of a
scheme alternates with a run of the baseline, the time is the median of ``--repeats`` runs and the
ratio the median of the run-by-run ratios (a drift in the machine's speed hits both alike). The
baseline's own row is timed alone, first. ``cpu/wall`` is process CPU time over wall time during
the timed runs (about 1 when a single thread works).

    KERAS_BACKEND=jax python benchmarks/keras_bench.py --lengths 1024 --causal --repeats 5 \\
        --out benchmarks/results/2026-11-23-keras-cpu/jax-causal-L1024

Results: ``<out>.md`` (header and table) and ``<out>.json`` (everything, raw runs included),
each written atomically (temporary file, then ``os.replace``).

Shape legend: ``b`` batch, ``h`` heads, ``L`` tokens, ``d_model`` model width.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relpos.cli.bench import positive_ints
from relpos.runtime import cpu_name

BACKENDS = ("jax", "tensorflow", "torch")
DEFAULT_SCHEMES = "nope,rope,alibi,t5,shaw:16,music:1024"
BASELINE = "keras-mha"
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "XLA_FLAGS",
    "TF_NUM_INTEROP_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "KERAS_BACKEND",
)
PASSES = {"fwd": ("fwd",), "fwd+bwd": ("fwd+bwd",), "both": ("fwd", "fwd+bwd")}


# ----------------------------------------------------------------------------- arguments
def parse_schemes(text: str) -> list[dict[str, Any]]:
    """``name[:max_distance]`` comma-separated (``shaw:16,music:1024``), or a JSON list of names
    and config dicts (``'[{"name": "shaw", "max_distance": 16, "values": false}]'``)."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"bad JSON scheme list: {e}") from None
        specs = [{"name": s} if isinstance(s, str) else dict(s) for s in items]
    else:
        specs = []
        for item in (s.strip() for s in text.split(",")):
            if not item:
                continue
            name, _, dist = item.partition(":")
            spec: dict[str, Any] = {"name": name}
            if dist:
                try:
                    spec["max_distance"] = int(dist)
                except ValueError:
                    raise argparse.ArgumentTypeError(
                        f"expected name or name:max_distance, got {item!r}"
                    ) from None
            specs.append(spec)
    if not specs or any(not isinstance(s.get("name"), str) for s in specs):
        raise argparse.ArgumentTypeError(f"no scheme names in {text!r}")
    return specs


def scheme_label(spec: dict[str, Any]) -> str:
    """``shaw(max_distance=16)`` for ``{"name": "shaw", "max_distance": 16}``."""
    rest = {k: v for k, v in spec.items() if k != "name"}
    return spec["name"] + (
        "(" + ",".join(f"{k}={v}" for k, v in rest.items()) + ")" if rest else ""
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Keras 3 attention: RelativeMultiHeadAttention per scheme vs "
        "keras.layers.MultiHeadAttention, compiled (jax.jit / tf.function(jit_compile=True)).",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="Keras backend (default: $KERAS_BACKEND, else jax); set before Keras is imported",
    )
    p.add_argument("--lengths", type=positive_ints, default=[1024], help="L values, e.g. 256,1024")
    p.add_argument("--batch", type=positive_ints, default=[1], help="b values (default 1)")
    p.add_argument("--heads", type=int, default=4, help="attention heads h (default 4)")
    p.add_argument(
        "--d-model", type=int, default=256, help="model width; key_dim = d_model / heads"
    )
    p.add_argument(
        "--schemes",
        type=parse_schemes,
        default=parse_schemes(DEFAULT_SCHEMES),
        help=f"name[:max_distance],... or a JSON list (default {DEFAULT_SCHEMES})",
    )
    mask = p.add_mutually_exclusive_group()
    mask.add_argument("--causal", dest="causal", action="store_true", default=True)
    mask.add_argument("--bidirectional", dest="causal", action="store_false")
    p.add_argument("--mode", choices=sorted(PASSES), default="both")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per pass (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="path prefix: writes <out>.md and <out>.json atomically (default: print only)",
    )
    return p


# ----------------------------------------------------------------------------- environment
def machine_line() -> str:
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    env = ", ".join(f"{k}={os.environ[k]}" for k in THREAD_ENV[:-1] if k in os.environ)
    return f"{cpu_name()}, {os.cpu_count()} cores ({usable} usable); {env or 'no thread env set'}"


def versions(backend: str) -> dict[str, str]:
    import keras
    import numpy as np

    out = {"python": platform.python_version(), "keras": keras.__version__, "numpy": np.__version__}
    if backend == "jax":
        import jax
        import jaxlib

        out.update(jax=jax.__version__, jaxlib=jaxlib.__version__)
    elif backend == "tensorflow":
        import tensorflow as tf

        out["tensorflow"] = tf.__version__
    import torch

    out["torch"] = torch.__version__  # relpos imports it on every backend
    try:
        from importlib.metadata import version

        out["relpos"] = version("relpos")
    except Exception:
        pass
    return out


# ----------------------------------------------------------------------------- models
@dataclass
class Model:
    """One attention layer and how to call it on ``x`` (self-attention)."""

    name: str
    scheme: dict[str, Any] | None
    layer: Any
    args: Callable[[Any], tuple[tuple, dict]]


def make_model(spec: dict[str, Any] | None, args: argparse.Namespace, b: int, n: int) -> Model:
    import keras

    from relpos.keras import RelativeMultiHeadAttention

    key_dim = args.d_model // args.heads
    keras.utils.set_random_seed(args.seed)
    shape = (b, n, args.d_model)
    if spec is None:
        layer = keras.layers.MultiHeadAttention(args.heads, key_dim, name="mha")
        causal = args.causal

        def call_args(x):
            return (x, x), {"use_causal_mask": causal}

        name = BASELINE
    else:
        layer = RelativeMultiHeadAttention(
            args.heads, key_dim, scheme=dict(spec), causal=args.causal, name="rmha"
        )

        def call_args(x):  # value=None: self-attention, keys share the queries' positions
            return (x,), {}

        name = scheme_label(spec)
    layer.build(shape, shape)
    return Model(name, spec, layer, call_args)


# ----------------------------------------------------------------------------- compiled steps
@dataclass
class Step:
    """A compiled pass: ``run()`` executes it once and returns when the result exists."""

    run: Callable[[], Any]
    compile_s: float
    temp_bytes: float | None = None


def _jax_step(model: Model, x, backward: bool) -> Step:
    import jax
    import jax.numpy as jnp

    layer = model.layer
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def forward(tv, ntv, x):
        a, kw = model.args(x)
        y, _ = layer.stateless_call(tv, ntv, *a, **kw)
        return y

    def loss(tv, ntv, x):
        return jnp.sum(forward(tv, ntv, x).astype(jnp.float32))

    fn = jax.value_and_grad(loss, argnums=(0, 2)) if backward else forward
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(tv, ntv, x).compile()
    jax.block_until_ready(compiled(tv, ntv, x))
    compile_s = time.perf_counter() - t0
    temp = None
    try:
        temp = float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # not every jaxlib / platform reports it
        pass
    return Step(lambda: jax.block_until_ready(compiled(tv, ntv, x)), compile_s, temp)


def _tf_step(model: Model, x, backward: bool) -> Step:
    import tensorflow as tf

    layer = model.layer
    weights = list(layer.trainable_variables)

    @tf.function(jit_compile=True)
    def forward(x):
        a, kw = model.args(x)
        return layer(*a, **kw)

    @tf.function(jit_compile=True)
    def forward_backward(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            a, kw = model.args(x)
            loss = tf.reduce_sum(tf.cast(layer(*a, **kw), tf.float32))
        return loss, tape.gradient(loss, [x, *weights])

    fn = forward_backward if backward else forward
    t0 = time.perf_counter()
    fn(x)  # trace, XLA-compile, run once
    compile_s = time.perf_counter() - t0
    return Step(lambda: fn(x), compile_s)


def _torch_step(model: Model, x, backward: bool) -> Step:
    import torch

    layer = model.layer
    params = [v.value for v in layer.trainable_variables]

    def forward():
        a, kw = model.args(x)
        with torch.no_grad():
            return layer(*a, **kw)

    def forward_backward():
        for p in (xg, *params):
            p.grad = None
        a, kw = model.args(xg)
        layer(*a, **kw).float().sum().backward()

    xg = x.detach().clone().requires_grad_(True)
    fn = forward_backward if backward else forward
    t0 = time.perf_counter()
    fn()
    return Step(fn, time.perf_counter() - t0)


STEPS = {"jax": _jax_step, "tensorflow": _tf_step, "torch": _torch_step}


def make_input(backend: str, b: int, n: int, d: int, seed: int):
    import keras
    import numpy as np

    x = np.random.default_rng(seed).standard_normal((b, n, d)).astype("float32")
    return keras.ops.convert_to_tensor(x)


# ----------------------------------------------------------------------------- measuring
@dataclass
class Timing:
    """One pass of one model: milliseconds, ratio to the baseline, compile time, memory."""

    ms: float | None = None
    ratio: float | None = None
    compile_s: float | None = None
    temp_mib: float | None = None
    bhll: float | None = None  # temp bytes / one float32 (b, h, L, L) array
    cpu_per_wall: float | None = None
    runs_ms: list[float] = field(default_factory=list)
    base_runs_ms: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class Result:
    model: str
    scheme: dict[str, Any] | None
    L: int
    B: int
    causal: bool
    passes: dict[str, Timing] = field(default_factory=dict)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(
    step: Step, base: Step | None, repeats: int, warmup: int
) -> tuple[list[float], list[float], float]:
    """``repeats`` runs of ``step``, each followed by one of ``base`` (if given): their ms and
    the CPU/wall ratio of the whole loop."""
    for _ in range(warmup):
        step.run()
        if base is not None:
            base.run()
    runs: list[float] = []
    base_runs: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        runs.append(_timed(step.run))
        if base is not None:
            base_runs.append(_timed(base.run))
    cpu = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
    return runs, base_runs, cpu


def run(args: argparse.Namespace, backend: str, log: Callable[[str], None] = print) -> list[Result]:
    import gc

    make_step = STEPS[backend]
    results: list[Result] = []
    passes = PASSES[args.mode]
    for b in args.batch:
        for n in args.lengths:
            x = make_input(backend, b, n, args.d_model, args.seed)
            bhll = 4.0 * b * args.heads * n * n
            base_model = make_model(None, args, b, n)
            base_steps: dict[str, Step] = {}
            row = Result(BASELINE, None, n, b, args.causal)
            for p in passes:
                step = make_step(base_model, x, p == "fwd+bwd")
                base_steps[p] = step
                runs, _, cpu = measure(step, None, args.repeats, args.warmup)
                row.passes[p] = _timing(step, runs, [], cpu, bhll, base=True)
            results.append(row)
            log(_line(row))
            for spec in args.schemes:
                row = Result(scheme_label(spec), spec, n, b, args.causal)
                try:
                    model = make_model(spec, args, b, n)
                except Exception as e:  # a config the library refuses
                    for p in passes:
                        row.passes[p] = Timing(error=f"{type(e).__name__}: {e}"[:200])
                    results.append(row)
                    log(_line(row))
                    continue
                for p in passes:
                    try:
                        step = make_step(model, x, p == "fwd+bwd")
                        runs, base_runs, cpu = measure(
                            step, base_steps[p], args.repeats, args.warmup
                        )
                        row.passes[p] = _timing(step, runs, base_runs, cpu, bhll)
                    except Exception as e:
                        first = (str(e).strip().splitlines() or ["?"])[0]
                        row.passes[p] = Timing(error=f"{type(e).__name__}: {first}"[:200])
                    finally:
                        step = None
                        gc.collect()
                results.append(row)
                log(_line(row))
                del model
                gc.collect()
    return results


def _timing(
    step: Step, runs: list[float], base_runs: list[float], cpu: float, bhll: float, base=False
) -> Timing:
    t = Timing(
        ms=statistics.median(runs),
        compile_s=step.compile_s,
        cpu_per_wall=cpu,
        runs_ms=runs,
        base_runs_ms=base_runs,
    )
    if base:
        t.ratio = 1.0
    elif base_runs:
        t.ratio = statistics.median(a / c for a, c in zip(runs, base_runs, strict=True))
    if step.temp_bytes is not None:
        t.temp_mib = step.temp_bytes / 2**20
        t.bhll = step.temp_bytes / bhll
    return t


# ----------------------------------------------------------------------------- reporting
def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _line(r: Result) -> str:
    head = f"{r.model:22s} L={r.L:<5d} B={r.B} {'causal' if r.causal else 'bidir '}"
    parts = []
    for p, t in r.passes.items():
        if t.error:
            parts.append(f"{p} FAILED: {t.error}")
        else:
            mem = "" if t.temp_mib is None else f", temp {t.temp_mib:.0f} MiB"
            parts.append(
                f"{p} {t.ms:8.1f} ms ({_fmt(t.ratio, '.2f')}x; compile {t.compile_s:.1f} s{mem})"
            )
    return head + "  " + "  ".join(parts)


def render_markdown(results: list[Result], header: list[str], passes: tuple[str, ...]) -> str:
    cols = ["model", "L", "B", "mask"]
    align = ["---", "---:", "---:", "---"]
    for p in passes:
        cols += [f"{p} ms", f"{p} × base", f"{p} compile s", f"{p} XLA temp MiB (× bhLL f32)"]
        align += ["---:"] * 4
    cols.append("cpu/wall")
    align.append("---:")
    lines = [*header, "", "| " + " | ".join(cols) + " |", "|" + "|".join(align) + "|"]
    for r in results:
        cells = [r.model, str(r.L), str(r.B), "causal" if r.causal else "bidir"]
        cpu = []
        for p in passes:
            t = r.passes.get(p, Timing(error="not run"))
            if t.error:
                cells += [f"failed: {t.error}", "–", "–", "–"]
                continue
            mem = "–" if t.temp_mib is None else f"{t.temp_mib:.0f} ({t.bhll:.1f})"
            cells += [
                _fmt(t.ms, ".1f"),
                _fmt(t.ratio, ".2f"),
                _fmt(t.compile_s, ".1f"),
                mem,
            ]
            cpu.append(_fmt(t.cpu_per_wall, ".2f"))
        cells.append(" / ".join(cpu) or "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync, then ``os.replace``."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_outputs(
    prefix: Path, markdown: str, meta: dict[str, Any], results: list[Result]
) -> list[Path]:
    md, js = Path(f"{prefix}.md"), Path(f"{prefix}.json")
    _atomic_write(md, markdown)
    payload = {**meta, "results": [asdict(r) for r in results]}
    _atomic_write(js, json.dumps(payload, indent=1) + "\n")
    return [md, js]


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    backend = args.backend or os.environ.get("KERAS_BACKEND") or "jax"
    if "keras" in sys.modules and os.environ.get("KERAS_BACKEND", backend) != backend:
        raise SystemExit("Keras is already imported with another backend")
    os.environ["KERAS_BACKEND"] = backend
    import keras

    if keras.backend.backend() != backend:
        raise SystemExit(f"Keras runs {keras.backend.backend()!r}, asked for {backend!r}")
    compiler = {
        "jax": "jax.jit (AOT lower/compile), stateless_call, jax.value_and_grad",
        "tensorflow": "tf.function(jit_compile=True) (XLA), tf.GradientTape",
        "torch": "eager (no compilation)",
    }[backend]
    command = "python benchmarks/keras_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    vers = versions(backend)
    passes = PASSES[args.mode]
    header = [
        f"# Keras attention benchmark: {backend}",
        "",
        f"Command: `KERAS_BACKEND={backend} {command}`",
        "",
        f"Machine: {machine_line()}",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
        "",
        f"Compilation: {compiler}. Self-attention on x (b, L, {args.d_model}), {args.heads} heads "
        f"of {args.d_model // args.heads}, float32; baseline `{BASELINE}` = "
        "keras.layers.MultiHeadAttention without positions"
        + (" (use_causal_mask=True)" if args.causal else "")
        + f". Median of {args.repeats} runs after compiling and {args.warmup} warm-up run(s); "
        "× base: median of run-by-run ratios to the baseline, each run alternating with one of "
        "it. fwd+bwd: sum(output) and gradients wrt x and every trainable weight. Compile s: "
        "compilation plus the first run. XLA temp: temporaries of one call (JAX "
        "memory_analysis), in MiB and in float32 (b, h, L, L) arrays. cpu/wall: process CPU "
        "time over wall time in the timed runs (fwd / fwd+bwd).",
    ]
    for line in header:
        if line:
            print(line, flush=True)
    results = run(args, backend, log=lambda s: print(s, flush=True))
    markdown = render_markdown(results, header, passes)
    print()
    print(markdown.split("\n\n")[-1], end="", flush=True)
    if args.out is not None:
        meta = {
            "backend": backend,
            "command": f"KERAS_BACKEND={backend} {command}",
            "machine": machine_line(),
            "cpu": cpu_name(),
            "thread_env": {k: os.environ.get(k) for k in THREAD_ENV},
            "versions": vers,
            "compilation": compiler,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        }
        for path in write_outputs(args.out, markdown, meta, results):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
