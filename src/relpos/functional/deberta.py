"""DeBERTa's relative positions (He et al., 2021, "DeBERTa: Decoding-enhanced BERT with
Disentangled Attention", §3.1; the log buckets of DeBERTa v2/v3).

A pair's relative position ``p_i - p_j`` (query minus key) is kept exactly up to ``mid =
position_buckets // 2`` in magnitude and log-spaced beyond, reaching ``±(2·mid - 1)`` at
``max_relative_positions - 1``; :func:`deberta_index` shifts it by the span and clamps it into the
``2·span`` rows of the relative embedding table.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.deberta import check_log_buckets, deberta_span

__all__ = ["deberta_buckets", "deberta_index", "deberta_span"]


def deberta_buckets(
    relative: Tensor, *, position_buckets: int, max_relative_positions: int
) -> Tensor:
    """Log bucket of every relative position (DeBERTa v2's ``make_log_bucket_position``).

    ``|x| <= mid`` stays ``x``; farther, ``sign(x)·(mid + ⌈log(|x|/mid) / log((M-1)/mid) ·
    (mid-1)⌉)`` with ``mid = position_buckets // 2`` and ``M = max_relative_positions``, computed in
    float32 in the reference's order of operations (its rounding decides the bucket edges).
    ``position_buckets <= 0`` turns bucketing off (``x`` unchanged).

    Args:
        relative: integer relative positions ``p_i - p_j``, any shape.
        position_buckets: ``2·mid``; ``mid >= 1`` and ``M - 1 > mid`` when bucketing.
        max_relative_positions: ``M``, the distance whose bucket is ``±(2·mid - 1)``.

    Returns:
        int64 buckets, same shape; odd: ``bucket(-x) = -bucket(x)``.
    """
    rel = relative.long()
    if position_buckets <= 0:
        return rel
    mid = check_log_buckets(position_buckets, max_relative_positions)
    size = rel.abs()
    far = size.clamp_min(mid)  # read only where size > mid; no log(0)
    scale = torch.log(torch.tensor((max_relative_positions - 1) / mid, device=rel.device))
    log_bucket = torch.ceil(torch.log(far / mid) / scale * (mid - 1)) + mid
    return torch.where(size <= mid, rel, log_bucket.long() * torch.sign(rel))


def deberta_index(
    relative: Tensor, *, position_buckets: int, max_relative_positions: int
) -> Tensor:
    """Row of the ``2·span`` relative table for every relative position ``p_i - p_j``:
    ``clamp(bucket + span, 0, 2·span - 1)`` (``span``: :func:`deberta_span`).

    Returns:
        int64 rows in ``[0, 2·span)``, same shape as ``relative``.
    """
    span = deberta_span(position_buckets, max_relative_positions)
    bucket = deberta_buckets(
        relative, position_buckets=position_buckets, max_relative_positions=max_relative_positions
    )
    return (bucket + span).clamp(0, 2 * span - 1)
