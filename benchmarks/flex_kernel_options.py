"""Which FlexAttention block sizes compile on this GPU for a learned relative table with
gradients, and how fast each runs (docs/performance.md, "On a GPU"; CUDA only).

    PYTHONPATH=src python benchmarks/flex_kernel_options.py t5      # or music (default t5)

For each candidate, `relpos`'s `flex` backend runs one forward+backward pass at L=4096, B=4, H=8,
d=64 in bf16 (the first call compiles), then ten more; it prints the median, or the compile error
(Inductor's "out of resource" when a kernel asks for more shared memory than the GPU has).
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch

from relpos.attention import flex
from relpos.cli import bench

BACKWARD_32 = {"BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32}
CANDIDATES = {
    "default": None,
    "bwd32": BACKWARD_32,
    "bwd32+fwd64s1": flex.SMALL_BLOCKS,
    "bwd64x32": {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
}


def probe(scheme: str) -> None:
    """Print one ``PROBE`` line per candidate of :data:`CANDIDATES` for ``scheme``."""
    run = bench.backend_call("flex")
    for label, options in CANDIDATES.items():
        setup = bench.make_setup(
            scheme, 4096, 4, causal=True, heads=8, head_dim=64, device="cuda",
            dtype=torch.bfloat16, grad=True,
        )  # fmt: skip
        # Each candidate as it is: the backend's retry with SMALL_BLOCKS is turned off by
        # making the candidate its own fallback.
        with (
            mock.patch.object(flex, "_kernel_options", lambda *a, o=options: o),
            mock.patch.object(flex, "SMALL_BLOCKS", options),
        ):
            try:
                first, *_ = bench.measure_time(
                    run, setup, backward=True, repeats=1, warmup=0, device="cuda"
                )
                times = bench.measure_time(
                    run, setup, backward=True, repeats=10, warmup=0, device="cuda"
                )
            except RuntimeError as e:
                text = " ".join(str(e).split())
                at = max(text.find("out of resource") - 120, 0)
                print(f"PROBE {scheme} {label}: {type(e).__name__}: {text[at : at + 320]}")
                continue
        median = statistics.median(times) * 1e3
        print(f"PROBE {scheme} {label}: ok first {first:.1f} s, fwd+bwd median {median:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "scheme",
        nargs="?",
        default="t5",
        choices=bench.SCHEMES,
        metavar="SCHEME",
        help=f"the scheme to probe (default t5; the doc's runs: t5, music), one of {bench.SCHEMES}",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: FlexAttention has a backward pass only there")
    probe(args.scheme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
