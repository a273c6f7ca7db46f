"""Attention backends by name, and ``auto``, which picks the fastest one that supports the call.

Each backend is a function ``(q, k, v, scheme, q_positions, k_positions, *, causal, dropout_p,
training) -> (b, h, i, d)`` with ``q (b, h, i, d)`` and ``k, v (b, h, j, d)`` already rotated (shape
legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim). Every backend must
agree with ``eager`` (the reference), outputs and gradients.

=========  ====================================================================================
name       what it is
=========  ====================================================================================
eager      materialised ``(b, h, i, j)`` logits; the readable reference
sdpa       ``scaled_dot_product_attention``; no mask for plain positions without a bias, else one
           float mask ``(b|1, h|1, i, j)``; every scheme but a value term (Shaw values)
chunked    query × key tiles with a streaming softmax, ``O(block·L)`` memory, every scheme; on CPU,
           for contiguous self-attention, the clipped far field and ALiBi go through the fused
           flash kernel (see :mod:`relpos.attention.chunked`)
flex       FlexAttention ``score_mod`` + ``BlockMask`` (see :mod:`relpos.attention.flex`): CUDA, or
           CPU inference (no backward on CPU); registered when importable
auto       :func:`choose_backend`
=========  ====================================================================================

``auto`` — what it picks (measured on a 2-core CPU, fp32, h=8, d=64; see ``docs/performance.md``):

=================================  ===========================  ==================================
scheme                             plain positions              padded / packed / KV cache
=================================  ===========================  ==================================
NoPE, sinusoidal, learned, RoPE    ``sdpa`` (no mask)           ``sdpa`` (boolean-as-float mask)
ALiBi                              ``chunked`` (flash parts)    ``sdpa`` (float mask)
T5, Shaw keys, Music Transformer   ``chunked`` (band + flash)   ``chunked`` with gradients,
                                                                ``sdpa`` without
Shaw with a value term             ``chunked``                  ``chunked``
=================================  ===========================  ==================================

Short sequences (``i·j <= 512²``, :data:`SMALL`) take ``sdpa`` whenever it supports the scheme:
the ``(i, j)`` tensors are small and its fused kernels beat ``chunked``'s per-tile overhead. The
region path (a relative term over plain positions on CPU, no dropout) overtakes ``sdpa`` sooner,
from ``i·j > 128·256`` (:data:`SMALL_RELATIVE`), when the term's table needs a gradient (``sdpa``
then differentiates its float mask with the math kernel) or when the term depends on the query
(the Music Transformer, Shaw's keys: ``sdpa`` builds a ``(b, h, i, j)`` bias); T5 in inference
keeps ``sdpa`` up to 512². Plain positions: self-attention over one contiguous sequence per row
(``Positions.from_length``).
On a device other than CPU, ``chunked`` has no fused parts, so ``auto`` takes ``sdpa`` whenever it
supports the scheme (PyTorch's CUDA kernels differentiate a float mask) and ``chunked`` otherwise.
``auto`` never picks ``flex``: its first call per shape compiles (seconds), so it is opt-in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..positions import Positions
from ..schemes.base import Scheme
from .band import query_independent
from .chunked import chunked_attention, chunked_path
from .eager import eager_attention
from .flex import flex_attention_backend, flex_available
from .sdpa import sdpa_attention, sdpa_supports, validate_attention_inputs

__all__ = ["BACKENDS", "SMALL", "SMALL_RELATIVE", "auto_attention", "choose_backend", "get_backend"]

BackendFn = Callable[..., Tensor]

#: ``i·j`` up to which ``auto`` takes ``sdpa`` for every scheme it supports (512 × 512 tokens).
SMALL = 512 * 512
#: The same bound where the region path runs a learned relative term with gradients, or a
#: query-dependent one: at L=256, B=16 it was already faster than ``sdpa`` (forward+backward: T5
#: 71 against 87 ms, Music Transformer 92 against 135 ms), at L=128 level with it or slower
#: (``docs/performance.md``, round 7).
SMALL_RELATIVE = 128 * 256


def choose_backend(
    scheme: Scheme,
    q: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    *,
    needs_grad: bool,
    dropout_p: float = 0.0,
    training: bool = False,
) -> str:
    """The backend ``auto`` runs for this call (the table in this module's docstring).

    Args:
        needs_grad: whether a backward pass will follow (gradients of q, k, v or the scheme).
    """
    if not sdpa_supports(scheme):
        return "chunked"
    size = len(q_positions) * len(k_positions)
    learned_grad = needs_grad and any(p.requires_grad for p in scheme.parameters())
    if SMALL_RELATIVE < size <= SMALL:
        # The path chunked would take for this very call (dropout in training rules out the
        # region path, and then sdpa wins at this size).
        path = chunked_path(
            scheme, q, q_positions, k_positions, dropout_p=dropout_p, training=training
        )
        if path == "region" and (learned_grad or not query_independent(scheme, q)):
            return "chunked"  # sdpa: the math kernel, or a (b, h, i, j) bias per call
    if size <= SMALL:
        return "sdpa"  # short: (i, j) tensors are small and the fused kernels' overhead wins
    path = chunked_path(scheme, q, q_positions, k_positions)
    if path == "fused":  # no bias, plain positions: the stock kernel with no mask
        return "sdpa"
    if path in ("alibi", "region"):
        return "chunked"
    if q.device.type != "cpu":
        return "sdpa"
    if "score_bias" in scheme.hooks and learned_grad:
        return "chunked"  # sdpa would differentiate the mask with the math kernel
    return "sdpa"


def _needs_grad(scheme: Scheme, *tensors: Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in tensors) or any(
        p.requires_grad for p in scheme.parameters()
    )


def auto_attention(
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
    """Run the backend :func:`choose_backend` picks for this scheme, device, dtype and call.

    Shapes:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)``; returns ``(b, h, i, d)`` in ``q``'s dtype.
    """
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    name = choose_backend(
        scheme,
        q,
        q_positions,
        k_positions,
        needs_grad=_needs_grad(scheme, q, k, v),
        dropout_p=dropout_p,
        training=training,
    )
    return BACKENDS[name](
        q,
        k,
        v,
        scheme,
        q_positions,
        k_positions,
        causal=causal,
        dropout_p=dropout_p,
        training=training,
    )


BACKENDS: dict[str, BackendFn] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "chunked": chunked_attention,
    "auto": auto_attention,
}
if flex_available():
    BACKENDS["flex"] = flex_attention_backend


def get_backend(name: str) -> BackendFn:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]
