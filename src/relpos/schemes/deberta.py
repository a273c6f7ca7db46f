"""DeBERTa's disentangled attention (He et al., 2021, "DeBERTa: Decoding-enhanced BERT with
Disentangled Attention", §3.1; the log buckets and shared projections of DeBERTa v2/v3)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..positions import Positions
from ..spec.deberta import DEBERTA_TERMS, DebertaConfig
from .base import DistanceClip, RelativeScheme, register

__all__ = ["DEBERTA_TERMS", "DeBERTa", "DebertaConfig"]


@register
class DeBERTa(RelativeScheme):
    """Disentangled attention: the logit of query ``i`` and key ``j`` is

    ``(q_i·k_j + q_i·K_r[δ(i, j)] + k_j·Q_r[δ(i, j)]) / √(s·d)``,

    content-to-content, content-to-position (``c2p``) and position-to-content (``p2c``), with
    ``K_r = W_k·P + b_k`` and ``Q_r = W_q·P + b_q`` per head from a learned table ``P`` of
    ``2·span`` rows (layer-normalised with ``norm_rel_ebd``), ``δ(i, j) = clamp(bucket(p_i - p_j)
    + span, 0, 2·span - 1)`` (:func:`~relpos.functional.deberta_index`) and ``s = 1 +`` the number
    of position terms (``√(3d)`` with both). The paper writes p2c's row as ``δ(j, i)``; the
    authors' code, and HF's, read the table at ``δ(i, j)`` for both terms, as here.

    The hooks: ``rotate`` scales the queries by ``1/√s`` (so the kernel's ``q·k/√d`` is the
    content term); c2p is ``relative_keys`` ``K_r/√d`` (``q·Eᵀ``, for those scaled queries), p2c
    ``relative_key_logits(k) = k·Q_rᵀ/√(s·d)`` ``(b, h, j, R)``, gathered per pair with the
    transposed index (``key_bias``). Keys are not changed, so the KV cache holds plain keys and
    p2c reads the cached ones at every call. Nothing ``(i, j, d)`` is built; on ``chunked`` and
    ``flex`` nothing ``(b, h, i, j)`` beyond a tile.

    HF shares ``P`` (and its LayerNorm) across layers and gives every layer its own
    projections; here every layer's scheme has its own table (``share_relative`` would share the
    projections too). No dropout on ``P`` (HF's ``pos_dropout``).

    Shapes:
        ``score_bias`` and ``key_bias`` return float32 ``(b, h, i, j)``; the table ``P`` is
        ``(2·span, d_model)``.
    """

    config_class = DebertaConfig

    def __init__(self, config: DebertaConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        c, width = self.config, self.d_model
        self.terms = 1 + len(c.pos_att_type)  # s
        # Row of every relative position in [-reach, reach] (the Keras scheme reads the same)
        table = torch.from_numpy(c.index_table())
        self.register_buffer("index_table", table, persistent=False)
        self.rel_embeddings = nn.Parameter(torch.randn(2 * c.span, width) * 0.02)
        self.layer_norm = (
            nn.LayerNorm(width, eps=c.layer_norm_eps) if c.norm_rel_ebd == "layer_norm" else None
        )
        shared = c.share_att_key
        #: Projection name of each term: HF's names with and without share_att_key.
        self.projection_names = {
            "c2p": "key_proj" if shared else "pos_key_proj",
            "p2c": "query_proj" if shared else "pos_query_proj",
        }
        self.projections = nn.ModuleDict(
            {self.projection_names[t]: nn.Linear(width, width) for t in c.pos_att_type}
        )
        hooks = {"rotate"}
        hooks |= {"score_bias"} if "c2p" in c.pos_att_type else set()
        hooks |= {"key_bias"} if "p2c" in c.pos_att_type else set()
        self.hooks = frozenset(hooks)  # type: ignore[misc]

    def rotate(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> tuple[Tensor, Tensor]:
        """Scale the queries by ``1/√s`` (keys unchanged)."""
        return q * (1.0 / math.sqrt(self.terms)), k

    # ------------------------------------------------------------ relative form
    @property
    def num_relative(self) -> int:
        """Rows ``R = 2·span`` of the relative table."""
        return 2 * self.config.span

    @property
    def distance_clip(self) -> DistanceClip:
        """The rows stop changing past the spec's ``reach`` either way (the log buckets end at
        the table's edges), so ``fused`` keeps a table of ``2·reach + 1`` distances at any
        length, and over a KV cache's queries and keys reads no range of positions."""
        reach = self.config.reach
        return DistanceClip(-reach, reach)

    def relative_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Row ``δ(i, j)`` of every pair, ``(b|1, i, j)`` int64, from ``p_i - p_j``."""
        reach = self.config.reach  # rows are constant past it: read the spec's table
        rel = (-q_positions.distance(k_positions)).clamp(-reach, reach) + reach
        return self.index_table.to(rel.device)[rel]

    def position_states(self, term: str, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """``W·P + b`` of one term's projection per head and row, ``(h, R, d)`` in ``dtype``'s
        compute dtype (``K_r`` for ``"c2p"``, ``Q_r`` for ``"p2c"``), or None without the term."""
        if term not in self.config.pos_att_type:
            return None
        cd = compute_dtype(dtype)
        table = self.rel_embeddings.to(cd)
        if self.layer_norm is not None:
            ln = self.layer_norm
            table = F.layer_norm(
                table, ln.normalized_shape, ln.weight.to(cd), ln.bias.to(cd), ln.eps
            )
        proj = self.projections[self.projection_names[term]]
        states = F.linear(table, proj.weight.to(cd), proj.bias.to(cd))  # (R, h·d)
        return states.view(-1, self.num_heads, self.head_dim).transpose(0, 1)

    def relative_keys(self, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """c2p: ``K_r/√d``, ``(h, R, d)``, for queries that ``rotate`` scaled by ``1/√s``."""
        keys = self.position_states("c2p", dtype)
        return None if keys is None else keys / math.sqrt(self.head_dim)

    @property
    def has_relative_keys(self) -> bool:
        return "c2p" in self.config.pos_att_type

    def relative_key_logits(self, k: Tensor) -> Tensor | None:
        """p2c: ``k·Q_rᵀ/√(s·d)``, float32 ``(b, h, j, R)``, or None without the term."""
        queries = self.position_states("p2c", k.dtype)
        if queries is None:
            return None
        scale = 1.0 / math.sqrt(self.terms * self.head_dim)
        return torch.matmul(k.to(queries.dtype), queries.transpose(-1, -2)) * scale
