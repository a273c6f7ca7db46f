"""ALiBi (Press, Smith and Lewis, 2022, "Train Short, Test Long: Attention with Linear Biases"),
with fixed or learned slopes."""

from __future__ import annotations

from torch import Tensor, nn

from ..functional.alibi import alibi_slopes
from ..functional.dtypes import compute_dtype
from ..spec.alibi import ALiBiConfig, LearnedALiBiConfig
from .base import DistanceBiasScheme, LinearBiasScheme, register
from .heads import head_selection, select_heads

__all__ = ["ALiBi", "ALiBiConfig", "LearnedALiBi", "LearnedALiBiConfig"]


@register
class ALiBi(LinearBiasScheme):
    """A fixed per-head linear penalty on distance, ``slope_h · (p_j - p_i)`` for causal attention
    and ``-slope_h · |p_j - p_i|`` (symmetric) for bidirectional attention. No parameters;
    extrapolates to any length.
    """

    config_class = ALiBiConfig

    def __init__(self, config: ALiBiConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        slopes = alibi_slopes(self.num_heads, self.config.slopes)
        # Heads left out of ``heads`` get slope 0: no bias, on every backend's fused path too.
        slopes = select_heads(slopes, head_selection(self.config.heads, self.num_heads))
        self.register_buffer("slopes", slopes, persistent=False)


@register
class LearnedALiBi(DistanceBiasScheme):
    """ALiBi whose per-head slopes are trained: ``slope_h · (p_j - p_i)`` (causal) or
    ``-slope_h · |p_j - p_i|`` (bidirectional), slopes initialised to ALiBi's (or the given ones)
    and kept ``>= 0`` at use. A linear :class:`~relpos.schemes.base.DistanceBiasScheme`: its
    gradient flows through the distance table on ``flex`` and ``sdpa``; ``chunked`` runs ALiBi's
    fused parts over plain positions and computes the slopes' gradient in their backward pass.

    Shapes:
        ``score_bias`` returns float32 ``(b|1, h, i, j)``.
    """

    config_class = LearnedALiBiConfig

    def __init__(self, config: LearnedALiBiConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        self.slopes = nn.Parameter(alibi_slopes(self.num_heads, self.config.slopes))

    linear = True
    closed_form = True

    def linear_slopes(self) -> Tensor:
        slopes = self.slopes.to(compute_dtype(self.slopes.dtype)).clamp(min=0.0)
        return select_heads(slopes, self.bias_heads)

    def distance_bias(self, distance: Tensor) -> Tensor:
        slopes = self.linear_slopes().unsqueeze(-1)
        d = distance.to(slopes.dtype).unsqueeze(0)
        return slopes * (d if self.causal else -d.abs())
