"""The Forgetting Transformer's forget gate in Keras."""

from __future__ import annotations

import keras
from keras import ops

from .base import AttentionScheme, register

__all__ = ["ForgetGateScheme"]


@register
class ForgetGateScheme(AttentionScheme):
    """The Forgetting Transformer's forget gate (Lin et al., 2025), as
    :class:`relpos.schemes.ForgetGate`: a scalar gate per head and token ``f_t = σ(w_h·x_t +
    b_h)`` from the attention layer's input, and logits ``q_i·k_j/√d + c_i - c_j`` with ``c_t =
    Σ log f_l`` over the real tokens ``l`` of ``t``'s own document up to ``t``.

    Weights: ``gate_kernel (D, h)`` (``N(0, 0.02²)``), ``gate_bias (h,)`` (0), float32; ``D`` is
    the layer input's width. ``token_log_decay`` is ``log σ`` in float32; the attention layer
    sums it per document (:func:`~relpos.keras.positions.with_log_decay`; with a cache, a running
    sum over the cache's slots of the per-token values it stores beside the keys and values) in
    float64 where the backend has it (TensorFlow, PyTorch, JAX with ``jax_enable_x64``; else
    float32, whose ``c`` loses absolute precision as it grows: ``10^-3`` at ``|c| = 10^4``), and
    ``score_bias`` is ``c_i - c_j`` in that dtype, cast to float32: one ``(b, h, i, j)`` bias.

    **Causal only** (``causal=False`` raises) and **self-attention only** (the gates are the
    layer's own tokens'). Its cache is a pair (see
    :meth:`~relpos.keras.RelativeMultiHeadAttention.empty_cache`).
    """

    scheme_name = "forgetting"
    adds_terms = True
    contextual = True

    def build(self, input_shape=None) -> None:
        if input_shape is None:
            raise ValueError("the forget gate's kernel needs the layer input's shape (b, n, D)")
        width = int(input_shape[-1])
        self.gate_kernel = self.add_weight(
            name="gate_kernel",
            shape=(width, self.num_heads),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype="float32",
        )
        self.gate_bias = self.add_weight(
            name="gate_bias", shape=(self.num_heads,), initializer="zeros", dtype="float32"
        )
        self.built = True

    def token_log_decay(self, x):
        logits = ops.matmul(ops.cast(x, "float32"), ops.cast(self.gate_kernel, "float32"))
        return ops.log_sigmoid(logits + ops.cast(self.gate_bias, "float32"))

    def score_bias(self, q, q_positions, k_positions):
        for name, p in (("q_positions", q_positions), ("k_positions", k_positions)):
            if p.log_decay is None:
                raise ValueError(
                    f"{type(self).__name__} needs {name} with a log_decay (set from the layer "
                    "input by RelativeMultiHeadAttention)"
                )
        cq = ops.expand_dims(q_positions.log_decay, 2)  # (b, i, 1, h)
        ck = ops.expand_dims(k_positions.log_decay, 1)  # (b, 1, j, h)
        return ops.transpose(ops.cast(cq - ck, "float32"), (0, 3, 1, 2))
