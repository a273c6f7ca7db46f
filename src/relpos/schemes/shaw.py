"""Relative position representations (Shaw, Uszkoreit and Vaswani, 2018, "Self-Attention with
Relative Position Representations", eqs. 3–5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..functional.relative import clipped_relative_index
from ..functional.skew import gather_relative
from ..positions import Positions
from .base import Scheme, SchemeConfig, check_int, register

__all__ = ["ShawConfig", "ShawRelative", "bucket_mass"]


@dataclass(frozen=True)
class ShawConfig(SchemeConfig):
    """Args:
    max_distance: clipping distance ``k``: distances beyond ``±k`` share the edge embeddings.
    keys: add ``a^K`` to keys inside the logits (eq. 4).
    values: add ``a^V`` to values in the output (eq. 3).
    per_head: one table per head instead of one shared by all heads (the paper's default).
    """

    name = "shaw"
    max_distance: int = 16
    keys: bool = True
    values: bool = True
    per_head: bool = False

    def validate(self) -> None:
        check_int("max_distance", self.max_distance, minimum=0)


def bucket_mass(probs: Tensor, index: Tensor, num_buckets: int) -> Tensor:
    """Attention mass per relative bucket: ``m[.., i, r] = Σ_j probs[.., i, j]·[index[i, j] = r]``.

    Shapes:
        probs: ``(b, h, i, j)``; index: ``(b|1, i, j)``; returns ``(b, h, i, num_buckets)``.
    """
    b, h = probs.shape[:2]
    idx = index.unsqueeze(1).expand(b, h, *index.shape[-2:])
    mass = probs.new_zeros(*probs.shape[:-1], num_buckets)
    return mass.scatter_add_(-1, idx, probs)


@register
class ShawRelative(Scheme):
    """Shaw et al. relative positions: ``e_ij = q_i·(k_j + a^K_ij)/√d`` and
    ``z_i = Σ_j α_ij (v_j + a^V_ij)`` with
    ``a_ij = w_clip(p_j - p_i, k)`` from tables of ``2k+1`` rows.

    Never builds the ``(i, j, d)`` tensor of the paper: the key term is ``q·Wᵀ`` of shape
    ``(b, h, i, 2k+1)`` gathered by clipped distance; the value term is the attention mass per
    relative bucket times the table.
    """

    config_class = ShawConfig

    def __init__(self, config: ShawConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        c = self.config
        rows = 2 * c.max_distance + 1
        shape = (self.num_heads, rows, self.head_dim) if c.per_head else (rows, self.head_dim)
        std = self.head_dim**-0.5
        self.key_table = nn.Parameter(torch.randn(shape) * std) if c.keys else None
        self.value_table = nn.Parameter(torch.randn(shape) * std) if c.values else None
        hooks = {"score_bias"} if c.keys else set()
        self.hooks = frozenset(hooks | ({"value_term"} if c.values else set()))  # type: ignore[misc]

    def index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Table row of every pair, ``(b|1, i, j)``."""
        return clipped_relative_index(q_positions.distance(k_positions), self.config.max_distance)

    def score_bias(
        self, q: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        rel = self.relative_logits(q)
        return None if rel is None else gather_relative(rel, self.index(q_positions, k_positions))

    def value_term(
        self, probs: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        if self.value_table is None:
            return None
        rows = 2 * self.config.max_distance + 1
        dtype = compute_dtype(probs.dtype)
        mass = bucket_mass(probs.to(dtype), self.index(q_positions, k_positions), rows)
        table = self.value_table.to(dtype)
        if self.config.per_head:
            return torch.einsum("bhir,hrd->bhid", mass, table)
        return mass @ table

    # ------------------------------------------------------------ relative form (fused backends)
    @property
    def num_relative(self) -> int:
        """Rows ``R = 2k+1`` of the relative tables."""
        return 2 * self.config.max_distance + 1

    def relative_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Relative row of every pair, ``(b|1, i, j)`` int64 in ``[0, R)`` (as :meth:`index`)."""
        return self.index(q_positions, k_positions)

    def relative_keys(self, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """``a^K/√d`` in ``dtype``'s compute dtype, ``(h|1, R, d)`` (1 for a shared table): the
        key term is ``q·relative_keys()ᵀ``. None without a key table."""
        if self.key_table is None:
            return None
        table = self.key_table.to(compute_dtype(dtype)) / math.sqrt(self.head_dim)
        return table if self.config.per_head else table.unsqueeze(0)

    def relative_logits(self, q: Tensor) -> Tensor | None:
        """The key term per query and relative row, ``q_i·a^K_r/√d``: ``(b, h, i, R)``.

        ``score_bias(q, qp, kp) == gather_relative(relative_logits(q), relative_index(qp, kp))``;
        backends that tile the logits gather it per tile and never build ``(i, j)``. None without
        a key table.
        """
        keys = self.relative_keys(q.dtype)
        if keys is None:
            return None
        return torch.matmul(q.to(keys.dtype), keys.transpose(-1, -2))

    def relative_value(self, mass: Tensor) -> Tensor | None:
        """The value term from the attention mass per relative row: ``Σ_r mass[.., r]·a^V_r``.

        ``value_term(p, qp, kp) == relative_value(bucket_mass(p, relative_index(qp, kp), R))``.

        Shapes:
            mass: ``(b, h, i, R)``; returns ``(b, h, i, d)`` (None without a value table).
        """
        if self.value_table is None:
            return None
        dtype = compute_dtype(mass.dtype)
        table = self.value_table.to(dtype)
        if self.config.per_head:
            return torch.einsum("bhir,hrd->bhid", mass.to(dtype), table)
        return mass.to(dtype) @ table
