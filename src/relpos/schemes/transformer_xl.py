"""Transformer-XL relative attention (Dai et al., 2019, "Transformer-XL: Attentive Language Models
Beyond a Fixed-Length Context", §3.3)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..functional.relative import table_rows
from ..positions import Positions
from ..spec.transformer_xl import TransformerXLConfig
from .base import DistanceClip, RelativeScheme, register

__all__ = ["TransformerXL", "TransformerXLConfig"]


@register
class TransformerXL(RelativeScheme):
    """The logits of query ``i`` and key ``j`` are
    ``(q_i·k_j + q_i·W_R R_δ + u·k_j + v·W_R R_δ) / √d``, ``δ = clip(p_i - p_j)``: content,
    content-dependent position, global content bias ``u`` and global position bias ``v`` (per
    head), with ``R_δ`` the sinusoidal encoding of the distance (halves ``[sin, cos]``, width
    ``d_model``) and ``W_R`` a learned projection to every head.

    The hooks: ``rotate`` adds ``u`` to the queries (so the kernel's ``q·k`` carries ``u·k``);
    the relative logits are ``(q - u + v)·(W_R R)ᵀ/√d`` for those shifted queries, one row per
    clipped distance (``max_distance + 1`` when causal, ``2·max_distance + 1`` otherwise), gathered
    by each pair's distance: ``O(i·R)`` relative logits, never ``(i, j, d)``. In the relative form
    that is ``q·Eᵀ + c`` (``relative_keys`` ``E = W_R R/√d``, ``relative_row_bias``
    ``c = (v - u)·Eᵀ``), which ``chunked``'s band engines take.

    Shapes:
        ``score_bias`` returns float32 ``(b, h, i, j)``.
    """

    config_class = TransformerXLConfig
    hooks = frozenset({"rotate", "score_bias"})

    def __init__(self, config: TransformerXLConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        h, d = self.num_heads, self.head_dim
        self.position_proj = nn.Linear(self.d_model, h * d, bias=False)  # W_R
        self.content_bias = nn.Parameter(torch.zeros(h, d))  # u
        self.position_bias = nn.Parameter(torch.zeros(h, d))  # v
        # R_{p_i - p_j}, one row per clipped distance p_j - p_i (the even width: validate_dims)
        table = self.config.encodings(self.d_model, causal=self.causal)
        self.register_buffer("encodings", torch.from_numpy(table), persistent=False)

    def rotate(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> tuple[Tensor, Tensor]:
        """Add the content bias ``u`` to every query (keys unchanged)."""
        u = self.content_bias.to(q.dtype).unsqueeze(1)  # (h, 1, d)
        return q + u, k

    # ------------------------------------------------------------ relative form
    @property
    def num_relative(self) -> int:
        """Rows: ``M+1`` (causal, distances ``-M..0``) or ``2M+1``."""
        return self.encodings.shape[0]

    @property
    def distance_clip(self) -> DistanceClip:
        """Rows are the distance clipped to ``-M..0`` (causal) or ``±M``, plus ``M``."""
        m = self.config.max_distance
        return DistanceClip(-m, 0 if self.causal else m, shifted=True)

    def relative_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Row of every pair, ``(b|1, i, j)`` int64: the clipped ``p_j - p_i`` plus ``M``."""
        return self.distance_clip.rows(q_positions.distance(k_positions))

    def position_keys(
        self, dtype: torch.dtype = torch.float32, rows: slice | Tensor | list[int] | None = None
    ) -> Tensor:
        """``W_R R / √d`` per head and row, ``(h, R, d)`` in ``dtype``'s compute dtype (only the
        given ``rows`` of ``R``: the projection costs a product per row)."""
        cd = compute_dtype(dtype)
        enc = self.encodings if rows is None else table_rows(self.encodings, rows, 0)
        proj = enc.to(cd) @ self.position_proj.weight.to(cd).t()  # (rows, h·d)
        keys = proj.view(-1, self.num_heads, self.head_dim).transpose(0, 1)
        return keys / math.sqrt(self.head_dim)

    def relative_keys(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``W_R R / √d``: the logit term is ``q·Eᵀ`` for the queries ``rotate`` shifted by ``u``,
        plus :meth:`relative_row_bias`."""
        return self.position_keys(dtype)

    def relative_keys_at(
        self, rows: slice | Tensor | list[int], dtype: torch.dtype = torch.float32
    ) -> Tensor:
        return self.position_keys(dtype, rows)

    def relative_row_bias(self, keys: Tensor) -> Tensor:
        """``(v - u)·(W_R R)ᵀ/√d``, ``(h, R)``: the position term ``(q + v)·Eᵀ`` of the unshifted
        query, less the ``u·Eᵀ`` its shifted query carries."""
        shift = (self.position_bias - self.content_bias).to(keys.dtype).unsqueeze(1)  # (h, 1, d)
        return torch.matmul(shift, keys.transpose(-1, -2)).squeeze(1)

    @property
    def has_relative_keys(self) -> bool:
        return True
