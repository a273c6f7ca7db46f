"""One training step (forward + backward) of the demo model with and without bfloat16 autocast.

The demo's Music Transformer (3 layers, width 128, relative attention), 16 windows of 256 tokens,
one thread; each variant timed in turn, best of 4 after a warm-up. Whether autocast pays off
depends on the CPU's bfloat16 instructions (AVX-512 BF16, AMX); without them it is emulated.

    OMP_NUM_THREADS=1 python benchmarks/autocast.py
"""

from __future__ import annotations

import time

import torch

from relpos import Transformer, TransformerConfig
from relpos.music import VOCAB_SIZE
from relpos.training import accumulate_gradients


def main() -> None:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=VOCAB_SIZE,
        d_model=128,
        num_heads=4,
        num_layers=3,
        scheme={"name": "music", "max_distance": 256},
    )
    model = Transformer(cfg)
    tokens = torch.randint(0, VOCAB_SIZE, (16, 257))
    mask = torch.ones(16, 257, dtype=torch.bool)

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
    print(f"float32 {fp32:.3f} s, bf16 autocast {bf16:.3f} s: {bf16 / fp32:.2f}x")


if __name__ == "__main__":
    main()
