"""The ``sdpa`` backend: :func:`torch.nn.functional.scaled_dot_product_attention`.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim.

* Schemes with no score bias and no value term (NoPE, absolute, RoPE) over plain positions
  (self-attention over one contiguous sequence per row, or no padding and one segment everywhere)
  run the stock kernel with **no mask tensor at all** (``is_causal=True`` where needed), so
  PyTorch picks its flash kernel.
* Everything else passes one float additive mask ``(b|1, h|1, i, j)``: the scheme's float32 score
  bias (plus its key bias, DeBERTa's p2c) where a pair may attend and ``finfo.min`` where it may
  not. The mask is built once per call,
  with batch dimension 1 whenever the positions and the bias broadcast over the batch.
* Bias schemes run in float32 even for float16/bfloat16 inputs (the bias of distant pairs, e.g.
  ALiBi's ``-slope·|Δ|``, does not survive a half-precision mask); the output is cast back.
* A query that may attend to no key (padding) gets exactly 0, forward and backward: the masked
  fill is finite (so no row is all ``-inf``, which makes the math kernel return NaN) and those rows
  are then zeroed with ``torch.where``.
* A real query whose vector, or a key it may attend to, is not finite outputs NaN, as on every
  backend (:func:`~relpos.attention.contract.propagate_nonfinite`): the stock kernel takes a row
  of NaN logits for a row with no key and would output 0.
* Shaw et al.'s value term (``value_term`` hook) cannot be added by the stock kernel, which does not
  return the attention probabilities: ``sdpa`` does not support it (:func:`sdpa_supports`) and
  ``auto`` picks ``chunked`` for it.
* A learned bias (T5, Shaw keys, Music Transformer) gets its gradient through the mask; PyTorch's
  fused CPU kernels do not differentiate the mask, so training such a scheme with ``sdpa`` falls
  back to PyTorch's math kernel (correct, but it materialises the ``(b, h, i, j)`` probabilities):
  ``auto`` prefers ``chunked`` there.
* Dropout in training on the CPU: PyTorch's math kernel draws its mask with a float ``bernoulli_``
  that costs more than its matmuls, so the backend computes the same function itself with
  :func:`~relpos.functional.dropout.drop_mask`'s integer mask (equal to ``eager`` given the seed).

Reference: Dao et al. (2022), "FlashAttention"; PyTorch's ``scaled_dot_product_attention`` docs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional.dropout import drop_mask
from ..functional.dtypes import half_products, outside_autocast
from ..positions import Positions
from ..schemes.base import LOGIT_HOOKS, Scheme
from .contract import (
    empty_attention,
    is_empty,
    propagate_nonfinite,
    validate_attention_inputs,
    zero_padding_keys,
)

__all__ = ["allowed_mask", "is_plain", "sdpa_attention", "sdpa_supports"]

_HALF = (torch.float16, torch.bfloat16)


def is_plain(q_positions: Positions, k_positions: Positions, *, causal: bool) -> bool:
    """Whether attention needs no mask at all beyond (top-left aligned) causality.

    True for self-attention over contiguous positions (``q_positions is k_positions`` and
    ``contiguous``), and for bidirectional attention where every token is real and in segment 0.
    """
    if q_positions is k_positions and q_positions.contiguous:
        return True
    if causal:
        return False
    return bool((q_positions.seg == 0).all()) and bool((k_positions.seg == 0).all())


def allowed_mask(q_positions: Positions, k_positions: Positions, *, causal: bool) -> Tensor:
    """``(b|1, 1, i, j)`` bool: which pairs may attend (batch 1 when both positions broadcast)."""
    return q_positions.allowed(k_positions, causal=causal).unsqueeze(1)


def sdpa_supports(
    scheme: Scheme, *, device: torch.device | None = None, needs_grad: bool = False
) -> bool:
    """Whether :func:`sdpa_attention` can run ``scheme`` (every scheme but a value term)."""
    del device, needs_grad  # any device, with or without gradients
    return "value_term" not in scheme.hooks


def _logit_terms(
    scheme: Scheme, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
) -> Tensor | None:
    """The scheme's ``score_bias`` plus its ``key_bias``, float32 ``(b|1, h|1, i, j)``, or None."""
    bias = scheme.score_bias(q, q_positions, k_positions) if "score_bias" in scheme.hooks else None
    if "key_bias" in scheme.hooks:
        key_bias = scheme.key_bias(q, k, q_positions, k_positions)
        if key_bias is not None:
            bias = key_bias if bias is None else bias + key_bias
    return bias


def _math_attention_with_dropout(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, p: float) -> Tensor:
    """``dropout(softmax(q·kᵀ/√d + mask))·v``: the CPU math kernel's computation, whose float
    ``bernoulli_`` dropout mask costs more than its matmuls; :func:`drop_mask`'s is cheap.

    The two products run in ``q``'s and ``v``'s dtype; the scores join the mask's dtype before
    the scale, and the softmax is float32 (a float32 bias keeps its precision)."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, mask.dtype))
    scores.mul_(1.0 / math.sqrt(q.shape[-1]))
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32)  # float32 for half inputs
    drop, scale = drop_mask(probs.shape, p, probs.device)
    return torch.matmul(torch.where(drop, 0.0, probs).to(v.dtype), v).mul_(scale)


@outside_autocast
def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: Scheme,
    q_positions: Positions,
    k_positions: Positions,
    *,
    causal: bool,
    dropout_p: float = 0.0,
    training: bool = False,
) -> Tensor:
    """Attention through :func:`~torch.nn.functional.scaled_dot_product_attention`.

    Same contract and results as :func:`~relpos.attention.eager.eager_attention`:
    ``softmax(q·kᵀ/√d + score_bias + mask)·v``; padding queries get 0.

    Shapes:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)`` (already rotated); returns ``(b, h, i, d)`` in
        ``q``'s dtype.

    Raises:
        ValueError: for a scheme with a value term (Shaw values), or bad shapes.
    """
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    k, v = zero_padding_keys(k, v, k_positions)
    if not sdpa_supports(scheme):
        raise ValueError(
            f"the sdpa backend cannot add the value term of scheme {type(scheme).__name__} "
            "(it needs the attention probabilities); use backend='chunked' or 'auto'"
        )
    if is_empty(q, k):
        return empty_attention(q, k, v)
    p = dropout_p if training else 0.0
    has_bias = bool(scheme.hooks & LOGIT_HOOKS)
    cpu_dropout = p > 0 and q.device.type == "cpu"  # below: the math path, our mask
    if not has_bias and not cpu_dropout and is_plain(q_positions, k_positions, causal=causal):
        # No mask tensor: the fused kernels run unmasked (or with their own causal mask; plain
        # causal positions mean self-attention, so i == j and top-left alignment is right).
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
        return propagate_nonfinite(out, q, k, scheme, q_positions, k_positions, causal)

    dtype = torch.float32 if (has_bias and q.dtype in _HALF) else q.dtype
    allowed = allowed_mask(q_positions, k_positions, causal=causal)  # (b|1, 1, i, j)
    fill = torch.finfo(dtype).min
    bias = _logit_terms(scheme, q, k, q_positions, k_positions) if has_bias else None
    if bias is None:
        mask = torch.zeros(allowed.shape, dtype=dtype, device=q.device).masked_fill_(~allowed, fill)
    else:
        # Finite fill: a fully masked row stays finite (uniform), then is zeroed below.
        mask = bias.to(dtype).masked_fill(~allowed, fill)
    # A CPU that computes bfloat16 natively keeps the products in it with a bias too, as
    # without one (and as autocast does with torch's math kernel; the speed is in
    # docs/training.md). The bias and the softmax stay float32.
    qc, kc, vc = q, k, v
    if not (cpu_dropout and half_products(q) is not None):
        qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    if cpu_dropout:
        out = _math_attention_with_dropout(qc, kc, vc, mask, p)
    else:
        out = F.scaled_dot_product_attention(
            qc, kc, vc, attn_mask=mask, dropout_p=p, scale=1.0 / math.sqrt(q.shape[-1])
        )
    out = torch.where(allowed.any(-1, keepdim=True), out, 0.0)
    return propagate_nonfinite(out, q, k, scheme, q_positions, k_positions, causal).to(q.dtype)
