"""CoPE, contextual position encoding (Golovneva et al., 2024, §3): config."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, check_bool, check_int, register_config

__all__ = ["CoPEConfig"]


@register_config
@dataclass(frozen=True)
class CoPEConfig(SchemeConfig):
    """Args:
    npos_max: rows of the position table; contextual positions are clamped to ``npos_max - 1``
        (the paper's ``p_max``, small in its experiments; its code's ``--cope-npos``).
    per_head: one table per head (``(h, npos_max, d)``) instead of the paper's one table shared
        by the heads of a layer (``(npos_max, d)``).
    """

    name = "cope"
    causal_only = True
    npos_max: int = 64
    per_head: bool = False

    def validate(self) -> None:
        check_int("npos_max", self.npos_max, minimum=1)
        check_bool("per_head", self.per_head)
