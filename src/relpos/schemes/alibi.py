"""ALiBi (Press, Smith and Lewis, 2022, "Train Short, Test Long: Attention with Linear Biases")."""

from __future__ import annotations

from dataclasses import dataclass

from ..functional.alibi import alibi_slopes
from .base import LinearBiasScheme, SchemeConfig, register

__all__ = ["ALiBi", "ALiBiConfig"]


@dataclass(frozen=True)
class ALiBiConfig(SchemeConfig):
    name = "alibi"


@register
class ALiBi(LinearBiasScheme):
    """A fixed per-head linear penalty on distance, ``slope_h · (p_j - p_i)`` for causal attention
    and ``-slope_h · |p_j - p_i|`` (symmetric) for bidirectional attention. No parameters;
    extrapolates to any length.
    """

    config_class = ALiBiConfig

    def __init__(self, config: ALiBiConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        self.register_buffer("slopes", alibi_slopes(self.num_heads), persistent=False)
