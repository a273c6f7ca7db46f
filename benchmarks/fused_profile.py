"""One forward+backward pass of the ``fused`` kernel per scheme, inside a CUDA profiler range, for
Nsight Compute to read each Triton kernel's counters (docs/performance.md, "On a GPU").

    ncu --profile-from-start off -k regex:"_forward_kernel|_backward_(kv|q)_kernel" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section ComputeWorkloadAnalysis python benchmarks/fused_profile.py [--length 4096] \\
        [--tokens 16384] [--schemes alibi,t5,shaw,music]

Causal, bf16, ``B·L = tokens``, 8 heads of 64 (``relpos bench``'s shapes). Each scheme runs twice
first (its compile and warm-up), outside the range, so the profile holds one pass per scheme: three
kernels each, in ``--schemes`` order.
"""

from __future__ import annotations

import argparse
import sys

import torch

from relpos.cli import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384, help="B·L")
    parser.add_argument("--schemes", default="alibi,t5,shaw,music")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    run = bench.backend_call("fused")
    batch = max(args.tokens // args.length, 1)
    shape = dict(dtype=torch.bfloat16, grad=True, causal=True, heads=8, head_dim=64, device="cuda")
    setups = [
        bench.make_setup(name, args.length, batch, **shape)
        for name in args.schemes.split(",")
        if name
    ]
    for setup in setups:
        bench.measure_time(run, setup, backward=True, repeats=1, warmup=1, device="cuda")
    torch.cuda.profiler.start()
    for setup in setups:
        bench.measure_time(run, setup, backward=True, repeats=1, warmup=0, device="cuda")
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
