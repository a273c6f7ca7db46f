"""The dynamic position bias in Keras."""

from __future__ import annotations

import itertools

import keras
from keras import ops

from .base import DistanceBiasScheme, register

__all__ = ["DynamicPositionBiasScheme"]


@register
class DynamicPositionBiasScheme(DistanceBiasScheme):
    """The dynamic position bias (Wang et al., 2021, CrossFormer §3.3): an MLP maps each distance
    ``Δ`` (``|Δ|`` when causal; ``sign(Δ)·log(1 + |Δ|)`` with ``log_distance``) to one bias per
    head: ``Dense(hidden)``, ``depth`` blocks of ``LayerNorm, ReLU, Dense(hidden)``, then
    ``LayerNorm, ReLU, Dense(h)``; float32 weights, initialised as PyTorch's ``nn.Linear`` and
    ``nn.LayerNorm``. The MLP runs once per distance of the window
    (:class:`DistanceBiasScheme`). Weights: ``dense_{l}_kernel (in, out)``, ``dense_{l}_bias``
    for the ``depth + 2`` dense layers, ``norm_{l}_gamma``, ``norm_{l}_beta`` for the
    ``depth + 1`` norms."""

    scheme_name = "dpb"

    def build(self, input_shape=None) -> None:
        c = self.config
        widths = [1] + [c.hidden] * (c.depth + 1) + [self.num_heads]
        self.kernels, self.biases, self.gammas, self.betas = [], [], [], []
        for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            bound = fan_in**-0.5  # nn.Linear's U(±1/√fan_in), kernel and bias
            for store, name, shape in (
                (self.kernels, "kernel", (fan_in, fan_out)),
                (self.biases, "bias", (fan_out,)),
            ):
                # A fresh initializer per weight: one instance draws the same values twice.
                init = keras.initializers.RandomUniform(-bound, bound)
                weight = self.add_weight(
                    name=f"dense_{layer}_{name}", shape=shape, initializer=init, dtype="float32"
                )
                store.append(weight)
        norms = ((self.gammas, "gamma", "ones"), (self.betas, "beta", "zeros"))
        for layer in range(c.depth + 1):
            for store, name, init in norms:
                label = f"norm_{layer}_{name}"
                weight = self.add_weight(
                    name=label, shape=(c.hidden,), initializer=init, dtype="float32"
                )
                store.append(weight)
        self.built = True

    def distance_bias(self, distance):
        x = ops.cast(distance, "float32")
        if self.causal:
            x = ops.abs(x)
        if self.config.log_distance:
            x = ops.sign(x) * ops.log1p(ops.abs(x))
        x = ops.expand_dims(x, -1)  # (N, 1)
        f32 = lambda w: ops.cast(w, "float32")  # noqa: E731
        x = ops.matmul(x, f32(self.kernels[0])) + f32(self.biases[0])
        for gamma, beta, kernel, bias in zip(
            self.gammas, self.betas, self.kernels[1:], self.biases[1:], strict=True
        ):
            mean = ops.mean(x, axis=-1, keepdims=True)
            var = ops.mean(ops.square(x - mean), axis=-1, keepdims=True)
            x = (x - mean) * ops.rsqrt(var + 1e-5) * f32(gamma) + f32(beta)  # nn.LayerNorm
            x = ops.matmul(ops.relu(x), f32(kernel)) + f32(bias)
        return ops.transpose(x)  # (N, h) -> (h, N)
