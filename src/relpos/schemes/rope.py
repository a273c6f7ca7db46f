"""Rotary position embedding (Su et al., 2021, "RoFormer", §3.4), its long-context scalings,
xPos and learned frequencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..functional.rope import apply_rope, rope_angles
from ..functional.rope_axes import (
    axis_angles,
    axis_frequencies,
    check_sections,
    pair_axes,
    split_mrope_scaling,
)
from ..functional.rope_scaling import (
    LENGTH_DEPENDENT,
    check_rope_scaling,
    scaled_rope_frequencies,
    sequence_rope_frequencies,
)
from ..functional.xpos import check_xpos_position, xpos_decay, xpos_scale
from ..positions import Positions, sequence_lengths
from .base import Scheme, SchemeConfig, check_int, check_positive_float, register

__all__ = ["Rotary", "RotaryConfig"]


@dataclass(frozen=True)
class RotaryConfig(SchemeConfig):
    """Args:
    theta: frequency base (10000 in the paper; 500000 in Llama 3).
    rotary_dim: how many leading features of each head rotate (even, ``<= head_dim``); ``None``
        rotates all of them. The rest pass through (partial rotary, as in GPT-NeoX).
    interleaved: pair ``(x[2k], x[2k+1])`` (the paper, GPT-J) instead of ``(x[k], x[k + r/2])``
        (half-split, GPT-NeoX and Llama).
    scaling: a long-context scaling as checkpoints ship it (a Hugging Face ``rope_scaling`` /
        ``rope_parameters`` dict, pasted as is): ``rope_type`` ``linear``, ``ntk``, ``yarn``,
        ``llama3``, ``dynamic`` or ``longrope`` and its keys
        (:mod:`relpos.functional.rope_scaling`). Stored normalised, as sorted ``(key, value)``
        pairs so the config stays hashable; ``to_dict`` gives a dict. A Qwen2-VL dict with
        ``mrope_section`` pastes too: the sections go to ``sections``.
    xpos_scale_base: xPos (Sun et al., 2022): scale q and k so that their product decays as
        ``ζ_m^((n-m)/γ)`` with ``γ`` this value (512 in the paper); causal attention only.
    learned_freq: make the frequencies a trained parameter, initialised to the (scaled) ladder.
    sections: rotary pairs per position axis, summing to ``rotary_dim / 2`` (M-RoPE's
        ``mrope_section``, e.g. ``(16, 24, 24)`` for time, height, width at head dim 128);
        section ``s`` turns by coordinate ``s`` of :attr:`Positions.coords`
        (:mod:`relpos.functional.rope_axes`). With 1-D positions every axis reads ``pos``. The
        sections apply on top of a static ``scaling``; not with ``dynamic``, ``longrope`` or
        xPos. ``None``: one axis, plain RoPE.
    axial: each section gets its own full frequency ladder (axial 2-D/3-D RoPE for vision)
        instead of its share of one ladder (M-RoPE). Needs ``sections``; takes no ``scaling``.
    """

    name = "rope"
    theta: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: Any = None
    xpos_scale_base: float | None = None
    learned_freq: bool = False
    sections: tuple[int, ...] | None = None
    axial: bool = False

    @property
    def scaling_dict(self) -> dict[str, Any] | None:
        return None if self.scaling is None else dict(self.scaling)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "scaling": self.scaling_dict}

    def validate(self) -> None:
        scaling, pasted = split_mrope_scaling(self.scaling)
        if pasted is not None:
            if self.sections is not None and tuple(self.sections) != pasted:
                raise ValueError(
                    f"sections {list(self.sections)} differ from the scaling's mrope_section "
                    f"{list(pasted)}"
                )
            object.__setattr__(self, "scaling", scaling)
            object.__setattr__(self, "sections", pasted)
        check_positive_float("theta", self.theta)
        if self.rotary_dim is not None:
            check_int("rotary_dim", self.rotary_dim, minimum=2)
            if self.rotary_dim % 2:
                raise ValueError(
                    f"rotary_dim must be even (features rotate in pairs), got {self.rotary_dim}"
                )
        if self.scaling is not None:
            given = dict(self.scaling) if isinstance(self.scaling, tuple) else self.scaling
            normal = check_rope_scaling(given, theta=self.theta)
            object.__setattr__(self, "scaling", tuple(sorted(normal.items())))
        if self.xpos_scale_base is not None:
            check_positive_float("xpos_scale_base", self.xpos_scale_base)
        if not isinstance(self.learned_freq, bool):
            raise TypeError(f"learned_freq must be a bool, got {self.learned_freq!r}")
        if self.learned_freq and self.length_dependent:
            raise ValueError(
                f"learned_freq cannot be combined with rope_type {self.scaling_dict['rope_type']!r}"
                " (its frequencies follow each sequence's length)"
            )
        self._validate_axes()

    def _validate_axes(self) -> None:
        """``sections`` and ``axial`` alone and with the other keys."""
        if self.sections is not None:
            object.__setattr__(self, "sections", check_sections(self.sections, self.rotary_dim))
        if not isinstance(self.axial, bool):
            raise TypeError(f"axial must be a bool, got {self.axial!r}")
        if self.axial and self.sections is None:
            raise ValueError("axial rope needs sections (rotary pairs per axis)")
        kind = None if self.scaling is None else self.scaling_dict["rope_type"]
        if self.axial and kind not in (None, "default"):
            raise ValueError(
                "axial rope takes no scaling (each axis has its own ladder); "
                f"got rope_type {kind!r}"
            )
        if self.sections is not None and self.length_dependent:
            raise ValueError(
                f"sections cannot be combined with rope_type {kind!r} (its frequencies follow "
                "each sequence's length)"
            )
        if self.sections is not None and self.xpos_scale_base is not None:
            raise ValueError("xPos is defined on one axis: it cannot be combined with sections")

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on each sequence's length (dynamic NTK, LongRoPE)."""
        return self.scaling is not None and self.scaling_dict["rope_type"] in LENGTH_DEPENDENT


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
        r = self.head_dim if c.rotary_dim is None else c.rotary_dim
        if r > self.head_dim or r % 2:
            raise ValueError(f"rotary_dim must be even and <= head_dim ({self.head_dim}), got {r}")
        if c.xpos_scale_base is not None and not self.causal:
            raise ValueError(
                "xPos needs causal attention: its scale ζ^((n-m)/γ) grows without bound for keys "
                "after the query"
            )
        self.rotary_dim = r
        self.rotates_cached_keys = c.length_dependent
        inv_freq, self.attention_factor = scaled_rope_frequencies(r, c.theta, c.scaling_dict)
        inv_freq = axis_frequencies(inv_freq, r, c.theta, c.sections, axial=c.axial)
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
