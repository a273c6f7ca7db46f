"""Attention backends by name. Each is an :class:`~.contract.AttentionBackend`: the same
signature, the same numbers as ``eager`` (outputs and gradients).

=========  ====================================================================================
name       what it is
=========  ====================================================================================
eager      materialised ``(b, h, i, j)`` logits; the readable reference (:mod:`.eager`)
sdpa       ``scaled_dot_product_attention``; no mask for plain positions without a bias, else one
           float mask ``(b|1, h|1, i, j)``; every scheme but a value term (:mod:`.sdpa`)
chunked    tiles with a streaming softmax, ``O(block·L)`` memory, every scheme; fused-kernel
           paths on CPU for contiguous self-attention (:mod:`.chunked`)
flex       FlexAttention ``score_mod`` + ``BlockMask``; registered when importable (:mod:`.flex`)
fused      one Triton kernel for the relative schemes, Shaw's value term included; registered
           where Triton and a CUDA device are (or Triton's interpreter is on) (:mod:`.fused`)
auto       the fastest of ``sdpa`` and ``chunked`` per call (:mod:`.auto`)
=========  ====================================================================================
"""

from __future__ import annotations

import torch

from ..kernels import interpreted
from .auto import auto_attention
from .chunked import chunked_attention
from .contract import AttentionBackend
from .eager import eager_attention
from .flex import flex_attention_backend, flex_available
from .fused import fused_attention, fused_available
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "get_backend"]

BACKENDS: dict[str, AttentionBackend] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "chunked": chunked_attention,
    "auto": auto_attention,
}
if flex_available():
    BACKENDS["flex"] = flex_attention_backend
if fused_available() and (torch.cuda.is_available() or interpreted()):
    BACKENDS["fused"] = fused_attention


def get_backend(name: str) -> AttentionBackend:
    """The backend called ``name``; a ``ValueError`` listing the names otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]
