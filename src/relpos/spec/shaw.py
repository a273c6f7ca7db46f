"""Shaw et al. (2018): relative position representations with clipped distances."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, check_bool, check_int, register_config

__all__ = ["ShawConfig"]


@register_config
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
        for field in ("keys", "values", "per_head"):
            check_bool(field, getattr(self, field))
