"""Minor page faults and time per call of the ``chunked`` backend, glibc defaults against a retained
heap (see ``relpos.runtime.retain_freed_memory``).

L=2048, causal, B=1, H=8, head dim 64, float32, two threads, flush-to-zero. Each (scheme, pass,
allocator) runs in a fresh process, because allocator settings are process-wide: three warm-up
calls, then ``--calls`` timed ones; faults are ``getrusage``'s ``ru_minflt`` over the timed calls.
``none`` is plain SDPA.

    python benchmarks/page_faults.py              # a markdown table
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from relpos.cli.bench import backend_call, make_setup, sdpa_plain
from relpos.runtime import cpu_name, flush_denormals, retain_freed_memory

SCHEMES = ["none", "t5", "shaw", "music", "alibi"]


def child(scheme: str, backward: bool, retain: bool, calls: int) -> dict:
    """One measurement, in this (fresh) process."""
    flush_denormals(True)  # before the thread pool starts
    torch.set_num_threads(2)
    if retain:
        retain_freed_memory()
    s = make_setup(
        scheme, 2048, 1, causal=True, heads=8, head_dim=64, device="cpu",
        dtype=torch.float32, grad=backward,
    )  # fmt: skip
    fn = sdpa_plain if scheme == "none" else backend_call("chunked")

    def step() -> None:
        out = fn(s)
        if backward:
            out.sum().backward()

    for _ in range(3):
        step()
    times = []
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {"ms": 1e3 * statistics.median(times), "faults": faults / calls}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(**spec, calls=args.calls)))
        return 0
    print(f"{cpu_name()}, torch {torch.__version__}, L=2048 causal B=1, {args.calls} calls\n")
    print("| scheme | pass | default: faults/call | ms | retained: faults/call | ms |")
    print("|---|---|---:|---:|---:|---:|")
    for scheme in SCHEMES:
        for backward in (False, True):
            row = []
            for retain in (False, True):
                spec = json.dumps({"scheme": scheme, "backward": backward, "retain": retain})
                done = subprocess.run(
                    [sys.executable, __file__, "--calls", str(args.calls), "--child", spec],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                got = json.loads(done.stdout.strip().splitlines()[-1])
                row += [f"{got['faults']:,.0f}", f"{got['ms']:.1f}"]
            name = "fwd+bwd" if backward else "fwd"
            print(f"| {scheme} | {name} | " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
