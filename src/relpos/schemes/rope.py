"""Rotary position embedding (Su et al., 2021, "RoFormer", §3.4), its long-context scalings,
xPos and learned frequencies."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional.rope import apply_rope, rope_angles
from ..functional.rope_axes import axis_angles, pair_axes
from ..functional.rope_scaling import sequence_rope_frequencies
from ..functional.xpos import check_xpos_position, xpos_decay, xpos_scale
from ..positions import Positions, sequence_lengths
from ..spec.rope import RotaryConfig
from .base import Scheme, register

__all__ = ["Rotary", "RotaryConfig"]


@register
class Rotary(Scheme):
    """Rotates queries and keys by angles ``p·ω_m`` (``ω_m = θ^(-2m/r)``, or a long-context
    scaling of it) from each token's own position, so ``q_i·k_j`` depends on ``p_j - p_i`` only.

    * Static scalings (linear, NTK, YaRN, Llama 3) and plain RoPE rotate keys once, before they
      enter the KV cache. YaRN and LongRoPE also scale q and k by their attention factor (logits by
      its square), as their papers and Hugging Face do.
    * Dynamic NTK and LongRoPE choose frequencies from the length of each token's own sequence
      (:func:`~relpos.sequence_lengths`: its document in a packed row, everything seen so far when
      decoding), not from the batch's longest row. Keys then enter the cache unrotated and are
      rotated at every call with the frequencies of their sequence's current length
      (``rotates_cached_keys``), so cached keys and new queries always agree: decoding step ``t``
      equals the full forward over the first ``t`` tokens of that row.
    * xPos multiplies pair ``m`` of a query at ``n`` by ``ζ_m^(n/γ)`` and of a key at ``n'`` by
      ``ζ_m^(-n'/γ)``. The scales grow exponentially with the position, so a position beyond
      :func:`~relpos.functional.xpos.xpos_max_position` for the input dtype is a ``ValueError``
      (checked on the data: one device sync per call).
    * With ``sections``, pair ``m`` turns by the coordinate of its axis instead,
      ``coords[axis(m)]·ω'_m`` (M-RoPE, axial RoPE: :mod:`relpos.functional.rope_axes`), so
      ``q_i·k_j`` depends on coordinate differences only.
    """

    config_class = RotaryConfig
    hooks = frozenset({"rotate"})

    def __init__(self, config: RotaryConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        c = self.config
        r = c.rotated(self.head_dim)  # checked against head_dim and causal: validate_dims
        self.rotary_dim = r
        self.rotates_cached_keys = c.length_dependent
        inv_freq, self.attention_factor = c.frequencies(self.head_dim)
        inv_freq = torch.from_numpy(inv_freq)
        axes = None if c.sections is None else pair_axes(c.sections)
        self.register_buffer("pair_axis", axes, persistent=False)
        if c.learned_freq:
            self.inv_freq = nn.Parameter(inv_freq)
        else:
            self.register_buffer("inv_freq", inv_freq, persistent=False)
        if c.xpos_scale_base is not None:
            self.register_buffer("xpos_decay", xpos_decay(r), persistent=False)

    def _angles(self, positions: Positions, lengths: Tensor | None) -> Tensor:
        c = self.config
        if lengths is not None:
            inv = sequence_rope_frequencies(
                self.rotary_dim, c.theta, c.scaling_dict, lengths, dtype=self.inv_freq.dtype
            )
            return rope_angles(positions.pos, inv)
        if c.sections is None or positions.coords is None:
            return rope_angles(positions.pos, self.inv_freq)
        if positions.coords.shape[-1] != len(c.sections):
            raise ValueError(
                f"positions have {positions.coords.shape[-1]} coordinate axes, but the rope "
                f"sections {list(c.sections)} read {len(c.sections)}"
            )
        return axis_angles(positions.coords, self.inv_freq, self.pair_axis)

    def _xpos(self, positions: Positions, dtype: torch.dtype, *, key: bool) -> Tensor | None:
        base = self.config.xpos_scale_base
        if base is None:
            return None
        if len(positions):
            check_xpos_position(int(positions.pos.abs().max()), dtype, base)
        return xpos_scale(positions.pos, self.xpos_decay, base, inverse=key)

    def rotate(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> tuple[Tensor, Tensor]:
        il = self.config.interleaved
        if self.rotates_cached_keys:
            q_len, k_len = sequence_lengths(q_positions, k_positions)
        else:
            q_len = k_len = None
        q_scale = self._xpos(q_positions, q.dtype, key=False)
        k_scale = self._xpos(k_positions, k.dtype, key=True)
        q = apply_rope(q, self._angles(q_positions, q_len), interleaved=il, scale=q_scale)
        k = apply_rope(k, self._angles(k_positions, k_len), interleaved=il, scale=k_scale)
        if self.attention_factor != 1.0:
            q, k = q * self.attention_factor, k * self.attention_factor
        return q, k
