"""ALiBi in Keras, with fixed or trained slopes."""

from __future__ import annotations

from keras import ops

from ..ops import alibi_bias, relative_distance
from .base import AttentionScheme, DistanceBiasScheme, register

__all__ = ["AlibiScheme", "LearnedAlibiScheme"]


@register
class AlibiScheme(AttentionScheme):
    """ALiBi (Press et al., 2022): ``slope_h·(p_j - p_i)`` causal, ``-slope_h·|p_j - p_i|``
    bidirectional. Builds one ``(b|1, h, i, j)`` bias."""

    scheme_name = "alibi"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        # fixed: computed once (the config's per-head slopes, or the paper's); 0 for the heads
        # left out of ``heads``
        self.slopes = tuple(config.head_slopes(self.num_heads).tolist())

    def score_bias(self, q, q_positions, k_positions):
        slopes = ops.convert_to_tensor(self.slopes, dtype="float32")
        distance = relative_distance(q_positions.pos, k_positions.pos)
        return alibi_bias(slopes, distance, causal=self.causal)


@register
class LearnedAlibiScheme(DistanceBiasScheme):
    """ALiBi with trained slopes: ``slope_h·(p_j - p_i)`` (causal) or ``-slope_h·|p_j - p_i|``
    (bidirectional); ``slopes`` a float32 weight ``(h,)`` initialised to ALiBi's (or the
    config's) and kept ``>= 0`` at use."""

    scheme_name = "learned_alibi"

    def build(self, input_shape=None) -> None:
        initial = tuple(self.config.initial_slopes(self.num_heads).tolist())
        self.slopes = self.add_weight(
            name="slopes",
            shape=(self.num_heads,),
            initializer=lambda shape, dtype: ops.convert_to_tensor(initial, dtype),
            dtype="float32",
        )
        self.built = True

    def distance_bias(self, distance):
        slopes = ops.expand_dims(ops.maximum(ops.cast(self.slopes, "float32"), 0.0), -1)
        d = ops.expand_dims(ops.cast(distance, "float32"), 0)
        return slopes * (d if self.causal else -ops.abs(d))
