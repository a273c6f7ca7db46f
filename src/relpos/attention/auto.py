"""``auto``: per call, the fastest backend that supports the scheme, positions, device and whether
gradients are needed.

What it picks (measured on a 2-core CPU, fp32, h=8, d=64; ``docs/performance.md``):

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
(``sdpa`` builds a ``(b, h, i, j)`` bias). Plain positions: self-attention over one contiguous
sequence per row (``Positions.from_length``). On a device other than CPU, ``chunked`` has no
fused parts, so ``auto`` takes ``sdpa`` whenever it supports the scheme and ``chunked`` otherwise.
``auto`` never picks ``flex``: its first call per shape compiles (seconds), so it is opt-in.
"""

from __future__ import annotations

from torch import Tensor

from ..positions import Positions
from ..schemes.base import RelativeScheme, Scheme
from .chunked import chunked_attention, chunked_path
from .contract import AttentionBackend, needs_grad, validate_attention_inputs
from .sdpa import sdpa_attention, sdpa_supports

__all__ = ["SMALL", "SMALL_RELATIVE", "auto_attention", "choose_backend"]

#: ``i·j`` up to which ``auto`` takes ``sdpa`` for every scheme it supports (512 × 512 tokens).
SMALL = 512 * 512
#: The same bound where the region path runs a learned relative term with gradients, or a
#: query-dependent one (``docs/performance.md``, "What auto picks").
SMALL_RELATIVE = 128 * 256

_PICKS: dict[str, AttentionBackend] = {"sdpa": sdpa_attention, "chunked": chunked_attention}


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
        query_dependent = isinstance(scheme, RelativeScheme) and not scheme.query_independent
        if path == "region" and (learned_grad or query_dependent):
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
    """Run the backend :func:`choose_backend` picks (:class:`.contract.AttentionBackend`)."""
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    name = choose_backend(
        scheme,
        q,
        q_positions,
        k_positions,
        needs_grad=needs_grad(scheme, q, k, v),
        dropout_p=dropout_p,
        training=training,
    )
    return _PICKS[name](
        q, k, v, scheme, q_positions, k_positions,
        causal=causal, dropout_p=dropout_p, training=training,
    )  # fmt: skip
