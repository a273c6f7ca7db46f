"""``RotaryEmbedding``: RoPE as a standalone Keras layer, keras-hub compatible, per row."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from .ops import apply_rope, rope_angles, rope_frequencies
from .positions import SameShapeLayer, dense_and_mask, restore_ragged, token_positions

__all__ = ["RotaryEmbedding"]


@keras.saving.register_keras_serializable(package="relpos")
class RotaryEmbedding(SameShapeLayer):
    """Rotate feature pairs by ``p·ω_k``, ``ω_k = (max_wavelength^(-2k/r)) / scaling_factor``
    (Su et al., 2021, §3.4; linear position scaling as keras-hub's ``rope_type="linear"``).

    Args:
        max_wavelength: the frequency base θ.
        scaling_factor: positions are divided by it (linear interpolation).
        sequence_axis, feature_axis: where tokens and features are in the input.
        interleaved: pair ``(x[2k], x[2k+1])`` (RoFormer, GPT-J) instead of the half-split
            ``(x[k], x[k + r/2])`` (GPT-NeoX, Llama, keras-hub).
        rotary_dim: how many leading features rotate (even; default all), the rest pass.

    Call arguments:
        inputs: e.g. ``(b, n, h, d)``; batch first.
        start_index, positions, mask, segment_ids: per-row positions, as
            :class:`~relpos.keras.PositionEmbedding`.

    Returns:
        ``inputs`` rotated, same shape and dtype (rotation in float32).
    """

    def __init__(
        self,
        max_wavelength: float = 10000,
        scaling_factor: float = 1.0,
        sequence_axis: int = 1,
        feature_axis: int = -1,
        interleaved: bool = False,
        rotary_dim: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (("max_wavelength", max_wavelength), ("scaling_factor", scaling_factor)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if rotary_dim is not None and (
            isinstance(rotary_dim, bool)
            or not isinstance(rotary_dim, int)
            or rotary_dim < 2
            or rotary_dim % 2
        ):
            raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
        self.max_wavelength, self.scaling_factor = max_wavelength, scaling_factor
        self.sequence_axis, self.feature_axis = sequence_axis, feature_axis
        self.interleaved, self.rotary_dim = bool(interleaved), rotary_dim
        self.supports_masking = True

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
        pos = token_positions(
            x, mask=mask, segment_ids=segment_ids, positions=positions, start_index=start_index
        ).pos
        inv_freq = rope_frequencies(r, float(self.max_wavelength)) / float(self.scaling_factor)
        y = apply_rope(x, rope_angles(pos, inv_freq), interleaved=self.interleaved)
        return restore_ragged(ops.moveaxis(y, (1, -1), (seq, feat)), lengths)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            max_wavelength=self.max_wavelength,
            scaling_factor=self.scaling_factor,
            sequence_axis=self.sequence_axis,
            feature_axis=self.feature_axis,
            interleaved=self.interleaved,
            rotary_dim=self.rotary_dim,
        )
        return config
