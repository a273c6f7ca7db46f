"""The region path's two band engines against each other: tiles (``relpos.attention.chunked.band``)
and distance coordinates (``relpos.attention.chunked.narrow``), per pass, for its bounds.

L=2048, B=1 (or ``--length``, ``--batch``), H=8, head dim 64, float32, two threads,
flush-to-zero, heap retained (as ``relpos bench``). Every configuration of a case is timed in turn
within each repeat, beside plain SDPA at the same shape, and reported as the median time and its
ratio to plain SDPA's median.

    python benchmarks/band_engines.py                  # every case, a markdown table
    python benchmarks/band_engines.py --cases shaw     # cases whose name starts with "shaw"
    python benchmarks/band_engines.py --length 1024 --batch 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import relpos
from relpos.attention.chunked import narrow
from relpos.cli.argtypes import int_type
from relpos.cli.bench import backend_call, make_setup, sdpa_plain
from relpos.runtime import cpu_name, flush_denormals, retain_freed_memory

BIG = 1 << 30
#: name: (NARROW_WIDTH, NARROW_RATIO, NARROW_BLOCK): which engine runs the band (forced: no
#: bound on the ratio of length to band), and the distance engine's block.
ENGINES = {
    "tiles": (-1, 0, 32),
    "distance (B=16)": (BIG, 0, 16),
    "distance (B=32)": (BIG, 0, 32),
}
#: (name, scheme spec, causal)
CASES = [
    ("shaw k=16 causal", {"name": "shaw"}, True),
    ("shaw k=16 bidirectional", {"name": "shaw"}, False),
    ("t5 causal", {"name": "t5"}, True),
    ("t5 bidirectional", {"name": "t5"}, False),
    *(
        (f"music M={m} causal", {"name": "music", "max_distance": m}, True)
        for m in (128, 256, 512, 1024)
    ),
]


def measure(
    spec: dict, causal: bool, backward: bool, repeats: int, n: int, batch: int
) -> dict[str, float]:
    """Median seconds per engine configuration (and ``plain``) for one case and pass."""
    s = make_setup(
        spec["name"], n, batch, causal=causal, heads=8, head_dim=64, device="cpu",
        dtype=torch.float32, grad=backward,
    )  # fmt: skip
    s.scheme = relpos.make_scheme(spec, d_model=512, num_heads=8, causal=causal)
    s.scheme.requires_grad_(backward)
    fast = backend_call("chunked")
    saved = (narrow.NARROW_WIDTH, narrow.NARROW_RATIO, narrow.NARROW_BLOCK)

    def run(name: str) -> float:
        if name != "plain":
            narrow.NARROW_WIDTH, narrow.NARROW_RATIO, narrow.NARROW_BLOCK = ENGINES[name]
        t0 = time.perf_counter()
        out = (sdpa_plain if name == "plain" else fast)(s)
        if backward:
            out.sum().backward()
        return time.perf_counter() - t0

    names = ["plain", *ENGINES]
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name in names:  # warm-up: caches, masks, the allocator
            run(name), run(name)
        for _ in range(repeats):
            for name in names:
                times[name].append(run(name))
    finally:
        narrow.NARROW_WIDTH, narrow.NARROW_RATIO, narrow.NARROW_BLOCK = saved
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [name for name, _, _ in CASES]
    p.add_argument(
        "--cases", default="", help=f"only cases whose name starts with this, of: {names}"
    )
    p.add_argument("--repeats", type=int_type(1), default=9, help="timed runs, median reported")
    p.add_argument("--length", type=int_type(1), default=2048)
    p.add_argument("--batch", type=int_type(1), default=1)
    args = p.parse_args(argv)
    if not any(name.startswith(args.cases) for name in names):
        p.error(f"--cases: no case name starts with {args.cases!r}; known cases: {names}")
    flush_denormals(True)  # before the thread pool starts
    torch.set_num_threads(2)
    retain_freed_memory()
    print(
        f"{cpu_name()}, torch {torch.__version__}, L={args.length}, B={args.batch}, "
        f"{args.repeats} repeats"
    )
    print("ms (× plain SDPA)\n")
    print("| case | pass | plain SDPA | " + " | ".join(ENGINES) + " |")
    print("|---|---|---:|" + "---:|" * len(ENGINES))
    for name, spec, causal in CASES:
        if not name.startswith(args.cases):
            continue
        for backward in (False, True):
            t = measure(spec, causal, backward, args.repeats, args.length, args.batch)
            cells = [f"{1e3 * t[e]:.1f} ({t[e] / t['plain']:.2f})" for e in ENGINES]
            pass_ = "fwd+bwd" if backward else "fwd"
            print(f"| {name} | {pass_} | {1e3 * t['plain']:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
