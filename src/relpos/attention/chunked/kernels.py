"""The stock kernels and small numeric helpers the ``chunked`` engines share.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["EXP_FLOOR", "block_bounds", "flash", "flash_backward", "flush_exp_", "sum_to"]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_HALF = (torch.float16, torch.bfloat16)


def _mask_for(q: Tensor, attn_mask: Tensor | None) -> Tensor | None:
    """A float mask in a dtype the kernel reads right: ``q``'s, or float32 with half ``q``.

    torch 2.13's CPU kernel (and ``F.scaled_dot_product_attention`` on it) reads a float32 mask
    with float64 ``q`` as garbage, with no error, and refuses float64 with float32 ``q``
    (``tests/test_band.py`` has a canary that says when upstream is fixed).
    """
    if attn_mask is None or not attn_mask.is_floating_point() or attn_mask.dtype == q.dtype:
        return attn_mask
    if attn_mask.dtype == torch.float32 and q.dtype in _HALF:
        return attn_mask
    return attn_mask.to(q.dtype)


def flash(q, k, v, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """PyTorch's fused CPU flash-attention kernel, which also returns the row log-sum-exp:
    ``(out (b, h, i, d), lse (b, h, i))``; a float ``attn_mask`` is cast where the kernel would
    misread it (:func:`_mask_for`)."""
    mask = _mask_for(q, attn_mask)
    return _FLASH(q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)


def flash_backward(do, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """Its backward: ``(dq, dk, dv)``, the mask cast as in :func:`flash`."""
    mask = _mask_for(q, attn_mask)
    return _FLASH_BACKWARD(do, q, k, v, out, lse, dropout_p, is_causal, attn_mask=mask, scale=scale)


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
