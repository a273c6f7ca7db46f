"""Does ``torch.compile`` speed up the band engine? (issue 3: "try torch.compile and keep what is
faster").

The band's heavy work is in GEMMs and the fused CPU flash kernel already; what ``torch.compile``
could fuse is the elementwise chain of the backward pass,
:func:`relpos.attention.band.probs_and_dscores` (scale, mask, ``exp``, ``dS = P ⊙ (dP - D)``).
This script times ``chunked`` forward+backward with that function eager and compiled
(``dynamic=True``: one compile for every tile shape), interleaved with plain SDPA, and prints the
compile time of the first call. Results and the decision are in ``docs/performance.md``.

    python benchmarks/compile_band.py --lengths 2048 --schemes music,shaw,t5 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from relpos.attention import band
from relpos.bench import _backend, _sdpa_plain, make_setup, measure_time

EAGER = band.probs_and_dscores


def median_ms(fn, setup, repeats: int) -> float:
    times = measure_time(fn, setup, backward=True, repeats=repeats, warmup=1, device="cpu")
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048")
    parser.add_argument("--schemes", default="music,shaw,t5")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = torch.compile(EAGER, dynamic=True)
    chunked = _backend("chunked")
    kw = dict(heads=8, head_dim=64, device="cpu", dtype=torch.float32, grad=True, causal=True)
    print(f"torch {torch.__version__}, {args.threads} threads, B=1, H=8, d=64, causal, fwd+bwd")
    print("| scheme | L | plain SDPA ms | eager × plain | compiled × plain | first call s |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        base = make_setup("none", n, 1, **kw)
        for name in args.schemes.split(","):
            setup = make_setup(name, n, 1, **kw)
            band.probs_and_dscores = compiled
            start = time.perf_counter()
            measure_time(chunked, setup, backward=True, repeats=1, warmup=0, device="cpu")
            first = time.perf_counter() - start
            plain, eager, comp = [], [], []
            for _ in range(2):  # interleave, to share the box's drift between the three
                plain.append(median_ms(_sdpa_plain, base, args.repeats))
                band.probs_and_dscores = EAGER
                eager.append(median_ms(chunked, setup, args.repeats))
                band.probs_and_dscores = compiled
                comp.append(median_ms(chunked, setup, args.repeats))
            band.probs_and_dscores = EAGER
            p = statistics.mean(plain)
            print(
                f"| {name} | {n} | {p:.1f} | {statistics.mean(eager) / p:.2f} "
                f"| {statistics.mean(comp) / p:.2f} | {first:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
