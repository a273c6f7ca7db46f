"""T5 relative position buckets (Raffel et al., 2020, "Exploring the Limits of Transfer Learning
with a Unified Text-to-Text Transformer", §2.1)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["t5_buckets"]


def t5_buckets(
    distance: Tensor, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """Bucket of every relative distance ``k_pos - q_pos``.

    Half of the buckets (per direction) hold exact distances ``0..max_exact-1``; the rest cover
    ``max_exact..max_distance`` on a log scale, and everything farther shares the last bucket.
    Bidirectional bucketing spends half the buckets on keys after the query; causal bucketing
    maps every key after the query to bucket 0.

    Args:
        distance: integer ``k_pos - q_pos``, any shape.
        bidirectional: split buckets between the two directions.
        num_buckets: total number of buckets (even and at least 4 when bidirectional).
        max_distance: distance from which all pairs share the farthest bucket.

    Returns:
        int64 tensor of bucket ids in ``[0, num_buckets)``, same shape as ``distance``.
    """
    if num_buckets < 2 or (bidirectional and (num_buckets % 2 or num_buckets < 4)):
        raise ValueError(
            "num_buckets must be >= 2 (even and >= 4 when bidirectional: two per direction), "
            f"got {num_buckets}"
        )
    n = -distance.long()  # > 0 when the key is before the query
    buckets = torch.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp_min(0)
    max_exact = num_buckets // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must exceed the exact buckets per direction ({max_exact}), "
            f"got {max_distance}"
        )
    # Log-spaced buckets for distances in [max_exact, max_distance), computed in float32.
    n_f = n.to(torch.float32).clamp_min(1.0)
    log_ratio = torch.log(n_f / max_exact) / math.log(max_distance / max_exact)
    far = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    far = far.clamp_max(num_buckets - 1)
    return buckets + torch.where(n < max_exact, n, far)
