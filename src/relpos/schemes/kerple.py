"""KERPLE relative positional bias (Chi et al., 2022, §4)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional.distance_form import DistanceForm, distance_form_bias
from ..functional.dtypes import compute_dtype
from ..spec.kerple import KERPLE_EPS, KerpleConfig
from .base import DistanceBiasScheme, register
from .heads import select_heads

__all__ = ["KERPLE_EPS", "Kerple", "KerpleConfig"]

#: Smallest value of ``r1`` and ``r2`` (and, for the power variant, largest ``r2``: 2).


@register
class Kerple(DistanceBiasScheme):
    """A learned kernel of the distance per head added to the logits; ``r1`` and ``r2`` are
    clamped into range at use (``r1, r2 >= 0.01``; ``r2 <= 2`` for the power variant), as in the
    paper's code. Both directions use ``|Δ|``; the function is evaluated once per distinct
    distance (:class:`~relpos.schemes.base.DistanceBiasScheme`).

    Shapes:
        ``score_bias`` returns float32 ``(b|1, h, i, j)``.
    """

    config_class = KerpleConfig
    closed_form = True

    def __init__(self, config: KerpleConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        h = self.num_heads
        # The paper's initialisation: r1 ~ U(0, 2), r2 ~ U(0, 1), kept above KERPLE_EPS.
        self.r1 = nn.Parameter(torch.rand(h) * 2 + KERPLE_EPS)
        self.r2 = nn.Parameter(torch.rand(h) + KERPLE_EPS)

    def parameters_in_range(self) -> tuple[Tensor, Tensor]:
        """``(r1, r2)`` clamped into their domain, in at least float32."""
        dtype = compute_dtype(self.r1.dtype)
        r2_max = 2.0 if self.config.variant == "power" else None
        return self.r1.to(dtype).clamp(min=KERPLE_EPS), self.r2.to(dtype).clamp(
            min=KERPLE_EPS, max=r2_max
        )

    def distance_form(self) -> DistanceForm:
        """``-r1·log(1 + r2·|δ|)`` or ``-r1·|δ|^r2`` per head (the heads left out of
        ``heads``: ``r1 = 0``), which ``fused`` evaluates per pair."""
        r1, r2 = self.parameters_in_range()
        params = torch.stack([select_heads(r1, self.bias_heads), r2], -1)
        return DistanceForm(f"kerple_{self.config.variant}", params)

    def distance_bias(self, distance: Tensor) -> Tensor:
        return distance_form_bias(self.distance_form(), distance)
