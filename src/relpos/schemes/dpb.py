"""Dynamic position bias: a small MLP of the distance gives each head's bias (Wang et al., 2021,
"CrossFormer", §3.3; here on 1-D positions)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..spec.dpb import DynamicPositionBiasConfig
from .base import DistanceBiasScheme, register

__all__ = ["DynamicPositionBias", "DynamicPositionBiasConfig"]


@register
class DynamicPositionBias(DistanceBiasScheme):
    """An MLP maps each signed distance ``Δ = p_j - p_i`` (``|Δ|`` when causal, where only
    ``Δ <= 0`` is seen) to one bias per head: ``Linear(1, w)``, then ``depth`` blocks of
    ``LayerNorm, ReLU, Linear(w, w)``, then ``LayerNorm, ReLU, Linear(w, h)``. The MLP runs once per
    distinct distance of a call (:class:`~relpos.schemes.base.DistanceBiasScheme`), never per pair.

    Shapes:
        ``score_bias`` returns float32 ``(b|1, h, i, j)``.
    """

    config_class = DynamicPositionBiasConfig

    def __init__(self, config: DynamicPositionBiasConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        c = self.config
        layers: list[nn.Module] = [nn.Linear(1, c.hidden)]
        for _ in range(c.depth):
            layers += [nn.LayerNorm(c.hidden), nn.ReLU(), nn.Linear(c.hidden, c.hidden)]
        layers += [nn.LayerNorm(c.hidden), nn.ReLU(), nn.Linear(c.hidden, self.num_heads)]
        self.mlp = nn.Sequential(*layers)

    def distance_bias(self, distance: Tensor) -> Tensor:
        dtype = compute_dtype(self.mlp[0].weight.dtype)
        x = distance.to(dtype)
        if self.causal:
            x = x.abs()
        if self.config.log_distance:
            x = x.sign() * x.abs().log1p()
        x = x.unsqueeze(-1)  # (D, 1)
        for layer in self.mlp:  # in at least float32 whatever the parameters' dtype
            if isinstance(layer, nn.Linear):
                x = F.linear(x, layer.weight.to(dtype), layer.bias.to(dtype))
            elif isinstance(layer, nn.LayerNorm):
                w, b = layer.weight.to(dtype), layer.bias.to(dtype)
                x = F.layer_norm(x, layer.normalized_shape, w, b, layer.eps)
            else:
                x = layer(x)
        return x.t()  # (D, h) -> (h, D)
