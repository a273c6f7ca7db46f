"""What the host issues for one ``fused`` forward+backward pass: PyTorch ops and Triton launches per
scheme, counted on a CPU (docs/performance.md, "On a GPU").

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host_ops.py [--schemes alibi,t5,music]
        [--layout plain] [--by-site] [--repeats 300]

On a GPU each op is a kernel launch (or an allocation) the host pays for, whatever its size, so
at the bench's sizes a pass with many of them can take longer to issue than to run. The pass runs
with its kernels recorded, not run (``relative_attention.recorded_launches``), on small CPU
tensors; an op is counted when it reaches the dispatcher, views excluded (they launch nothing),
and the kernels' two operators (``relpos::…``) by the ops they issue.
The non-finite check every backend ends with (``contract.propagate_nonfinite``) takes a shortcut
on a CPU (a sum per tensor and a host sync, cheap there): its ops are replaced by those of the
path a GPU takes (``contract.nonfinite_rows``, then one ``where``). The bench's own ops (clearing
the gradients, the backward pass's seed) are left out. A step's first layer derives what it
needs from the step's positions; each later layer finds it kept (``Positions.derived``).
``--by-site`` lists each op of a first layer with the line that issued it.

The host column is the median time of a later layer's pass on this CPU, its kernels recorded
(Python and the dispatch of its ops on small tensors, which a GPU host pays too, though not
Triton's launches), beside plain SDPA's pass on the same small tensors, which runs its math:
a figure to compare between commits on one machine, not a GPU's host time.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from relpos.attention import contract
from relpos.cli import bench
from relpos.kernels.relative_attention import recorded_launches
from relpos.positions import Positions

#: Ops that make a view or a metadata change: no kernel, no allocation.
VIEWS = {
    "view", "_unsafe_view", "unsqueeze", "squeeze", "expand", "t", "transpose", "select", "slice",
    "detach", "alias", "as_strided", "permute", "_reshape_alias", "lift_fresh", "split",
}  # fmt: skip


class _Ops(TorchDispatchMode):
    """Each non-view op dispatched, with the innermost ``relpos`` line that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "relpos":  # the kernels' operators: their own ops, counted inside
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            frames = [f for f in traceback.extract_stack() if "relpos" in f.filename]
            site = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
            self.ops.append((name, site, tuple(f.name for f in frames)))
        return func(*args, **(kwargs or {}))


def _setup(name: str, layout: str) -> bench.Setup:
    return bench.make_setup(
        name, 64, 2, causal=True, heads=2, head_dim=16, device="cpu", dtype=torch.bfloat16,
        grad=True, layout=layout,
    )  # fmt: skip


def count(name: str, layout: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]], int]:
    """``(first, later, launches)`` of one forward+backward pass of ``name`` through ``fused``:
    the ops of a step's first layer (positions new to it) and of each later one (the step's
    positions, what they derive already kept: :meth:`~relpos.Positions.derived`)."""
    s = _setup(name, layout)
    step = bench.step_of(bench.backend_call("fused"), s, backward=True)
    with recorded_launches():
        step()  # caches filled, as in a warm training loop
    p = s.positions
    contract.nonfinite_rows(s.q, s.k, s.scheme, p, p, s.causal)  # the GPU path's, kept too
    later, launches = _pass_ops(s, step)
    s.positions = Positions(p.pos, p.seg, p.contiguous, p.span)  # a new step's: nothing kept
    first, _ = _pass_ops(s, step)
    return first, later, launches


def host_ms(name: str, layout: str, impl: str, repeats: int) -> float:
    """The median milliseconds of a later layer's forward+backward pass of ``name`` through
    ``impl`` on this CPU, the kernels recorded, not run (``fused``)."""
    step = bench.step_of(bench.backend_call(impl), _setup(name, layout), backward=True)
    times = []
    with recorded_launches():
        for n in range(repeats + 10):  # the first ten warm the caches
            start = time.perf_counter()
            step()
            if n >= 10:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _pass_ops(s: bench.Setup, step) -> tuple[list[tuple[str, str]], int]:
    """The ops and launches of ``step``, the non-finite check's GPU path in place of its own."""
    with recorded_launches() as launches, _Ops() as seen:
        step()
    ops = [
        (op, site)
        for op, site, frames in seen.ops
        if "propagate_nonfinite" not in frames and not site.startswith("bench.py")
    ]
    with _Ops() as check:
        p = s.positions
        bad = contract.nonfinite_rows(s.q, s.k, s.scheme, p, p, s.causal)
        torch.where(bad.unsqueeze(-1), torch.nan, s.q)
    return ops + [(op, site) for op, site, _ in check.ops], len(launches)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="alibi,learned_alibi,t5,shaw,music,kerple,deberta")
    parser.add_argument("--layout", choices=bench.LAYOUTS, default="plain")
    parser.add_argument("--by-site", action="store_true")
    parser.add_argument("--repeats", type=int, default=300, help="timed passes for the host column")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"fused, one forward+backward pass, {args.layout} positions, torch {torch.__version__}")
    plain = host_ms("nope", args.layout, "sdpa", args.repeats)
    print(f"plain SDPA's pass on the same small tensors, this CPU, one thread: {plain:.3f} ms")
    print(
        "| scheme | PyTorch ops, a step's first layer | each later layer | Triton launches "
        "| host ms, a later layer (× plain SDPA's pass) |\n|---|---:|---:|---:|---:|"
    )
    listed = []
    for name in args.schemes.split(","):
        first, later, launches = count(name, args.layout)
        host = host_ms(name, args.layout, "fused", args.repeats)
        ops = f"| {name} | {len(first)} | {len(later)} | {launches} |"
        print(f"{ops} {host:.3f} ({host / plain:.2f}) |")
        listed.append((name, first))
    if args.by_site:
        for name, ops in listed:
            sites = collections.Counter(f"{op} {site}" for op, site in ops)
            print(f"\n{name}:\n" + "\n".join(f"  {n} × {what}" for what, n in sites.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
