"""Sandwich (Chi, Fan, Rudnicky and Ramadge, 2023, §5): a fixed bias from the inner product of
sinusoidal position embeddings."""

from __future__ import annotations

from torch import Tensor

from ..functional.dtypes import compute_dtype
from ..functional.sandwich import sandwich_bias, sandwich_head_scales
from ..spec.sandwich import SandwichConfig
from .base import DistanceBiasScheme, register

__all__ = ["Sandwich", "SandwichConfig"]


@register
class Sandwich(DistanceBiasScheme):
    """Sandwich (Chi et al., 2023, "Dissecting Transformer Length Extrapolation via the Lens of
    Receptive Field Analysis"): the logit of query ``i`` and key ``j`` gets

        ``b_h(Δ) = (Σ_{k=1}^{d̄/2} cos(Δ / base^{2k/d̄}) - d̄/2) / (8h/H)``, ``Δ = p_j - p_i``,

    for head ``h = 1..H``: the inner product of the two tokens' sinusoidal embeddings, shifted to
    0 at distance 0 and compressed per head. No parameters; even in ``Δ``, so the same for causal
    and bidirectional attention; any length runs. A
    :class:`~relpos.schemes.base.DistanceBiasScheme`: evaluated once per distinct distance.

    Shapes:
        ``score_bias`` returns float32 ``(b|1, h, i, j)``.
    """

    config_class = SandwichConfig

    def __init__(self, config: SandwichConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        # Each head's divisor; its dtype follows the module's (.double() etc.), its values are
        # recomputed exactly at use (a bf16 copy would round 8h/H).
        self.register_buffer(
            "scales", sandwich_head_scales(self.num_heads).float(), persistent=False
        )

    def distance_bias(self, distance: Tensor) -> Tensor:
        c = self.config
        scales = sandwich_head_scales(self.num_heads).to(compute_dtype(self.scales.dtype))
        return sandwich_bias(distance, scales, dim=c.dim, base=c.base)
