"""The dynamic position bias (Wang et al., 2021, CrossFormer §3.3): config."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, check_bool, check_heads_field, check_int, register_config

__all__ = ["DynamicPositionBiasConfig"]


@register_config
@dataclass(frozen=True)
class DynamicPositionBiasConfig(SchemeConfig):
    """Args:
    hidden: width of the MLP.
    depth: hidden blocks (LayerNorm, ReLU, Linear) after the input projection; CrossFormer uses 2.
    log_distance: feed ``sign(Δ)·log(1 + |Δ|)`` instead of ``Δ`` (log-spaced inputs, as Swin
        Transformer V2 does for its continuous bias), so distances far beyond training stay in a
        range the MLP has seen the shape of.
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "dpb"
    hidden: int = 32
    depth: int = 2
    log_distance: bool = False
    heads: tuple[int, ...] | None = None

    def validate(self) -> None:
        check_int("hidden", self.hidden, minimum=1)
        check_int("depth", self.depth, minimum=0)
        check_bool("log_distance", self.log_distance)
        object.__setattr__(self, "heads", check_heads_field(self.heads))
