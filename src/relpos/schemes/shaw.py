"""Relative position representations (Shaw, Uszkoreit and Vaswani, 2018, "Self-Attention with
Relative Position Representations", eqs. 3–5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..functional.relative import clipped_relative_index
from ..positions import Positions
from ..spec.shaw import ShawConfig
from .base import DistanceClip, RelativeScheme, register

__all__ = ["ShawConfig", "ShawRelative"]


@register
class ShawRelative(RelativeScheme):
    """Shaw et al. relative positions: ``e_ij = q_i·(k_j + a^K_ij)/√d`` and
    ``z_i = Σ_j α_ij (v_j + a^V_ij)`` with
    ``a_ij = w_clip(p_j - p_i, k)`` from tables of ``2k+1`` rows.

    Never builds the ``(i, j, d)`` tensor of the paper: the key term is ``q·Wᵀ`` of shape
    ``(b, h, i, 2k+1)`` gathered by clipped distance; the value term is the attention mass per
    relative bucket times the table (the :class:`RelativeScheme` defaults).
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

    # ------------------------------------------------------------ relative form (fused backends)
    @property
    def num_relative(self) -> int:
        """Rows ``R = 2k+1`` of the relative tables."""
        return 2 * self.config.max_distance + 1

    @property
    def distance_clip(self) -> DistanceClip:
        """Rows are the distance clipped to ``±k``, plus ``k``."""
        k = self.config.max_distance
        return DistanceClip(-k, k, shifted=True)

    def relative_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Table row of every pair, ``(b|1, i, j)``: the distance clipped to ``±k``, plus ``k``."""
        return clipped_relative_index(q_positions.distance(k_positions), self.config.max_distance)

    def relative_keys(self, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """``a^K/√d`` in ``dtype``'s compute dtype, ``(h|1, R, d)`` (1 for a shared table): the
        key term is ``q·relative_keys()ᵀ``. None without a key table."""
        if self.key_table is None:
            return None
        table = self.key_table.to(compute_dtype(dtype)) / math.sqrt(self.head_dim)
        return table if self.config.per_head else table.unsqueeze(0)

    @property
    def has_relative_keys(self) -> bool:
        return self.key_table is not None

    def relative_value(self, mass: Tensor) -> Tensor | None:
        """The value term from the attention mass per relative row: ``Σ_r mass[.., r]·a^V_r``.

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
