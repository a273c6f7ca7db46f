"""T5 relative position bias (Raffel et al., 2020, §2.1)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..functional.t5 import t5_buckets
from ..positions import Positions
from ..spec.t5 import T5Config
from .base import DistanceClip, RelativeScheme, register
from .heads import head_selection, select_heads

__all__ = ["T5Bias", "T5Config"]


@register
class T5Bias(RelativeScheme):
    """A learned scalar per (bucket, head) added to the logits. Bucketing is bidirectional unless
    the attention is causal; beyond ``max_distance`` every distance shares the last bucket, so any
    length runs.

    Shapes:
        ``score_bias`` returns float32 ``(b|1, h, i, j)``.
    """

    config_class = T5Config
    hooks = frozenset({"score_bias"})
    query_independent = True

    def __init__(self, config: T5Config | None = None, **dims) -> None:
        super().__init__(config, **dims)
        c = self.config  # its checks against causal: T5Config.validate_dims
        self.table = nn.Parameter(torch.randn(c.num_buckets, self.num_heads) * 0.02)
        self.register_buffer(
            "bias_heads", head_selection(c.heads, self.num_heads), persistent=False
        )

    def bias_table(self) -> Tensor:
        """The table ``(R, h)`` in at least float32, zero in the heads left out of ``heads``."""
        table = self.table.to(compute_dtype(self.table.dtype))
        return select_heads(table, self.bias_heads, dim=1)

    def score_bias(self, q: Tensor, q_positions: Positions, k_positions: Positions) -> Tensor:
        values = self.bias_table()[self.relative_index(q_positions, k_positions)]  # (b, i, j, h)
        return values.permute(0, 3, 1, 2)

    # ------------------------------------------------------------ relative form (fused backends)
    @property
    def num_relative(self) -> int:
        """Number of buckets ``R``."""
        return self.config.num_buckets

    @property
    def distance_clip(self) -> DistanceClip:
        """Every distance from ``max_distance`` on shares its direction's last bucket; causal
        bucketing puts every key after the query in bucket 0, the bucket of distance 0."""
        m = self.config.max_distance
        return DistanceClip(-m, 0 if self.causal else m)

    def relative_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Bucket of every pair, ``(b|1, i, j)`` int64 in ``[0, R)``."""
        c = self.config
        return t5_buckets(
            q_positions.distance(k_positions),
            bidirectional=not self.causal,
            num_buckets=c.num_buckets,
            max_distance=c.max_distance,
        )

    def relative_logits(self, q: Tensor | None = None) -> Tensor:
        """Each bucket's bias per head, ``(1, h, 1, R)`` (the same for every query; ``q`` unused).

        ``score_bias(q, qp, kp)`` equals this gathered by :meth:`relative_index` (after
        broadcasting over queries).
        """
        del q
        return self.bias_table().t().reshape(1, self.num_heads, 1, -1)
