"""The backend contract: one signature for every attention backend, and its input checks.

A backend computes ``softmax(q·kᵀ/√d + score_bias + key_bias + mask)·v + value_term`` for a scheme
and the queries' and keys' :class:`~relpos.Positions`, the same numbers as ``eager`` (the
reference). The scheme's hooks (:mod:`relpos.schemes.base`) give the terms: ``score_bias(q, qp,
kp)`` and ``key_bias(q, k, qp, kp)`` (a term that reads the keys' content: DeBERTa's
position-to-content, CoPE's gates) are float32 ``(b|1, h|1, i, j)`` added to the scaled logits,
``value_term(p, qp, kp)`` float32 ``(b, h, i, d)`` added to the output. A backend that cannot run
a scheme's terms says so up front (``sdpa_supports``, ``chunked_supports``, ``flex_supports``):
``chunked`` and ``flex`` run a ``key_bias`` only in its relative form
(``RelativeScheme.relative_key_logits``), ``sdpa`` and ``flex`` no value term; ``auto`` picks
among the backends that can.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
from torch import Tensor

from ..positions import (
    PAD_SEGMENT,
    Positions,
    dense_segment_ids,
    distance_range,
    promised_distance_range,
)
from ..schemes.base import RelativeScheme, Scheme
from .memo import BoundedCache

__all__ = [
    "AttentionBackend",
    "empty_attention",
    "is_contiguous_self",
    "is_empty",
    "needs_grad",
    "pair_segment_ids",
    "propagate_nonfinite",
    "relative_rows",
    "rows_with_keys",
    "scheme_key",
    "validate_attention_inputs",
    "zero_padding_keys",
]


class AttentionBackend(Protocol):
    """What ``eager``, ``sdpa``, ``chunked``, ``flex`` and ``auto`` are.

    Args:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)``, already rotated, one floating dtype.
        scheme: the built scheme; its hooks supply the bias and value terms.
        q_positions, k_positions: ``(b|1, i)`` and ``(b|1, j)`` positions.
        causal: a query sees keys at positions ``<=`` its own only.
        dropout_p, training: dropout on the probabilities, in training only.

    Returns:
        ``(b, h, i, d)`` in ``q``'s dtype; a query with no key to attend to gets exactly 0.
    """

    def __call__(
        self,
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
    ) -> Tensor: ...


def zero_padding_keys(k: Tensor, v: Tensor, k_positions: Positions) -> tuple[Tensor, Tensor]:
    """``k`` and ``v`` with padding keys set to 0, so that no value there — not even NaN or inf,
    as ``0·NaN`` — can reach a real query. Plain positions have no padding: returned as they are.

    Shapes: k, v ``(b, h, j, d)``; k_positions ``(b|1, j)``.
    """
    if k_positions.contiguous:
        return k, v
    keep = k_positions.valid[:, None, :, None]
    return torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)


def is_contiguous_self(q_positions: Positions, k_positions: Positions) -> bool:
    """Self-attention over one contiguous sequence per row: ``p_j - p_i = j - i``, every pair
    allowed but the causal future, every query with a key (kernels then read distances from
    indices)."""
    return q_positions is k_positions and q_positions.contiguous


def relative_rows(
    scheme: RelativeScheme,
    q_positions: Positions,
    k_positions: Positions,
    device,
    *,
    clipped: bool = False,
) -> tuple[Tensor, int]:
    """``(lut, offset)``: the relative row of distance ``δ = p_j - p_i`` is ``lut[δ + offset]``,
    for every distance between real tokens of these queries and keys (callers clamp
    ``δ + offset`` to the table: a pair with padding may fall outside, and is masked). The range
    is :func:`~relpos.positions.distance_range`'s (self-attention's from the positions' promise,
    no device sync; one sync otherwise).

    With ``clipped``, for a caller that clamps ``δ + offset`` to the table's ends: the table
    stops at the scheme's :attr:`~relpos.schemes.RelativeScheme.distance_clip` (rows past it
    repeat), so it holds at most ``hi - lo + 1`` entries whatever the length; where the
    positions promise no range (a KV cache's queries and keys) it is the clip's whole, with no
    device sync."""
    clip = scheme.distance_clip if clipped else None
    promised = promised_distance_range(q_positions, k_positions)
    if clip is not None and promised is None:  # every row: no value read
        lo, hi = clip.lo, clip.hi
    else:
        lo, hi = distance_range(q_positions, k_positions)
    if clip is not None:
        lo, hi = (min(max(x, clip.lo), clip.hi) for x in (lo, hi))
    return _rows_by_distance(scheme, lo, hi, torch.device(device)), -lo


#: The schemes' distance-to-row tables, by what builds a scheme (its class, config and geometry)
#: and the range: values of the geometry alone, built once instead of on every call (a bucket
#: table is a dozen ops, each a kernel launch on a GPU).
_ROWS = BoundedCache(64 * 2**20)


def scheme_key(scheme: Scheme) -> tuple | None:
    """What builds ``scheme`` (its class, config, ``d_model``, ``num_heads``, ``causal``): the key
    under which a backend keeps what is a function of it alone, never of the weights (a
    distance-to-row table), or None where the config cannot be hashed (then nothing is kept)."""
    key = (type(scheme), scheme.config, scheme.d_model, scheme.num_heads, scheme.causal)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _rows_by_distance(scheme: RelativeScheme, lo: int, hi: int, device: torch.device) -> Tensor:
    """:meth:`~relpos.schemes.RelativeScheme.rows_by_distance`, kept between calls."""
    key = scheme_key(scheme)
    build = lambda: scheme.rows_by_distance(lo, hi, device)  # noqa: E731
    return build() if key is None else _ROWS.get_or_build((*key, lo, hi, device), build)


def is_empty(q: Tensor, k: Tensor) -> bool:
    """Whether there are no rows, no queries or no keys: nothing for a kernel to do (and batch-1
    positions need not broadcast over zero rows)."""
    return q.shape[0] == 0 or q.shape[-2] == 0 or k.shape[-2] == 0


def empty_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The result when :func:`is_empty`: ``(0, h, i, d)``, ``(b, h, 0, d)``, or zeros for queries
    with no keys, still connected to the graph."""
    return (q @ k.transpose(-1, -2) @ v).to(q.dtype)


def rows_with_keys(q_positions: Positions, k_positions: Positions, causal: bool) -> Tensor:
    """``(b, i)`` bool: queries with at least one key to attend to, in ``O(i + j)`` memory.

    A query needs a real key of its own segment (at a position ``<=`` its own when causal): the
    smallest key position of each segment decides. ``b`` is the larger of the two batches. Kept
    while the positions live (:meth:`~relpos.Positions.derived`: once a step for a model).
    """
    build = functools.partial(_rows_with_keys, q_positions, k_positions, causal)
    return q_positions.derived(k_positions, ("rows with keys", causal), build)


def _rows_with_keys(q_positions: Positions, k_positions: Positions, causal: bool) -> Tensor:
    b = max(q_positions.batch, k_positions.batch)
    qp, kp = q_positions.expand(b), k_positions.expand(b)
    if len(qp) == 0 or len(kp) == 0:
        return torch.zeros(b, len(qp), dtype=torch.bool, device=qp.device)
    i = len(qp)
    dense = pair_segment_ids(q_positions, k_positions)
    q_seg, k_seg = dense[:, :i], dense[:, i:]
    big = torch.iinfo(torch.int64).max
    first = torch.full((b, dense.shape[1]), big, dtype=torch.long, device=kp.pos.device)
    real_pos = kp.pos.masked_fill(kp.seg == PAD_SEGMENT, big)  # padding keys do not count
    first.scatter_reduce_(1, k_seg, real_pos, reduce="amin")
    lowest = torch.gather(first, 1, q_seg)  # (b, i)
    ok = (qp.seg != PAD_SEGMENT) & (lowest != big)
    return ok & (lowest <= qp.pos) if causal else ok


def pair_segment_ids(q_positions: Positions, k_positions: Positions) -> Tensor:
    """``(b, i + j)`` int64: the segment ids of the queries, then of the keys, renumbered per row
    over both together (:func:`~relpos.positions.dense_segment_ids`: ``i + j`` slots, whatever
    the ids' values; padding's -1 renumbered too), ``b`` the larger batch. Kept while the
    positions live (:meth:`~relpos.Positions.derived`), so that the backends and the non-finite
    check share one renumbering a step."""

    def build() -> Tensor:
        b = max(q_positions.batch, k_positions.batch)
        seg = (q_positions.expand(b).seg, k_positions.expand(b).seg)
        return dense_segment_ids(torch.cat(seg, 1))

    return q_positions.derived(k_positions, "pair segment ids", build)


def _nonfinite_vectors(x: Tensor) -> Tensor:
    """``(...)`` bool: whether each vector along the last dim of ``x`` holds a NaN or an infinity.
    Its largest magnitude is then not below infinity (NaN compares false): one reduction, where
    ``~isfinite(x).all(-1)`` takes five passes over ``x`` (each a kernel launch on a GPU)."""
    if x.shape[-1] == 0:  # no value: none bad (the inf norm has no identity to start from)
        return x.new_zeros(x.shape[:-1], dtype=torch.bool)
    return ~(torch.linalg.vector_norm(x, ord=math.inf, dim=-1) < math.inf)


def nonfinite_rows(
    q: Tensor,
    k: Tensor,
    scheme: Scheme,
    q_positions: Positions,
    k_positions: Positions,
    causal: bool,
) -> Tensor:
    """``(b, h, i)`` bool: real queries whose logits are not all finite because of their inputs or
    weights, in ``O(b·h·(i + j))`` memory (no ``(i, j)`` tensor).

    A query with a key to attend to is such a row when its own vector holds a NaN or an infinity,
    when a key it may attend to (same segment, real, at a position ``<=`` its own when causal)
    holds one, or when a parameter of the scheme (its tables, slopes, MLP) holds one. ``k`` is the
    keys as the kernel sees them (padding keys zeroed).
    """
    b, h, i, _ = q.shape
    bad_q, bad_k = _nonfinite_vectors(q), _nonfinite_vectors(k)  # (b, h, i), (b, h, j)
    params = [
        torch.linalg.vector_norm(p.detach(), ord=math.inf) for p in scheme.parameters() if p.numel()
    ]
    if params:  # a 0-d tensor, no host sync: the largest magnitude of any parameter
        bad_q = bad_q | _nonfinite_vectors(torch.stack(params)).to(bad_q.device)
    if is_contiguous_self(q_positions, k_positions):  # every query has a key; p_j - p_i = j - i
        reach = bad_k.cumsum(-1) > 0 if causal else bad_k.any(-1, keepdim=True).expand(b, h, i)
        return bad_q | reach
    nb = max(q_positions.batch, k_positions.batch)
    qp, kp = q_positions.expand(nb), k_positions.expand(nb)
    # Per row, head and segment: the smallest position of a non-finite real key (big: none).
    dense = pair_segment_ids(q_positions, k_positions)
    q_seg, k_seg = dense[:, None, :i].expand(b, h, i), dense[:, None, i:].expand_as(bad_k)
    big = torch.iinfo(torch.int64).max
    k_pos = kp.pos[:, None].expand_as(bad_k)
    bad_pos = k_pos.masked_fill(~bad_k | (kp.seg == PAD_SEGMENT)[:, None], big)
    first = torch.full((b, h, dense.shape[1]), big, dtype=torch.long, device=q.device)
    first.scatter_reduce_(-1, k_seg, bad_pos, reduce="amin")
    lowest = torch.gather(first, -1, q_seg)  # (b, h, i)
    real = (qp.seg != PAD_SEGMENT)[:, None]
    reach = real & (lowest <= qp.pos[:, None] if causal else lowest != big)
    return reach | (bad_q & rows_with_keys(q_positions, k_positions, causal)[:, None])


def propagate_nonfinite(
    out: Tensor,
    q: Tensor,
    k: Tensor,
    scheme: Scheme,
    q_positions: Positions,
    k_positions: Positions,
    causal: bool,
) -> Tensor:
    """``out`` with NaN in every row of :func:`nonfinite_rows`: the one rule of every backend.

    ``eager`` turns a NaN logit into a NaN row by itself, but a streaming kernel takes a row whose
    logits are all NaN (or all ``-inf``) for a row with no key and outputs 0, which would hide
    weights gone bad. So every backend, ``eager`` included, ends with this step: a real query
    with a key outputs NaN when its vector, a key it may attend to or a parameter of the scheme
    holds a NaN or an infinity (also where a softmax alone would have skipped a ``-inf`` logit,
    or where a bad table row is not read). Queries with no key still output 0, and padding never
    reaches a real query.

    Shapes: out, q ``(b, h, i, d)``; k ``(b, h, j, d)``.
    """
    params = list(scheme.parameters())
    if out.device.type == "cpu" and not torch.compiler.is_compiling():
        # The common case in one cheap pass per tensor (no host sync cost on the CPU): a sum is
        # finite when every element is (an overflow only sends it to the exact check below).
        sums = [t.sum(dtype=torch.promote_types(t.dtype, torch.float32)) for t in (q, k, *params)]
        if all(bool(torch.isfinite(t)) for t in sums):
            return out
    bad = nonfinite_rows(q, k, scheme, q_positions, k_positions, causal).unsqueeze(-1)
    if out.requires_grad:
        return torch.where(bad, torch.nan, out)
    return out.masked_fill_(bad, torch.nan)  # the kernel's own result: no copy


def needs_grad(scheme: Scheme, *tensors: Tensor) -> bool:
    """Whether a backward pass can follow: grad mode on and an input or a parameter needs it."""
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in tensors) or any(
        p.requires_grad for p in scheme.parameters()
    )


def validate_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor, q_positions: Positions, k_positions: Positions
) -> None:
    """Raise a clear ``ValueError``/``TypeError`` unless the backend contract's shapes hold.

    ``q (b, h, i, d)``, ``k (b, h, j, d)``, ``v (b, h, j, d)``, all of one floating dtype;
    ``q_positions`` of shape ``(b|1, i)``, ``k_positions`` of shape ``(b|1, j)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must have shape (b, h, n, d), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (b, h, j, d), got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q (b, h, i, d) and k (b, h, j, d) must agree on b, h and d, got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, p, n in (
        ("q_positions", q_positions, q.shape[-2]),
        ("k_positions", k_positions, k.shape[-2]),
    ):
        if not isinstance(p, Positions):
            raise TypeError(f"{name} must be a Positions, got {type(p).__name__}")
        if len(p) != n or p.batch not in (1, q.shape[0]):
            raise ValueError(
                f"{name} have shape (b, n) = {tuple(p.pos.shape)}; expected ({q.shape[0]}, {n}) "
                f"or (1, {n}) for tensors of shape {tuple(q.shape)}, {tuple(k.shape)}"
            )
