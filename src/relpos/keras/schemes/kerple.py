"""KERPLE in Keras."""

from __future__ import annotations

import keras
from keras import ops

from ...spec.kerple import KERPLE_EPS
from ..ops import kerple_bias
from .base import DistanceBiasScheme, register

__all__ = ["KerpleScheme"]


@register
class KerpleScheme(DistanceBiasScheme):
    """KERPLE (Chi et al., 2022, §4): ``-r1·log(1 + r2·|Δ|)`` (``variant="log"``) or
    ``-r1·|Δ|^r2`` (``"power"``) with ``r1, r2`` learned per head (float32 weights ``(h,)``,
    initialised ``U(0, 2)`` and ``U(0, 1)`` plus 0.01), clamped into range at use (``>= 0.01``;
    ``r2 <= 2`` for the power variant), as the PyTorch scheme."""

    scheme_name = "kerple"

    def build(self, input_shape=None) -> None:
        uniform = keras.initializers.RandomUniform
        for name, top in (("r1", 2.0), ("r2", 1.0)):
            weight = self.add_weight(
                name=name,
                shape=(self.num_heads,),
                initializer=uniform(KERPLE_EPS, top + KERPLE_EPS),
                dtype="float32",
            )
            setattr(self, name, weight)
        self.built = True

    def distance_bias(self, distance):
        power = self.config.variant == "power"
        r1 = ops.maximum(ops.cast(self.r1, "float32"), KERPLE_EPS)
        r2 = ops.clip(ops.cast(self.r2, "float32"), KERPLE_EPS, 2.0 if power else 3.0e38)
        return kerple_bias(distance, r1, r2, variant=self.config.variant)
