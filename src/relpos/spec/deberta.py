"""DeBERTa's disentangled attention (He et al., 2021, §3.1; v2/v3 log buckets): config and the
table from relative position to row, in numpy.

A pair's relative position ``p_i - p_j`` (query minus key) is kept exactly up to ``mid =
position_buckets // 2`` in magnitude and log-spaced beyond, reaching ``±(2·mid - 1)`` at
``max_relative_positions - 1``; shifted by the span and clamped, it is a row of the ``2·span``
rows of the relative embedding table. Rows stop changing past :meth:`DebertaConfig.reach`, so a
table over ``[-reach, reach]`` (:meth:`DebertaConfig.index_table`) gives every pair's row, in
both frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import (
    SchemeConfig,
    check_bool,
    check_int,
    check_positive_float,
    register_config,
)

__all__ = ["DEBERTA_TERMS", "DebertaConfig", "deberta_buckets", "deberta_span"]

#: The position terms, in the order the configs list them: content→position, position→content.
DEBERTA_TERMS = ("c2p", "p2c")
_NORMS = ("none", "layer_norm")


def deberta_span(position_buckets: int, max_relative_positions: int) -> int:
    """Half the rows of the relative table: ``position_buckets`` when bucketing (``> 0``), else
    ``max_relative_positions``."""
    return position_buckets if position_buckets > 0 else max_relative_positions


def check_log_buckets(position_buckets: int, max_relative_positions: int) -> int:
    """The exact span ``position_buckets // 2`` of DeBERTa's log buckets, once checked: at least
    1, and short of ``max_relative_positions - 1`` (the log's argument stays above 1)."""
    mid = position_buckets // 2
    if mid < 1 or max_relative_positions - 1 <= mid:
        raise ValueError(
            "log buckets need position_buckets >= 2 and max_relative_positions - 1 > "
            f"position_buckets // 2, got position_buckets={position_buckets}, "
            f"max_relative_positions={max_relative_positions}"
        )
    return mid


def deberta_buckets(
    relative: np.ndarray, *, position_buckets: int, max_relative_positions: int
) -> np.ndarray:
    """Log bucket of every relative position (DeBERTa v2's ``make_log_bucket_position``).

    ``|x| <= mid`` stays ``x``; farther, ``sign(x)·(mid + ⌈log(|x|/mid) / log((M-1)/mid) ·
    (mid-1)⌉)`` with ``mid = position_buckets // 2`` and ``M = max_relative_positions``, computed in
    float32 in the reference's order of operations (its rounding decides the bucket edges).
    ``position_buckets <= 0`` turns bucketing off (``x`` unchanged).

    Returns:
        int64 buckets, the shape of ``relative``; odd: ``bucket(-x) = -bucket(x)``.
    """
    rel = np.asarray(relative).astype(np.int64)
    if position_buckets <= 0:
        return rel
    mid = check_log_buckets(position_buckets, max_relative_positions)
    size = np.abs(rel)
    far = np.maximum(size, mid).astype(np.float32)  # read only where size > mid; no log(0)
    scale = np.log(np.float32((max_relative_positions - 1) / mid))
    log_bucket = np.ceil(np.log(far / np.float32(mid)) / scale * np.float32(mid - 1)) + mid
    return np.where(size <= mid, rel, log_bucket.astype(np.int64) * np.sign(rel))


def _pos_att_type(value: Any) -> tuple[str, ...]:
    """The position terms as a tuple in :data:`DEBERTA_TERMS` order; like HF, a string may list
    them separated by ``|``."""
    terms = [t.strip().lower() for t in value.split("|")] if isinstance(value, str) else value
    if not isinstance(terms, list | tuple) or not all(isinstance(t, str) for t in terms):
        raise TypeError(f"pos_att_type must be a list of strings, got {value!r}")
    unknown = sorted(set(terms) - set(DEBERTA_TERMS))
    if unknown or not terms or len(set(terms)) != len(terms):
        raise ValueError(
            f"pos_att_type must be a non-empty subset of {DEBERTA_TERMS} without repeats, "
            f"got {value!r}"
        )
    return tuple(t for t in DEBERTA_TERMS if t in terms)


@register_config
@dataclass(frozen=True)
class DebertaConfig(SchemeConfig):
    """Args (HF ``DebertaV2Config``'s names; defaults: DeBERTa-v3):
    pos_att_type: the position terms, a non-empty subset of ``("c2p", "p2c")`` (a list, or HF's
        ``"p2c|c2p"`` string).
    position_buckets: ``2·mid`` log buckets: relative positions up to ``mid`` are exact, farther
        ones log-spaced up to ``max_relative_positions``; the table has ``2·position_buckets``
        rows. ``0`` turns bucketing off (HF's ``-1``): ``2·max_relative_positions`` rows of exact
        positions, clipped.
    max_relative_positions: ``M``: with buckets, the distance that reaches the outermost bucket;
        without, the clipping span (HF's ``-1`` means ``max_position_embeddings``: pass that).
    share_att_key: HF computes the position keys and queries with the layer's own key and query
        projections. The scheme cannot reach a layer's fused projection, so it always holds its
        own; this flag names them after the layer's (``key_proj``, ``query_proj``) instead of
        ``pos_key_proj``, ``pos_query_proj``, and says they are meant to equal the layer's key and
        query projections: load them from the same weights (they are then trained apart).
    norm_rel_ebd: ``"layer_norm"`` normalises the relative table before the projections (with
        ``layer_norm_eps``), ``"none"`` does not.
    """

    name = "deberta"
    pos_att_type: tuple[str, ...] = DEBERTA_TERMS
    position_buckets: int = 256
    max_relative_positions: int = 512
    share_att_key: bool = True
    norm_rel_ebd: str = "layer_norm"
    layer_norm_eps: float = 1e-7

    def __post_init__(self) -> None:
        object.__setattr__(self, "pos_att_type", _pos_att_type(self.pos_att_type))
        super().__post_init__()

    def validate(self) -> None:
        check_int("position_buckets", self.position_buckets, minimum=0)
        check_int("max_relative_positions", self.max_relative_positions, minimum=1)
        mid = self.position_buckets // 2
        if self.position_buckets and (mid < 1 or self.max_relative_positions - 1 <= mid):
            raise ValueError(
                "position_buckets must be 0 (no buckets) or >= 2 with max_relative_positions - 1 "
                f"> position_buckets // 2, got position_buckets={self.position_buckets}, "
                f"max_relative_positions={self.max_relative_positions}"
            )
        check_bool("share_att_key", self.share_att_key)
        if self.norm_rel_ebd not in _NORMS:
            raise ValueError(f"norm_rel_ebd must be one of {_NORMS}, got {self.norm_rel_ebd!r}")
        check_positive_float("layer_norm_eps", self.layer_norm_eps)

    @property
    def span(self) -> int:
        """Half the rows of the relative table."""
        return deberta_span(self.position_buckets, self.max_relative_positions)

    @property
    def reach(self) -> int:
        """A relative position from which the row no longer changes (in magnitude)."""
        return max(self.max_relative_positions, self.span) + 2

    def index_table(self) -> np.ndarray:
        """Row of the ``2·span`` relative table for every relative position ``p_i - p_j`` in
        ``[-reach, reach]``: int64 ``(2·reach + 1,)``, ``clamp(bucket + span, 0, 2·span - 1)``;
        a pair reads ``table[clip(p_i - p_j, -reach, reach) + reach]``."""
        reach, span = self.reach, self.span
        bucket = deberta_buckets(
            np.arange(-reach, reach + 1),
            position_buckets=self.position_buckets,
            max_relative_positions=self.max_relative_positions,
        )
        return np.clip(bucket + span, 0, 2 * span - 1)
