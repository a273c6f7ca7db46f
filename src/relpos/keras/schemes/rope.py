"""Rotary position embedding in Keras (scalings, xPos, learned frequencies)."""

from __future__ import annotations

import keras
from keras import ops

from ...spec.rope import check_xpos_position, xpos_decay
from ..ops import apply_rope, rope_angles, sequence_rope_frequencies, xpos_scale
from ..positions import Positions, holds_values, sequence_lengths
from .base import AttentionScheme, register

__all__ = ["RotaryScheme"]


@register
class RotaryScheme(AttentionScheme):
    """RoPE (Su et al., 2021): rotates queries and keys by ``p·ω_m`` from each token's own
    position; ``ω`` with the config's long-context scaling (the PyTorch side's frequencies), and
    YaRN's or LongRoPE's attention factor on q and k.

    * Plain RoPE and static scalings (linear, NTK, YaRN, Llama 3) rotate keys once, before they
      enter the cache.
    * Dynamic NTK and LongRoPE take ``ω`` from the length of each token's own sequence
      (:func:`~relpos.keras.positions.sequence_lengths`): keys enter the cache raw and are
      rotated at every call with their sequence's current length (``rotates_cached_keys``), so
      decoding step ``t`` equals the forward over the row's first ``t`` tokens.
    * xPos (``xpos_scale_base`` ``γ``, causal only) scales pair ``m`` of a query at ``p`` by
      ``ζ_m^(p/γ)`` and of a key by ``ζ_m^(-p/γ)``. A position beyond
      :func:`~relpos.functional.xpos.xpos_max_position` for q's dtype is a ``ValueError`` when the
      positions hold values (eager); under ``jit`` / ``tf.function`` they are not checked.
    * ``learned_freq``: ``ω`` is a trainable float32 weight ``inv_freq (r/2,)`` initialised to
      the (scaled) ladder.

    Multi-axis coordinates are PyTorch-only: Keras positions have one axis, so with ``sections``
    every section reads ``pos`` (M-RoPE is then plain RoPE; axial RoPE keeps its ladders).
    """

    scheme_name = "rope"

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        r = self.rotary_dim = config.rotated(self.head_dim)
        self.rotates_cached_keys = config.length_dependent
        inv_freq, self.attention_factor = config.frequencies(self.head_dim)
        self.ladder = tuple(inv_freq.tolist())  # fixed ω, or the learned weight's initial value
        self.xpos_decay = None if config.xpos_scale_base is None else tuple(xpos_decay(r).tolist())
        self.inv_freq = None

    def build(self, input_shape=None) -> None:
        if self.config.learned_freq:
            self.inv_freq = self.add_weight(
                name="inv_freq",
                shape=(len(self.ladder),),
                initializer=lambda shape, dtype: ops.convert_to_tensor(self.ladder, dtype),
                dtype="float32",
            )
        self.built = True

    def _angles(self, positions: Positions, lengths):
        if lengths is not None:
            c = self.config
            inv = sequence_rope_frequencies(self.rotary_dim, c.theta, c.scaling_dict, lengths)
        elif self.inv_freq is not None:
            inv = ops.cast(self.inv_freq, "float32")
        else:
            inv = self.ladder  # host values: the angles reduced modulo 2π exactly
        return rope_angles(positions.pos, inv)

    def _xpos(self, positions: Positions, dtype, *, key: bool):
        base = self.config.xpos_scale_base
        if base is None:
            return None
        if holds_values(positions.pos):  # traced (jit, tf.function): no data-dependent check
            largest = int(ops.convert_to_numpy(ops.max(ops.abs(positions.pos))))
            check_xpos_position(largest, keras.backend.standardize_dtype(dtype), base)
        return xpos_scale(positions.pos, self.xpos_decay, base, inverse=key)

    def rotate(self, q, k, q_positions, k_positions):
        q_len = k_len = None
        if self.rotates_cached_keys:
            if q_positions is k_positions:
                (q_len,) = sequence_lengths(q_positions)
                k_len = q_len
            else:
                q_len, k_len = sequence_lengths(q_positions, k_positions)
        il = self.config.interleaved
        q_scale = self._xpos(q_positions, q.dtype, key=False)
        k_scale = self._xpos(k_positions, k.dtype, key=True)
        q = apply_rope(q, self._angles(q_positions, q_len), interleaved=il, scale=q_scale)
        k = apply_rope(k, self._angles(k_positions, k_len), interleaved=il, scale=k_scale)
        if self.attention_factor != 1.0:
            q = ops.cast(ops.cast(q, "float32") * self.attention_factor, q.dtype)
            k = ops.cast(ops.cast(k, "float32") * self.attention_factor, k.dtype)
        return q, k
