"""Which tiles the ``chunked`` backend's general path computes, from ``O(i + j)`` block summaries.

Shape legend: ``b`` batch, ``i`` queries, ``j`` keys; ``bi``/``bj`` one query/key block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...positions import PAD_SEGMENT, Positions
from .kernels import block_bounds

__all__ = ["TilePlan", "plan_tiles"]


@dataclass(frozen=True)
class TilePlan:
    """The tiles to compute.

    Attributes:
        q_blocks: ``[(i0, i1), …]`` query block bounds.
        tiles: per query block, ``[(j0, j1, masked), …]`` key tiles that have at least one pair
            that may attend; ``masked`` is False when every pair of the tile may attend.
    """

    q_blocks: list[tuple[int, int]]
    tiles: list[list[tuple[int, int, bool]]]

    def max_tile(self) -> int:
        """The largest ``bi·bj`` of a computed tile (the ``O(block²)`` memory bound)."""
        return max(
            (
                (i1 - i0) * (j1 - j0)
                for (i0, i1), ts in zip(self.q_blocks, self.tiles, strict=True)
                for j0, j1, _ in ts
            ),
            default=0,
        )


def _summaries(p: Positions, block: int) -> dict[str, Tensor]:
    """Per-row, per-block ``(b, nblocks)`` summaries of the real tokens' positions and segments."""
    b, n = p.pos.shape
    nb = -(-n // block)
    pad = nb * block - n
    valid = p.seg != PAD_SEGMENT
    big = torch.iinfo(torch.int64).max

    def pooled(x: Tensor, fill: int, lowest: bool) -> Tensor:
        x = F.pad(x, (0, pad), value=fill).view(b, nb, block)
        return x.amin(-1) if lowest else x.amax(-1)

    seg_lo = pooled(torch.where(valid, p.seg, big), big, True)
    all_valid = F.pad(valid, (0, pad), value=True).view(b, nb, block).all(-1)
    seg_hi = pooled(torch.where(valid, p.seg, -1), -1, False)
    return {
        "seg_lo": seg_lo,
        "seg_hi": seg_hi,
        "pos_lo": pooled(torch.where(valid, p.pos, big), big, True),
        "pos_hi": pooled(torch.where(valid, p.pos, -big), -big, False),
        "uniform": all_valid & (seg_lo == seg_hi),  # every token real, one segment
    }


def plan_tiles(
    q_positions: Positions, k_positions: Positions, *, causal: bool, q_block: int, k_block: int
) -> TilePlan:
    """Classify every ``(query block, key block)`` tile from ``O(i + j)`` block summaries.

    A tile is skipped when, in every row, its blocks share no segment of real tokens or (causal)
    every key is after every query; it is unmasked when, in every row, both blocks are real tokens
    of one and the same segment and (causal) no key is after any query; otherwise masked.
    """
    qs = {k: t.unsqueeze(-1) for k, t in _summaries(q_positions, q_block).items()}  # (b, nq, 1)
    ks = {k: t.unsqueeze(-2) for k, t in _summaries(k_positions, k_block).items()}  # (b, 1, nk)
    skip = (qs["seg_hi"] < 0) | (ks["seg_hi"] < 0)
    skip = skip | (qs["seg_hi"] < ks["seg_lo"]) | (ks["seg_hi"] < qs["seg_lo"])
    free = qs["uniform"] & ks["uniform"] & (qs["seg_lo"] == ks["seg_lo"])
    if causal:
        skip = skip | (ks["pos_lo"] > qs["pos_hi"])
        free = free & (ks["pos_hi"] <= qs["pos_lo"])
    skip_l, free_l = skip.all(0).tolist(), free.all(0).tolist()
    q_blocks = block_bounds(0, len(q_positions), q_block)
    k_blocks = block_bounds(0, len(k_positions), k_block)
    tiles = [
        [(j0, j1, not free_l[a][c]) for c, (j0, j1) in enumerate(k_blocks) if not skip_l[a][c]]
        for a in range(len(q_blocks))
    ]
    return TilePlan(q_blocks, tiles)
