"""Sandwich in Keras."""

from __future__ import annotations

from keras import ops

from ...spec.sandwich import sandwich_head_scales
from ..ops import sandwich_bias
from ..positions import accumulation_dtype
from .base import DistanceBiasScheme, register

__all__ = ["SandwichScheme"]


@register
class SandwichScheme(DistanceBiasScheme):
    """Sandwich (Chi et al., 2023, "Dissecting Transformer Length Extrapolation via the Lens of
    Receptive Field Analysis", §5), as :class:`relpos.schemes.Sandwich`: the logit of query ``i``
    and key ``j`` gets

        ``b_h(Δ) = (Σ_{k=1}^{d̄/2} cos(Δ / base^{2k/d̄}) - d̄/2) / (8h/H)``, ``Δ = p_j - p_i``,

    for head ``h = 1..H``: the inner product of two sinusoidal embeddings of width ``d̄``
    (``dim``), shifted to 0 at distance 0 and compressed per head (ALiBi's ratios). No weights;
    even in ``Δ``, so the same for causal and bidirectional attention. Evaluated once per
    distance of the window (:class:`DistanceBiasScheme`) by :func:`~relpos.keras.ops.
    sandwich_bias`, whose cosines are summed in float64 where the backend has it
    (:func:`~relpos.keras.positions.accumulation_dtype`: TensorFlow, PyTorch, JAX with
    ``jax_enable_x64``), as the PyTorch function always does.
    """

    scheme_name = "sandwich"

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.scales = tuple(sandwich_head_scales(self.num_heads).tolist())  # 8h/H, exact

    def distance_bias(self, distance):
        c, dtype = self.config, accumulation_dtype()
        scales = ops.convert_to_tensor(self.scales, dtype=dtype)
        return sandwich_bias(distance, scales, dim=c.dim, base=c.base, dtype=dtype)
