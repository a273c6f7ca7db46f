"""The ``chunked`` backend: attention for every scheme without an ``(i, j)`` tensor.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim.

:func:`chunked_path` picks one of five paths per call:

==========  ==============================================================================
path        when, and how
==========  ==============================================================================
``tiles``   any positions, any scheme, dropout: query × key tiles with a streaming softmax
            (:mod:`.tiles`, planned by :mod:`.plan`); the only path for a key bias
``region``  CPU, self-attention over contiguous positions, a :class:`RelativeScheme` whose
            band the engines compute: far parts by the fused kernel, the band by
            :mod:`.narrow` or :mod:`.band` (:mod:`.region`)
``alibi``   the same geometry with a :class:`LinearBiasScheme` or a linear
            :class:`DistanceBiasScheme` (learned ALiBi): left / diagonal / right parts by the
            fused kernel (:mod:`.alibi`)
``decay``   the same geometry with a :class:`DecayBiasScheme` (the forget gate): left /
            diagonal parts by the fused kernel, differences of ``log_decay`` in float64
            (:mod:`.decay`)
``fused``   the same geometry with no bias and no value term: the stock kernel
==========  ==============================================================================

A ``key_bias`` (a term read from the keys' content) runs only in the relative form
(:meth:`RelativeScheme.relative_key_logits`, gathered per tile): :func:`chunked_supports`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...functional.dtypes import outside_autocast
from ...positions import Positions
from ...schemes.base import (
    DecayBiasScheme,
    DistanceBiasScheme,
    LinearBiasScheme,
    RelativeScheme,
    Scheme,
)
from ..contract import (
    empty_attention,
    is_empty,
    propagate_nonfinite,
    validate_attention_inputs,
    zero_padding_keys,
)
from .alibi import AlibiAttention
from .decay import DecayAttention
from .job import Job
from .plan import plan_tiles
from .region import region_attention, region_supports
from .tiles import DEFAULT_BLOCK, TiledAttention

__all__ = ["chunked_attention", "chunked_path", "chunked_supports"]


def chunked_supports(scheme: Scheme) -> bool:
    """Whether :func:`chunked_attention` runs ``scheme``: every scheme but one whose ``key_bias``
    has no relative form (it may depend on all keys at once, which a tile does not see)."""
    return "key_bias" not in scheme.hooks or isinstance(scheme, RelativeScheme)


def chunked_path(
    scheme: Scheme,
    q: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
) -> str:
    """Which path :func:`chunked_attention` takes: ``"fused"`` (no bias: the stock kernel),
    ``"alibi"``, ``"decay"``, ``"region"`` or ``"tiles"`` (the general path)."""
    plain = q_positions is k_positions and q_positions.contiguous
    if not plain or (dropout_p > 0 and training) or q.device.type != "cpu":
        return "tiles"
    hooks = scheme.hooks
    if "key_bias" in hooks:
        return "tiles"
    if not hooks & {"score_bias", "value_term"}:
        return "fused"
    linear = isinstance(scheme, LinearBiasScheme) or (
        isinstance(scheme, DistanceBiasScheme) and scheme.linear
    )
    if linear and "value_term" not in hooks:
        return "alibi"
    if isinstance(scheme, DecayBiasScheme) and "value_term" not in hooks:
        return "decay"
    if isinstance(scheme, RelativeScheme) and region_supports(scheme):
        return "region"
    return "tiles"


@outside_autocast
def chunked_attention(
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
    q_block: int | None = None,
    k_block: int | None = None,
    path: str | None = None,
) -> Tensor:
    """Memory-lean attention for every scheme: ``O(bi·bj)`` per tile instead of ``O(i·j)``.

    Same contract and results as :func:`~relpos.attention.eager.eager_attention` (float32 math,
    padding queries get 0 forward and backward, gradients reach ``q``, ``k``, ``v`` and the
    scheme's parameters).

    Args:
        q_block, k_block: tile sizes of the general path (default :data:`DEFAULT_BLOCK`).
        path: force ``"tiles"`` (the general path) or leave None to pick with
            :func:`chunked_path`.

    Shapes:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)`` (already rotated); returns ``(b, h, i, d)`` in
        ``q``'s dtype.
    """
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    if not chunked_supports(scheme):
        raise ValueError(
            f"the chunked backend cannot add the key bias of scheme {type(scheme).__name__} "
            "(it has no relative form, RelativeScheme.relative_key_logits); use backend='sdpa' "
            "or 'auto'"
        )
    k, v = zero_padding_keys(k, v, k_positions)
    q_block = DEFAULT_BLOCK[0] if q_block is None else q_block
    k_block = DEFAULT_BLOCK[1] if k_block is None else k_block
    for name, value in (("q_block", q_block), ("k_block", k_block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if path not in (None, "tiles"):
        raise ValueError(f"path must be None or 'tiles', got {path!r}")
    chosen = path or chunked_path(
        scheme, q, q_positions, k_positions, dropout_p=dropout_p, training=training
    )
    if is_empty(q, k):
        return empty_attention(q, k, v)
    blocks = (q_block, k_block)
    out = _run_path(
        chosen, q, k, v, scheme, q_positions, k_positions, causal, dropout_p, training, blocks
    )
    return propagate_nonfinite(out, q, k, scheme, q_positions, k_positions, causal)


def _run_path(
    chosen: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: Scheme,
    q_positions: Positions,
    k_positions: Positions,
    causal: bool,
    dropout_p: float,
    training: bool,
    blocks: tuple[int, int],
) -> Tensor:
    """Run the ``chosen`` path of :func:`chunked_path`: ``(b, h, i, d)`` in ``q``'s dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    params = [p for p in scheme.parameters() if p.requires_grad]
    if chosen == "fused":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    q_positions, k_positions, decays = _decay_leaves(q_positions, k_positions)
    job = Job(scheme, q_positions, k_positions, causal, scale, params=params + list(decays))
    if chosen == "alibi":
        return AlibiAttention.apply(q, k, v, job, *params)
    if chosen == "decay":
        return DecayAttention.apply(q, k, v, job, *decays.values())
    if chosen == "region":
        return region_attention(q, k, v, job)
    job.plan = plan_tiles(
        q_positions, k_positions, causal=causal, q_block=blocks[0], k_block=blocks[1]
    )
    job.dropout_p = dropout_p if training else 0.0
    return TiledAttention.apply(q, k, v, job, *params, *decays.values())


def _decay_leaves(
    q_positions: Positions, k_positions: Positions
) -> tuple[Positions, Positions, dict[Tensor, Tensor]]:
    """The positions with every ``log_decay`` that needs a gradient swapped for a detached leaf,
    and ``{leaf: original}``.

    The tiled path's custom backward pushes each tile's bias gradient into the leaves (as into
    the scheme's parameters) and returns it for the originals, whose graph leads to the gates and
    the layer input. Queries and keys that share one tensor (self-attention) share one leaf."""
    decays: dict[Tensor, Tensor] = {}
    leaves: dict[int, Tensor] = {}

    def swap(p: Positions) -> Positions:
        t = p.log_decay
        if t is None or not (torch.is_grad_enabled() and t.requires_grad):
            return p
        if id(t) not in leaves:
            leaf = t.detach().requires_grad_(True)
            leaves[id(t)], decays[leaf] = leaf, t
        return dataclasses.replace(p, log_decay=leaves[id(t)])

    qp = swap(q_positions)
    kp = qp if k_positions is q_positions else swap(k_positions)
    return qp, kp, decays
