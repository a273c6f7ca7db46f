"""Relative distances and clipping (Shaw et al., 2018, "Self-Attention with Relative Position
Representations", §3.2)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["clipped_relative_index", "relative_distance", "table_rows"]


def relative_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``k_pos - q_pos`` for every pair.

    Shapes:
        q_pos: ``(b, i)``; k_pos: ``(b, j)``; returns ``(b, i, j)``.
    """
    return k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)


def clipped_relative_index(distance: Tensor, k: int) -> Tensor:
    """Row of a ``2k+1``-row table for each distance: ``clip(distance, -k, k) + k``.

    For ``k=3`` and 10 tokens, query 0 looks at distances 0..9 and reads rows
    ``[3, 4, 5, 6, 6, 6, 6, 6, 6, 6]``.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 0:
        raise ValueError(f"k (maximum relative distance) must be >= 0, got {k}")
    return distance.clamp(-k, k) + k


def table_rows(table: Tensor, rows: slice | Tensor | list[int], dim: int) -> Tensor:
    """Some rows of a relative table along ``dim``: a slice or list of rows, or an int64 index
    tensor (``index_select``)."""
    if isinstance(rows, Tensor):
        return table.index_select(dim, rows)
    return table[(slice(None),) * (dim % table.ndim) + (rows,)]
