"""One training step (forward + backward) of a Music Transformer with and without bfloat16
autocast.

By default the demo's model (3 layers, width 128, relative attention), 16 windows of 256 tokens;
``--d-model``, ``--layers``, ``--context`` and ``--batch`` change it (4 heads, MLP 4× the width).
Each variant is timed in turn, best of 4 after a warm-up, on the threads ``OMP_NUM_THREADS``
allows. Whether autocast pays off depends on the CPU's bfloat16 instructions (AVX-512 BF16, AMX):
without them bfloat16 is emulated. The header says which this CPU has.

    OMP_NUM_THREADS=1 python benchmarks/autocast.py
    OMP_NUM_THREADS=1 python benchmarks/autocast.py --d-model 256 --layers 4 --context 512 --batch 8
"""

from __future__ import annotations

import argparse
import time

import torch

from relpos import Transformer, TransformerConfig
from relpos.music import VOCAB_SIZE
from relpos.runtime import bf16_instructions, cpu_name
from relpos.training import accumulate_gradients


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=VOCAB_SIZE,
        d_model=args.d_model,
        num_heads=4,
        num_layers=args.layers,
        d_ff=4 * args.d_model,
        scheme={"name": "music", "max_distance": args.context},
    )
    model = Transformer(cfg)
    tokens = torch.randint(0, VOCAB_SIZE, (args.batch, args.context + 1))
    mask = torch.ones_like(tokens, dtype=torch.bool)

    def step(autocast: bool) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        accumulate_gradients(model, tokens, mask, autocast=autocast)
        return time.perf_counter() - t0

    times: dict[bool, list[float]] = {False: [], True: []}
    for autocast in times:
        step(autocast)  # warm-up
    for _ in range(4):
        for autocast in times:
            times[autocast].append(step(autocast))
    fp32, bf16 = min(times[False]), min(times[True])
    flags = ", ".join(bf16_instructions()) or "none"
    print(
        f"{cpu_name()} (bfloat16 instructions: {flags}), {torch.get_num_threads()} thread(s); "
        f"width {args.d_model}, {args.layers} layers, {args.batch} × {args.context} tokens"
    )
    print(f"float32 {fp32:.3f} s, bf16 autocast {bf16:.3f} s: {bf16 / fp32:.2f}x")


if __name__ == "__main__":
    main()
