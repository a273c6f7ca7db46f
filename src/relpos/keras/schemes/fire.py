"""FIRE in Keras."""

from __future__ import annotations

import keras
from keras import ops

from ...spec.fire import FIRE_EPS
from ..ops import fire_mlp
from .base import AttentionScheme, bias_heads, register, zero_left_out

__all__ = ["FireScheme"]


@register
class FireScheme(AttentionScheme):
    """FIRE (Li et al., ICLR 2024, "Functional Interpolation for Relative Positions Improves Long
    Context Transformers", §3), as :class:`relpos.schemes.Fire`: head ``h`` adds to the logit of
    query ``i`` and key ``j``

        ``f_θ(ψ(p_i - p_j) / (ψ(max(L, p_i)) + ε))_h``,  ``ψ(x) = log(|c|·x + 1)``,

    with ``f_θ`` = ``Dense(hidden)``, ReLU, ``Dense(h)``, ``L = |s|·init_threshold`` and ``ε =
    1e-6`` (the paper's reference code). Keys after the query (``p_j > p_i``, masked anyway) read
    distance 0. ``p`` are the tokens' positions in their own sequences (padding, packed
    documents, the cache's slots), so each sequence gets the bias it has alone.

    Weights (float32, named after the PyTorch state dict's ``mlp.0``, ``mlp.2``, ``c``,
    ``threshold_scale``): ``mlp_0_kernel (1, hidden)``, ``mlp_0_bias (hidden,)``,
    ``mlp_2_kernel (hidden, h)``, ``mlp_2_bias (h,)`` (``nn.Linear``'s initialisation), ``c``
    (scalar, ``init_c``), ``threshold_scale`` (scalar, 1). With ``heads``, the output layer's
    columns of the heads left out are zeroed at use (exact 0 bias, no gradient), as in PyTorch.

    The bias depends on the query's position as well as the distance, so it is evaluated per
    pair: ``score_bias`` builds the ``(b, i, j)`` inputs and the ``(b, h, i, j)`` bias, float32,
    reading the MLP as a piecewise-linear function (:func:`~relpos.keras.ops.fire_mlp`, as the
    PyTorch side does), so no ``(b, i, j, hidden)`` tensor is made. The output bias adds one
    constant per head to every key of a query, which softmax ignores: it gets no gradient, as in
    PyTorch. **Causal only** (``causal=False``
    raises).
    """

    scheme_name = "fire"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.bias_heads = bias_heads(config, self.num_heads)  # None: every head

    def build(self, input_shape=None) -> None:
        c = self.config
        for index, (fan_in, fan_out) in ((0, (1, c.hidden)), (2, (c.hidden, self.num_heads))):
            bound = fan_in**-0.5  # nn.Linear's U(±1/√fan_in), kernel and bias
            for part, shape in (("kernel", (fan_in, fan_out)), ("bias", (fan_out,))):
                # A fresh initializer per weight: one instance draws the same values twice.
                init = keras.initializers.RandomUniform(-bound, bound)
                name = f"mlp_{index}_{part}"
                weight = self.add_weight(name=name, shape=shape, initializer=init, dtype="float32")
                setattr(self, name, weight)
        for name, value in (("c", float(c.init_c)), ("threshold_scale", 1.0)):
            init = keras.initializers.Constant(value)
            weight = self.add_weight(name=name, shape=(), initializer=init, dtype="float32")
            setattr(self, name, weight)
        self.built = True

    def score_bias(self, q, q_positions, k_positions):
        f32 = lambda w: ops.cast(w, "float32")  # noqa: E731
        c = ops.abs(f32(self.c))
        threshold = ops.abs(f32(self.threshold_scale) * self.config.init_threshold)
        pi, pj = f32(q_positions.pos), f32(k_positions.pos)  # (bb, i), (bb, j)
        delta = ops.maximum(ops.expand_dims(pi, 2) - ops.expand_dims(pj, 1), 0.0)  # (bb, i, j)
        norm = ops.log1p(c * ops.maximum(pi, threshold)) + FIRE_EPS  # (bb, i)
        x = ops.log1p(c * delta) / ops.expand_dims(norm, 2)
        # heads left out: zero output columns
        kernel = zero_left_out(f32(self.mlp_2_kernel), self.bias_heads, axis=1)
        bias = zero_left_out(f32(self.mlp_2_bias), self.bias_heads, axis=0)
        w1, b1 = f32(self.mlp_0_kernel)[0], f32(self.mlp_0_bias)
        out = fire_mlp(x, w1, b1, kernel, bias)  # (bb, i, j, h)
        return ops.transpose(out, (0, 3, 1, 2))
