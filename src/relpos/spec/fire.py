"""FIRE, functional interpolation for relative positions (Li et al., 2024, §3): config."""

from __future__ import annotations

from dataclasses import dataclass

from .base import (
    SchemeConfig,
    check_heads_field,
    check_int,
    check_positive_float,
    register_config,
)

__all__ = ["FIRE_EPS", "FireConfig"]

#: ``ε`` in FIRE's normaliser ``ψ(max(L, p_i)) + ε`` (the paper's reference code).
FIRE_EPS = 1e-6


@register_config
@dataclass(frozen=True)
class FireConfig(SchemeConfig):
    """Args:
    hidden: width of the MLP ``f_θ`` (the paper: 32).
    init_c: initial ``c`` of ``ψ(x) = log(c·x + 1)`` (learned; the paper's code: 0.1).
    init_threshold: initial threshold ``L`` (learned, as a multiplier of this value; the
        paper's code: 512). Queries at positions below ``L`` share the normaliser ``ψ(L)``.
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "fire"
    causal_only = True
    hidden: int = 32
    init_c: float = 0.1
    init_threshold: float = 512.0
    heads: tuple[int, ...] | None = None

    def validate(self) -> None:
        check_int("hidden", self.hidden, minimum=1)
        check_positive_float("init_c", self.init_c)
        check_positive_float("init_threshold", self.init_threshold)
        object.__setattr__(self, "heads", check_heads_field(self.heads))
