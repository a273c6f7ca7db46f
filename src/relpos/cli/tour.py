"""A tour of every registered scheme: build a small decoder with it and prove it batch-correct.

For each scheme, prints the parameter count and the largest difference between running each
sequence alone and running it (a) left-padded, (b) right-padded, (c) packed with other documents,
(d) decoded token by token with a KV cache, (e) decoded in chunks of 3, (f) generated in a batch of
left-padded prompts. A scheme passes a check when that difference is below 1e-5.

    relpos tour
"""

from __future__ import annotations

import time

import torch

from .. import checks
from ..models import Transformer, TransformerConfig
from ..schemes import SCHEMES

__all__ = ["main"]

TOLERANCE = 1e-5


def main() -> int:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def doc(n: int) -> torch.Tensor:
        return torch.randint(0, 64, (n,), generator=g)

    docs = [doc(n) for n in (5, 12, 9)]
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    columns = ["left pad", "right pad", "packed", "cache x1", "cache x3", "batch gen"]
    width = max(len("scheme"), *(len(name) for name in SCHEMES)) + 2
    print(
        f"{'scheme':<{width}}{'params':>9}  " + "".join(f"{c:>11}" for c in columns) + "   verdict"
    )
    failures = 0
    start = time.perf_counter()
    for name in sorted(SCHEMES):
        cfg = TransformerConfig(
            vocab_size=64, d_model=64, num_heads=4, num_layers=2, dropout=0.0, scheme=name
        )
        model = Transformer(cfg).eval()
        gaps = [
            checks.padded_gap(model, docs, side="left"),
            checks.padded_gap(model, docs, side="right"),
            checks.packed_gap(model, [docs[:2], docs[2:]]),
            checks.cached_gap(model, tokens, chunk=1),
            checks.cached_gap(model, tokens, chunk=3),
            checks.left_padded_decoding_gap(model, docs, tokens[:1].expand(3, -1)[:, :6]),
        ]
        passed = sum(gap < TOLERANCE for gap in gaps)
        failures += passed < len(gaps)
        cells = "".join(f"{gap:>11.1e}" for gap in gaps)
        print(f"{name:<{width}}{model.num_parameters():>9,}  {cells}   {passed}/{len(gaps)} passed")
    print(
        f"\nmax |batched - alone| per check; {len(SCHEMES)} schemes in "
        f"{time.perf_counter() - start:.1f}s. {'All checks passed.' if not failures else ''}"
    )
    return 1 if failures else 0
