"""How much do denormal probabilities slow PyTorch's fused CPU attention? (see relpos/runtime.py)

One ``(1, 8, 256, 64)`` query block against 2048 keys, through
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: the first 1024 keys get a
mask of 0, the last 1024 a mask of ``X``. With ``|X|`` between about 87 and 104, the backward's
recomputed probabilities of those keys are denormal floats. Each mode (denormals kept, flushed)
runs in a fresh process, because flush-to-zero must be set before the thread pool starts.

    python benchmarks/denormals.py            # both modes, a markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys

import torch

from relpos.cli.bench import wall_times
from relpos.runtime import cpu_name, flush_denormals

GAPS = [-50.0, -90.0, -95.0, -100.0, -110.0, -1000.0, -math.inf]
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(wall_times(fn, repeats=repeats, warmup=1)) * 1e3


def measure(flush: bool, repeats: int, threads: int) -> dict[str, object]:
    """``{"flushed": bool, "rows": [[gap, fwd ms, bwd ms], …]}`` in this process."""
    torch.set_num_threads(threads)
    flushed = flush_denormals(flush) and flush
    torch.manual_seed(0)
    q = torch.randn(1, 8, 256, 64) * 0.1
    k, v = torch.randn(1, 8, 2048, 64), torch.randn(1, 8, 2048, 64)
    rows = []
    for gap in GAPS:
        mask = torch.zeros(1, 8, 1, 2048)
        mask[..., 1024:] = gap
        out, lse = _flash(q, k, v, 0.0, False, attn_mask=mask, scale=0.125)
        do = torch.randn_like(out)
        fwd = _median_ms(lambda m=mask: _flash(q, k, v, 0.0, False, attn_mask=m, scale=0.125), 5)
        bwd = _median_ms(
            lambda m=mask, o=out, l_=lse, g=do: _flash_bwd(
                g, q, k, v, o, l_, 0.0, False, attn_mask=m, scale=0.125
            ),
            repeats,
        )
        rows.append([gap, fwd, bwd])
    return {"flushed": flushed, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["keep", "flush"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "flush", args.repeats, args.threads)))
        return
    runs = {}
    for mode in ("keep", "flush"):
        cmd = [sys.executable, __file__, "--child", mode, "--repeats", str(args.repeats)]
        cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    print(
        f"{cpu_name()}, {args.threads} threads, torch {torch.__version__}; "
        f"flush-to-zero took effect: {runs['flush']['flushed']}\n"
    )
    print("| mask of the last 1024 keys | fwd ms | bwd ms, denormals kept | bwd ms, flushed |")
    print("|---:|---:|---:|---:|")
    for kept, flushed in zip(runs["keep"]["rows"], runs["flush"]["rows"], strict=True):
        print(f"| {kept[0]:g} | {kept[1]:.1f} | {kept[2]:.1f} | {flushed[2]:.1f} |")


if __name__ == "__main__":
    main()
