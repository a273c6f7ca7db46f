"""Rotary position embedding (Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding", §3.4)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..spec.rope import rope_frequencies as spec_rope_frequencies
from .dtypes import compute_dtype, outside_autocast

__all__ = ["apply_rope", "reduced_angles", "rope_angles", "rope_frequencies"]


def rope_frequencies(rotary_dim: int, theta: float = 10000.0, device=None) -> Tensor:
    """Inverse frequencies ``theta^(-2i/rotary_dim)``, float32, shape ``(rotary_dim/2,)``
    (:func:`relpos.spec.rope.rope_frequencies`, as a tensor)."""
    return torch.from_numpy(spec_rope_frequencies(rotary_dim, theta)).to(device)


_TWO_PI = 2.0 * math.pi  # the float64 modulus every angle is reduced by
_LOW = (1 << 24) - 1


def reduced_angles(pos: Tensor, inv_freq: Tensor) -> Tensor:
    """``pos·ω`` modulo ``2π`` with an error of about ``1e-8`` at any int64 position, returned in
    at least float32 (``inv_freq``'s compute dtype).

    A float32 ``pos·ω`` at position ``10⁹`` is off by tens of radians (the position itself is
    rounded to a multiple of 64), so RoPE lost its relative property far from 0, silently. Here
    the position splits into 24-bit parts, ``pos = a·2⁴⁸ + b·2²⁴ + c``, and ``ω`` into 24-bit
    parts (one for a float32 ``ω``, two and a small rest for float64): every product of two parts
    is exact in float64, and ``fmod`` by the float64 ``2π`` is exact, so the angles of two
    positions differ by ``(p - q)·ω`` modulo that ``2π`` to float64 rounding, whatever ``p``.
    Differentiable in ``inv_freq`` (learned frequencies): the gradient is ``pos``. MPS has no
    float64: there the plain product, with its float32 rounding.

    Shapes: ``pos`` int64 and ``inv_freq`` broadcast against each other.
    """
    dtype = compute_dtype(inv_freq.dtype)
    if pos.device.type == "mps":
        return pos.to(dtype) * inv_freq.to(dtype)
    f = inv_freq.to(torch.float64)
    parts = [f.to(torch.float32).to(torch.float64)]
    rest = None
    if inv_freq.dtype == torch.float64:
        rest = f - parts[0]
        parts.append(rest.to(torch.float32).to(torch.float64))
        rest = rest - parts[1]  # below 2^-48·ω: its product needs no splitting
    pos = pos.long()  # the shifts below assume 64 bits
    a = (pos >> 48).to(torch.float64)
    b = ((pos >> 24) & _LOW).to(torch.float64)
    c = (pos & _LOW).to(torch.float64)
    total = None
    for g in parts:
        term = (
            torch.fmod(a * (g * 2.0**48), _TWO_PI) + torch.fmod(b * (g * 2.0**24), _TWO_PI) + c * g
        )
        total = term if total is None else total + term
    if rest is not None:
        total = total + pos.to(torch.float64) * rest
    return torch.fmod(total, _TWO_PI).to(dtype)


def rope_angles(pos: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotation angle ``pos · ω_i`` per token and pair, at least float32, ``(..., n, d/2)``.

    Integer positions give the angle modulo ``2π`` (:func:`reduced_angles`), exact enough for the
    relative property at any offset; floating positions the plain product.
    ``inv_freq``: ``(d/2,)``, or per token ``(..., n, d/2)`` (length-dependent scalings)."""
    if pos.dtype.is_floating_point:
        dtype = compute_dtype(inv_freq.dtype)
        return pos.to(dtype).unsqueeze(-1) * inv_freq.to(dtype)
    return reduced_angles(pos.unsqueeze(-1), inv_freq)


def apply_rope(
    x: Tensor, angles: Tensor, *, interleaved: bool = False, scale: Tensor | None = None
) -> Tensor:
    """Rotate pairs of features of ``x`` by ``angles``; features past ``2·angles.shape[-1]`` pass.

    Pairing: ``interleaved=False`` rotates ``(x[k], x[k + r/2])`` (half-split, GPT-NeoX/Llama);
    ``interleaved=True`` rotates ``(x[2k], x[2k+1])`` (the RoFormer paper, GPT-J).
    ``scale`` (e.g. xPos's decay) multiplies both features of each rotated pair.

    Shapes:
        x: ``(b, h, n, d)``; angles, scale: ``(b|1, n, r/2)`` with ``r <= d``; returns ``x``'s
        shape and dtype (the rotation itself runs in at least float32).
    """
    half = angles.shape[-1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary dim {2 * half} exceeds the head dim {x.shape[-1]}")
    cos = angles.cos().unsqueeze(1)  # (b|1, 1, n, r/2)
    sin = angles.sin().unsqueeze(1)
    if scale is not None:  # s·R: its transpose s·Rᵀ is the rotation by -angles, scaled alike
        cos, sin = cos * scale.unsqueeze(1), sin * scale.unsqueeze(1)
    if cos.requires_grad:  # learned angles: let autograd differentiate the products
        return _rope_autograd(x, cos, sin, interleaved)
    return _Rope.apply(x, cos, sin, interleaved)


def _pairs(t: Tensor, half: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    """The two halves of every rotated pair, as views."""
    if interleaved:
        return t[..., 0 : 2 * half : 2], t[..., 1 : 2 * half : 2]
    return t[..., :half], t[..., half : 2 * half]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """``y1 = x1·cos - x2·sin``, ``y2 = x1·sin + x2·cos`` written straight into the output (a
    product and a fused multiply-add per half: four passes, no concatenation), in at least
    float32, returned in ``x``'s dtype."""
    half = cos.shape[-1]
    out = torch.empty(x.shape, dtype=compute_dtype(x.dtype), device=x.device)
    (x1, x2), (y1, y2) = _pairs(x, half, interleaved), _pairs(out, half, interleaved)
    torch.mul(x1, cos, out=y1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x1, sin, out=y2).addcmul_(x2, cos)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half :] = x[..., 2 * half :]
    return out.to(x.dtype)


class _Rope(torch.autograd.Function):
    """The rotation with its gradient in closed form: a rotation's transpose is the rotation by
    the opposite angles (``sin → -sin``), four passes again instead of autograd's eight. The
    backward pass calls this same function, so it is differentiable in turn."""

    @staticmethod
    @outside_autocast
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate(x, cos, sin, interleaved)

    @staticmethod
    @outside_autocast
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return _Rope.apply(grad, cos, -sin, ctx.interleaved), None, None, None


def _rope_autograd(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """The rotation in differentiable ops (gradients reach the angles too)."""
    half = cos.shape[-1]
    r = 2 * half
    rot = x[..., :r].to(compute_dtype(x.dtype))
    x1, x2 = _pairs(rot, half, interleaved)
    y1 = (x1 * cos).addcmul_(x2, sin, value=-1.0)
    y2 = (x1 * sin).addcmul_(x2, cos)
    out = torch.stack([y1, y2], dim=-1).flatten(-2) if interleaved else torch.cat([y1, y2], -1)
    out = out.to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)
