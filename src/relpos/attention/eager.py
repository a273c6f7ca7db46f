"""The eager backend: materialised logits; the reference every other backend is tested against."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..functional.dropout import dropout
from ..functional.dtypes import compute_dtype, outside_autocast
from ..positions import Positions
from ..schemes.base import Scheme
from .contract import (
    empty_attention,
    is_empty,
    propagate_nonfinite,
    validate_attention_inputs,
    zero_padding_keys,
)

__all__ = ["eager_attention"]


@outside_autocast
def eager_attention(
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
    """Attention with a scheme's score bias and value term, computed in at least float32.

    ``logits = q·kᵀ/√d + score_bias + key_bias``; pairs that may not attend (other segment,
    padding, future keys when causal) are masked; ``out = softmax(logits)·v + value_term``. A
    query with no key to attend to (padding) gets zeros — not NaN — forward and backward; a real
    query whose vector, or a key it may attend to, is not finite gets NaN
    (:func:`~relpos.attention.contract.propagate_nonfinite`, the rule of every backend).

    Shapes:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)`` (already rotated); returns ``(b, h, i, d)`` in
        ``q``'s dtype.
    """
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    k, v = zero_padding_keys(k, v, k_positions)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    dtype = compute_dtype(q.dtype)
    logits = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    bias = scheme.score_bias(q, q_positions, k_positions)
    if bias is not None:
        logits = logits + bias.to(dtype)
    if "key_bias" in scheme.hooks:
        key_bias = scheme.key_bias(q, k, q_positions, k_positions)
        if key_bias is not None:
            logits = logits + key_bias.to(dtype)
    allowed = q_positions.allowed(k_positions, causal=causal).unsqueeze(1)  # (b, 1, i, j)
    # A finite fill (not -inf) keeps a fully masked row finite: its softmax is uniform, then
    # zeroed by the mask, and the gradient through it is zero rather than NaN.
    logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1) * allowed
    if dropout_p > 0.0 and training:
        probs = dropout(probs, dropout_p)
    out = probs @ v.to(dtype)
    term = scheme.value_term(probs, q_positions, k_positions)
    if term is not None:
        out = out + term.to(dtype)
    return propagate_nonfinite(out, q, k, scheme, q_positions, k_positions, causal).to(q.dtype)
