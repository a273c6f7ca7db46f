"""``RotaryEmbedding``: RoPE as a standalone Keras layer, keras-hub compatible, per row."""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from ..spec.rope_scaling import check_rope_scaling, scaled_rope_frequencies
from .ops import apply_rope, rope_angles
from .positions import (
    SameShapeLayer,
    check_finite_positive,
    dense_and_mask,
    restore_ragged,
    token_positions,
)

__all__ = ["RotaryEmbedding"]

#: keras-hub's ``rope_type`` values (``keras_hub.layers.RotaryEmbedding``).
ROPE_TYPES = ("linear", "dynamic", "yarn")


@keras.saving.register_keras_serializable(package="relpos")
class RotaryEmbedding(SameShapeLayer):
    """Rotate feature pairs by ``p·ω_k``, ``ω_k = max_wavelength^(-2k/r)`` (Su et al., 2021,
    §3.4), scaled as keras-hub's ``rope_type`` says.

    Takes ``keras_hub.layers.RotaryEmbedding``'s arguments, in its order, and gives its numbers
    (so its configs load with ``from_config``); relpos adds ``interleaved`` and ``rotary_dim``.

    Args:
        max_wavelength: the frequency base θ.
        scaling_factor: the scaling's factor ``s`` (1: none).
        rope_type: keras-hub's scaling. ``"linear"``: ``ω_k / s`` (position interpolation).
            ``"dynamic"``: ``ω_k / s^(r/(r-2))``, every pair alike (keras-hub's formula: static,
            unlike the ``rope`` scheme's length-dependent ``dynamic``). ``"yarn"``: the ``rope``
            scheme's ``yarn`` scaling (``factor`` ``s``, ``beta_fast``, ``beta_slow``,
            ``original_max_position_embeddings``, ``truncate``), the rotated pairs × keras-hub's
            ``0.1·ln(s) + 1``.
        beta_fast, beta_slow, original_max_position_embeddings, truncate: YaRN's, read only with
            ``rope_type="yarn"`` (as keras-hub).
        sequence_axis, feature_axis: where tokens and features are in the input.
        denominator_dim: the ladder's denominator, ``ω_k = max_wavelength^(-2k/denominator_dim)``
            (default ``r``); keras-hub's, for ``"linear"`` and ``"dynamic"``.
        interleaved: pair ``(x[2k], x[2k+1])`` (RoFormer, GPT-J) instead of the half-split
            ``(x[k], x[k + r/2])`` (GPT-NeoX, Llama, keras-hub).
        rotary_dim: how many leading features rotate (``r``; even; default all), the rest pass.

    Call arguments:
        inputs: e.g. ``(b, n, h, d)``; batch first.
        start_index, positions, mask, segment_ids: per-row positions, as
            :class:`~relpos.keras.PositionEmbedding`; ``positions`` may also be floats, as
            keras-hub's: a fractional position rotates by its own angle.

    Returns:
        ``inputs`` rotated, same shape and dtype (rotation in float32).
    """

    def __init__(
        self,
        max_wavelength: float = 10000,
        scaling_factor: float = 1.0,
        rope_type: str = "linear",
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        original_max_position_embeddings: int = 4096,
        truncate: bool = True,
        sequence_axis: int = 1,
        feature_axis: int = -1,
        denominator_dim: int | None = None,
        interleaved: bool = False,
        rotary_dim: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (
            ("max_wavelength", max_wavelength),
            ("scaling_factor", scaling_factor),
            ("beta_fast", beta_fast),
            ("beta_slow", beta_slow),
            ("original_max_position_embeddings", original_max_position_embeddings),
        ):
            check_finite_positive(name, value)
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type must be one of {ROPE_TYPES} (keras-hub's), got {rope_type!r}"
            )
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate must be a bool, got {truncate!r}")
        if rotary_dim is not None and (
            isinstance(rotary_dim, bool)
            or not isinstance(rotary_dim, int)
            or rotary_dim < 2
            or rotary_dim % 2
        ):
            raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
        if denominator_dim is not None and (
            isinstance(denominator_dim, bool)
            or not isinstance(denominator_dim, int)
            or denominator_dim < 1
        ):
            raise ValueError(f"denominator_dim must be a positive int, got {denominator_dim!r}")
        if rope_type == "yarn" and denominator_dim is not None:
            raise ValueError(
                f"denominator_dim ({denominator_dim}) is not read with rope_type='yarn' "
                "(keras-hub ignores it there): leave it None"
            )
        self.max_wavelength, self.scaling_factor = max_wavelength, scaling_factor
        self.rope_type, self.beta_fast, self.beta_slow = rope_type, beta_fast, beta_slow
        self.original_max_position_embeddings = original_max_position_embeddings
        self.truncate, self.denominator_dim = truncate, denominator_dim
        self.sequence_axis, self.feature_axis = sequence_axis, feature_axis
        self.interleaved, self.rotary_dim = bool(interleaved), rotary_dim
        self._yarn = None
        if rope_type == "yarn":
            self._yarn = check_rope_scaling(
                {
                    "rope_type": "yarn",
                    "factor": float(scaling_factor),
                    "original_max_position_embeddings": original_max_position_embeddings,
                    "beta_fast": float(beta_fast),
                    "beta_slow": float(beta_slow),
                    "truncate": truncate,
                },
                theta=float(max_wavelength),
            )
        self.supports_masking = True

    def _frequencies(self, r: int):
        """``ω`` ``(r/2,)`` float32 and the factor on the rotated pairs (1 except for YaRN)."""
        theta, s = float(self.max_wavelength), float(self.scaling_factor)
        if self._yarn is not None:  # keras-hub's attention factor, for any s (relpos's: s > 1)
            inv, _ = scaled_rope_frequencies(r, theta, self._yarn)
            return ops.convert_to_tensor(inv, dtype="float32"), 0.1 * math.log(s) + 1.0
        denominator = r if self.denominator_dim is None else self.denominator_dim
        inv = ops.power(theta, -ops.arange(0, r, 2, dtype="float32") / denominator)
        if self.rope_type == "dynamic":  # keras-hub: s^(r/(r-2)) on every pair
            s = s ** (r / max(1, r - 2))
        return inv / s, 1.0

    def call(self, inputs, start_index=0, positions=None, mask=None, segment_ids=None):
        inputs, mask, lengths = dense_and_mask(inputs, mask)  # ragged: tokens on axis 1
        rank = len(inputs.shape)
        seq, feat = self.sequence_axis % rank, self.feature_axis % rank
        if rank < 3 or seq == feat or 0 in (seq, feat):
            raise ValueError(
                f"inputs must have rank >= 3 with distinct, non-batch sequence_axis "
                f"({self.sequence_axis}) and feature_axis ({self.feature_axis}); got shape "
                f"{tuple(inputs.shape)}"
            )
        x = ops.moveaxis(inputs, (seq, feat), (1, -1))
        d = x.shape[-1]
        r = d if self.rotary_dim is None else self.rotary_dim
        if d is None or r > d or r % 2:
            raise ValueError(f"the rotated features ({r}) must be even and <= the feature dim {d}")
        pos = self._positions(x, mask, segment_ids, positions, start_index)
        inv_freq, factor = self._frequencies(r)
        scale = None if factor == 1.0 else ops.convert_to_tensor(factor, dtype="float32")
        y = apply_rope(x, rope_angles(pos, inv_freq), interleaved=self.interleaved, scale=scale)
        return restore_ragged(ops.moveaxis(y, (1, -1), (seq, feat)), lengths)

    @staticmethod
    def _positions(x, mask, segment_ids, positions, start_index):
        """Positions ``(b|1, n)`` of the tokens of ``x`` ``(b, n, ..., r)``: int32, or float32
        for float ``positions`` (keras-hub's: a fractional position rotates by its own angle),
        checked as integer ones would be and 0 where ``mask`` marks padding."""
        if positions is not None:
            positions = ops.convert_to_tensor(positions)
        if positions is None or "float" not in keras.backend.standardize_dtype(positions.dtype):
            return token_positions(
                x, mask=mask, segment_ids=segment_ids, positions=positions, start_index=start_index
            ).pos
        p = token_positions(
            x, mask=mask, segment_ids=segment_ids, positions=ops.zeros_like(positions, "int32")
        )
        given = ops.cast(positions, "float32")
        if len(given.shape) == 1:
            given = ops.expand_dims(given, 0)
        return ops.where(p.valid, given, 0.0)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            max_wavelength=self.max_wavelength,
            scaling_factor=self.scaling_factor,
            rope_type=self.rope_type,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            original_max_position_embeddings=self.original_max_position_embeddings,
            truncate=self.truncate,
            sequence_axis=self.sequence_axis,
            feature_axis=self.feature_axis,
            denominator_dim=self.denominator_dim,
            interleaved=self.interleaved,
            rotary_dim=self.rotary_dim,
        )
        return config
