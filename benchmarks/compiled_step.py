"""A ``fused`` (or ``flex``) forward+backward step, uncompiled and under ``torch.compile``,
against SDPA with no positions (flash on a GPU) run the same way in the same process
(docs/performance.md, "On a GPU"): how much of a step's cost compiling takes out (the ops around
the kernels fused, and with CUDA graphs, ``reduce-overhead``, the host's per-call cost).

    PYTHONPATH=src python benchmarks/compiled_step.py --device cuda [--schemes alibi,t5,music]
        [--impls fused,flex] [--length 4096] [--tokens 16384]
        [--modes eager,default,reduce-overhead] [--out FILE]

Modes: ``eager`` (not compiled), ``aot_eager`` (AOTAutograd's graphs run op by op), ``default``
(Inductor) and ``reduce-overhead`` (Inductor with CUDA graphs). Each compiled step is first
checked against the uncompiled one (the output and every gradient); a mode that fails to compile
or to match is reported so, not timed. A step is timed queued: ``--steps`` steps issued back to
back and one sync (what a training loop sees: the host runs ahead of the device where it can),
the median of ``--repeats`` such runs. On a CPU (``TRITON_INTERPRET=1``) it runs as a check of
itself at small sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from relpos.attention.flex import flex_attention_backend
from relpos.attention.fused import fused_attention
from relpos.cli import bench
from relpos.cli.profiling import wait_for_device

MODES = ("eager", "aot_eager", "default", "reduce-overhead")
#: The backends a step can take (``flex`` needs CUDA for gradients).
IMPLS = {"fused": fused_attention, "flex": flex_attention_backend}
#: Tolerances of a compiled step against the uncompiled one, by input dtype: the same kernels,
#: with the ops around them fused (in other orders of summation).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _compiled(fn: Callable, mode: str) -> Callable:
    if mode == "eager":
        return fn
    if mode == "aot_eager":
        return torch.compile(fn, backend="aot_eager", fullgraph=True)
    return torch.compile(fn, mode=None if mode == "default" else mode, fullgraph=True)


def _step(fn: Callable, s: bench.Setup, mode: str) -> Callable[[], list[torch.Tensor]]:
    """One forward+backward of ``fn(q, k, v)``: the output and the gradients it leaves."""
    leaves = [s.q, s.k, s.v, *s.scheme.parameters()]

    def step() -> list[torch.Tensor]:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        for t in leaves:
            t.grad = None
        out = fn(s.q, s.k, s.v)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in leaves if t.grad is not None)]

    return step


def _queued_ms(step: Callable, steps: int, repeats: int, device: str) -> float:
    """The median over ``repeats`` of the time per step of ``steps`` steps and one sync."""
    times = []
    for _ in range(repeats):
        wait_for_device(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wait_for_device(device)
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times) * 1e3


def mismatch(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> str | None:
    """Why the compiled step's tensors differ from the uncompiled step's, or None."""
    if len(got) != len(want):
        return f"{len(got)} tensors, want {len(want)}"
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = w.float().abs().max().item() + 1.0
        err = (g.float() - w.float()).abs().max().item() / scale
        if not err <= tol:  # NaN fails too
            return f"tensor {n} (0: the output, then the gradients) off by {err:.2g} (relative)"
    return None


def _modes(
    args: argparse.Namespace, attend: Callable, plain: Callable, s: bench.Setup,
    dtype: torch.dtype, row: dict, log: Callable[[str], None],
) -> list[dict]:  # fmt: skip
    """A row per mode of ``attend``'s step: checked against its uncompiled step, then timed
    beside ``plain``'s compiled alike."""
    rows = []
    want = _step(attend, s, "eager")()
    for mode in args.modes:
        row = {**row, "mode": mode, "L": args.length, "B": s.q.shape[0]}
        try:
            steps = {
                "step": _step(_compiled(attend, mode), s, mode),
                "plain": _step(_compiled(plain, mode), s, mode),
            }
            for step in steps.values():  # compiles, then the steady state
                for _ in range(args.warmup):
                    step()
            row["error"] = mismatch(steps["step"](), want, TOLERANCE[dtype])
        except Exception as e:  # a mode that does not compile is a result, not a crash
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        if row["error"] is None:
            for key, step in steps.items():
                row[f"{key}_ms"] = _queued_ms(step, args.steps, args.repeats, args.device)
            row["ratio"] = row["step_ms"] / row["plain_ms"]
        log(_line(row))
        rows.append(row)
    return rows


def run(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    b = max(1, args.tokens // args.length)
    rows = []
    for name in args.schemes:
        s = bench.make_setup(
            name, args.length, b, causal=True, heads=args.heads, head_dim=args.head_dim,
            device=args.device, dtype=dtype, grad=True,
        )  # fmt: skip
        p = s.positions

        def plain(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        for impl in args.impls:

            def attend(q, k, v, s=s, p=p, backend=IMPLS[impl]):
                q, k = s.scheme.rotate(q, k, p, p)
                return backend(q, k, v, s.scheme, p, p, causal=True)

            rows += _modes(args, attend, plain, s, dtype, {"scheme": name, "impl": impl}, log)
        del s
        torch._dynamo.reset()
    return rows


def _line(row: dict) -> str:
    first = f"| {row['scheme']} | {row['impl']} | {row['mode']} "
    if row.get("error"):
        return first + f"| – | – | – | {row['error']} |"
    return first + f"| {row['step_ms']:.3g} | {row['plain_ms']:.3g} | {row['ratio']:.2f} | |"


def _header(args: argparse.Namespace) -> str:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    return (
        f"fwd+bwd step, queued ({args.steps} steps, one sync), {device}, torch "
        f"{torch.__version__}, {args.dtype}, causal, L={args.length}, B·L={args.tokens}, "
        f"H={args.heads}, d={args.head_dim}\n`python benchmarks/compiled_step.py "
        f"{' '.join(args.argv)}`\n\n"
        "| scheme | backend | mode | ms | SDPA ms | × SDPA | not timed: why |\n"
        "|---|---|---|---:|---:|---:|---|"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="alibi,t5,music")
    parser.add_argument("--impls", default="fused", help="fused, flex (CUDA)")
    parser.add_argument("--modes", default="eager,default,reduce-overhead")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    args.schemes = args.schemes.split(",")
    args.modes = args.modes.split(",")
    args.impls = args.impls.split(",")
    if unknown := set(args.impls) - set(IMPLS):
        parser.error(f"--impls: unknown {sorted(unknown)}; choose from {', '.join(IMPLS)}")
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    print(_header(args), flush=True)
    rows = run(args, lambda line: print(line, flush=True))
    if args.out:
        text = "\n".join([_header(args), *map(_line, rows)]) + "\n"
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, args.out)  # whole or not at all
    return 0 if all(r.get("error") is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
