"""The stock kernels and small numeric helpers the ``chunked`` engines share.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["EXP_FLOOR", "block_bounds", "flash", "flash_backward", "flush_exp_", "sum_to"]

#: PyTorch's fused CPU flash-attention kernel, which also returns the row log-sum-exp:
#: ``flash(q, k, v, dropout_p, is_causal, scale=) -> (out (b, h, i, d), lse (b, h, i))``.
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
#: Its backward: ``flash_backward(do, q, k, v, out, lse, dropout_p, is_causal, scale=)``.
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

#: ``exp(EXP_FLOOR) ≈ 1.6e-38``, the smallest normal float32 order of magnitude.
EXP_FLOOR = -87.0


def flush_exp_(x: Tensor) -> Tensor:
    """``exp(x)`` in place for ``x <= 0``, with ``x < -87`` flushed to ``exp(-87)``.

    CPU ``exp`` takes a slow path for large negative inputs and denormal results. Every caller
    zeroes masked entries afterwards, and a row's largest entry is 1, so the flush changes no
    result beyond float32 rounding.
    """
    return x.clamp_min_(EXP_FLOOR).exp_()


def block_bounds(lo: int, hi: int, block: int) -> list[tuple[int, int]]:
    """``[(lo, lo + block), …, (…, hi)]``: ``[lo, hi)`` cut into blocks."""
    return [(s, min(s + block, hi)) for s in range(lo, hi, block)]


def sum_to(x: Tensor, shape: torch.Size) -> Tensor:
    """Sum ``x`` over the dimensions where ``shape`` broadcasts (size 1): a broadcast's adjoint."""
    dims = [t for t, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1]
    return x.sum(dims, keepdim=True) if dims else x
