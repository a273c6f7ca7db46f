"""The cost of one attention layer's dropout mask on the CPU: torch's ``F.dropout`` (a float
``bernoulli_``) against :func:`relpos.functional.dropout.drop_mask` (16-bit integer lanes),
and each applied to the probabilities. Default shape: the JSB recipe's ``(8, 4, 512, 512)``.
Best of 7 after a warm-up, on the threads ``OMP_NUM_THREADS`` allows.

    OMP_NUM_THREADS=2 python benchmarks/dropout_mask.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from relpos.cli.bench import wall_times
from relpos.functional.dropout import drop_mask, dropout
from relpos.runtime import cpu_name


def best_ms(fn, repeats: int = 7) -> float:
    return 1e3 * min(wall_times(fn, repeats=repeats, warmup=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8,4,512,512", help="comma-separated, e.g. 8,4,512,512")
    p.add_argument("--p", type=float, default=0.15)
    args = p.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    torch.manual_seed(0)
    probs = torch.rand(shape)
    cpu = torch.device("cpu")
    rows = {
        "F.dropout (torch's mask, applied)": lambda: F.dropout(probs, args.p),
        "drop_mask (the mask alone)": lambda: drop_mask(shape, args.p, cpu),
        "relpos dropout (mask, applied)": lambda: dropout(probs, args.p),
    }
    print(f"{cpu_name()}, {torch.get_num_threads()} thread(s); shape {shape}, p={args.p}")
    for name, fn in rows.items():
        print(f"{name:36s} {best_ms(fn):8.1f} ms")


if __name__ == "__main__":
    main()
