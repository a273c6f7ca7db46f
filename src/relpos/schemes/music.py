"""Music Transformer relative global attention (Huang et al., 2018, "Music Transformer: Generating
Music with Long-Term Structure", §3.4)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..functional.skew import gather_relative, skew
from ..positions import Positions
from ..spec.music import MusicConfig
from .base import DistanceClip, RelativeScheme, register

__all__ = ["MusicConfig", "MusicRelative"]


@register
class MusicRelative(RelativeScheme):
    """Relative logits ``S_rel[i, j] = q_i · Er[clip(p_j - p_i)] / √d`` with a learned per-head
    table ``Er`` (``max_distance+1`` rows when causal: distances ``-M..0``; ``2M+1`` when
    bidirectional: ``-M..M``). The logits are ``(Q·Kᵀ + S_rel)/√d``.

    Two equal ways to get ``S_rel``: for contiguous positions, ``skew(Q·Erᵀ)`` — the paper's
    memory-saving reshape, no index tensor; for any positions (padding, packing, a KV cache),
    ``Q·Erᵀ`` gathered by the clipped distance. Both hold ``O(L·R)`` relative logits, never
    ``(L, L, d)``.
    """

    config_class = MusicConfig
    hooks = frozenset({"score_bias"})

    def __init__(self, config: MusicConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        m = self.config.max_distance
        rows = m + 1 if self.causal else 2 * m + 1
        self.table = nn.Parameter(
            torch.randn(self.num_heads, rows, self.head_dim) * self.head_dim**-0.5
        )

    def index(self, distance: Tensor) -> Tensor:
        """Row of ``Er`` for each relative distance (row ``M`` is distance 0)."""
        return self.distance_clip.rows(distance)

    def score_bias(self, q: Tensor, q_positions: Positions, k_positions: Positions) -> Tensor:
        keys = self.relative_keys(q.dtype)  # (h, R, d), scaled by 1/√d
        qf = q.to(keys.dtype)
        n = q.shape[-2]
        if q_positions is k_positions and q_positions.contiguous and n > 0:
            # Self-attention over contiguous positions: distances -(n-1)..(0 or n-1), one table
            # row each (clipped rows repeat), then the skew puts every row into place.
            hi = 0 if self.causal else n - 1
            dist = torch.arange(-(n - 1), hi + 1, device=q.device)
            rel = torch.matmul(qf, keys[:, self.index(dist)].transpose(-1, -2))
            return skew(rel, causal=self.causal)
        index = self.index(q_positions.distance(k_positions))
        span = q_positions.span
        if q_positions is k_positions and span is not None and span < self.config.max_distance:
            # Self-attention: no distance exceeds the span, so only table rows M-span..M(+span)
            # can be read. Slice them rather than multiply q by the whole table.
            m = self.config.max_distance
            lo, hi = m - span, m + (0 if self.causal else span)
            keys, index = keys[:, lo : hi + 1], index.clamp(lo, hi) - lo
        rel = torch.matmul(qf, keys.transpose(-1, -2))
        return gather_relative(rel, index)

    # ------------------------------------------------------------ relative form (fused backends)
    @property
    def num_relative(self) -> int:
        """Rows ``R`` of ``Er``: ``M+1`` (causal) or ``2M+1``."""
        return self.table.shape[1]

    @property
    def distance_clip(self) -> DistanceClip:
        """Rows are the distance clipped to ``-M..0`` (causal) or ``±M``, plus ``M``."""
        m = self.config.max_distance
        return DistanceClip(-m, 0 if self.causal else m, shifted=True)

    def relative_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Row of ``Er`` for every pair, ``(b|1, i, j)`` int64 in ``[0, R)``."""
        return self.index(q_positions.distance(k_positions))

    def relative_keys(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``Er/√d`` in ``dtype``'s compute dtype, ``(h, R, d)``: the relative logits are
        ``q·relative_keys()ᵀ``. Backends multiply ``q`` by the rows they need only."""
        return self.table.to(compute_dtype(dtype)) / math.sqrt(self.head_dim)

    @property
    def has_relative_keys(self) -> bool:
        return True
