"""Contextual Position Encoding (Golovneva et al., 2024, "Contextual Position Encoding: Learning
to Count What's Important", §3).

Query ``i`` counts the keys it may attend to with gates ``g_it = σ(q_i·k_t/√d)``; key ``j`` sits
at the contextual position ``p_ij = Σ_{t=j}^{i} g_it`` (the gates of the keys from ``j`` up to the
query), clamped to ``npos_max - 1``, and adds the logit term ``q_i·e[p_ij]`` with ``e`` a learned
table read between its integer rows: ``(1 - w)·z_i[⌊p⌋] + w·z_i[⌈p⌉]``, ``w = p - ⌊p⌋``,
``z_i[n] = q_i·e[n]``. So ``O(i·npos)`` dot products with the table, never ``(i, j, d)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .dtypes import compute_dtype

__all__ = ["cope_logits", "cope_positions"]


def cope_positions(q: Tensor, k: Tensor, allowed: Tensor, npos_max: int) -> Tensor:
    """Contextual positions ``p_ij = min(Σ_{t=j}^{i} σ(q_i·k_t/√d), npos_max - 1)``.

    The sum runs over the keys query ``i`` may attend to (``allowed``; others count 0), from key
    ``j`` to the end of the key axis: a reverse cumulative sum of the masked gates. That is the
    paper's ``Σ_{t=j}^{i}`` when, within each segment, keys lie along the key axis in increasing
    position order (true of every :class:`~relpos.Positions` constructor, of ``continued`` and of
    a :class:`~relpos.KVCache`, which appends) and ``allowed`` is causal (``k_pos <= q_pos``): a
    query's allowed keys are then exactly its segment's keys up to its own position, in order.
    Values at pairs that are not allowed are finite and meaningless (mask them).

    Args:
        q: ``(b, h, i, d)``; k: ``(b, h, j, d)``.
        allowed: ``(b|1, i, j)`` bool, which pairs may attend (causal).
        npos_max: rows of the position table; positions are clamped to ``npos_max - 1``.

    Returns:
        ``(b, h, i, j)`` in ``q``'s compute dtype (at least float32), in ``[0, npos_max - 1]``.
    """
    dtype = compute_dtype(q.dtype)
    gates = torch.sigmoid(q.to(dtype) @ k.to(dtype).transpose(-1, -2) / math.sqrt(q.shape[-1]))
    gates = torch.where(allowed.unsqueeze(1), gates, 0.0)  # where, not *: NaN at masked pairs
    positions = gates.flip(-1).cumsum(-1).flip(-1)  # Σ_{t >= j}; no cancellation, never < 0
    return positions.clamp(max=npos_max - 1)


def cope_logits(q: Tensor, k: Tensor, allowed: Tensor, table: Tensor) -> Tensor:
    """CoPE's logit term ``q_i·e[p_ij]``, interpolated between the table's integer rows.

    Args:
        q: ``(b, h, i, d)``; k: ``(b, h, j, d)`` (the gates read them as the kernel does).
        allowed: ``(b|1, i, j)`` bool, which pairs may attend (causal; see
            :func:`cope_positions` for what the reverse sum relies on).
        table: ``(h|1, npos_max, d)`` position embeddings ``e`` (one per head, or shared).

    Returns:
        float32 (float64 for float64 inputs) ``(b, h, i, j)``, to add to the scaled logits. Like
        the paper's code, ``⌊p⌋`` and ``⌈p⌉`` carry no gradient; ``w = p - ⌊p⌋`` does.
    """
    dtype = compute_dtype(q.dtype)
    positions = cope_positions(q, k, allowed, table.shape[-2])
    z = q.to(dtype) @ table.to(dtype).transpose(-1, -2)  # (b, h, i, npos): z_i[n] = q_i·e[n]
    # A NaN position (from a NaN or overflowing q·k) reads row 0 and stays NaN through w, in
    # its own row only, instead of indexing out of bounds for the whole batch.
    index = positions.detach().nan_to_num(nan=0.0)
    floor = index.floor()
    w = positions - floor
    low = z.gather(-1, floor.long())
    high = z.gather(-1, index.ceil().long())
    return low + w * (high - low)
