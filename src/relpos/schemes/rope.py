"""Rotary position embedding (Su et al., 2021, "RoFormer", §3.4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..functional.rope import apply_rope, rope_angles
from ..functional.rope_axes import (
    axis_angles,
    axis_frequencies,
    check_sections,
    pair_axes,
    split_mrope_scaling,
)
from ..functional.rope_scaling import check_rope_scaling, scaled_rope_frequencies
from ..positions import Positions
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
        ``rope_parameters`` dict, pasted as is): ``rope_type`` ``linear``, ``ntk``, ``yarn`` or
        ``llama3`` and its keys (:mod:`relpos.functional.rope_scaling`). Stored normalised, as
        sorted ``(key, value)`` pairs so the config stays hashable; ``to_dict`` gives a dict.
        A Qwen2-VL dict with ``mrope_section`` pastes too: the sections go to ``sections``.
    sections: rotary pairs per position axis, summing to ``rotary_dim / 2`` (M-RoPE's
        ``mrope_section``, e.g. ``(16, 24, 24)`` for time, height, width at head dim 128);
        section ``s`` turns by coordinate ``s`` of :attr:`Positions.coords`
        (:mod:`relpos.functional.rope_axes`). With 1-D positions every axis reads ``pos``. The
        sections apply on top of ``scaling``. ``None``: one axis, plain RoPE.
    axial: each section gets its own full frequency ladder (axial 2-D/3-D RoPE for vision)
        instead of its share of one ladder (M-RoPE). Needs ``sections``; takes no ``scaling``.
    """

    name = "rope"
    theta: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: Any = None
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
        if self.sections is not None:
            object.__setattr__(self, "sections", check_sections(self.sections, self.rotary_dim))
        if not isinstance(self.axial, bool):
            raise TypeError(f"axial must be a bool, got {self.axial!r}")
        if self.axial and self.sections is None:
            raise ValueError("axial rope needs sections (rotary pairs per axis)")
        if self.axial and self.scaling is not None and dict(self.scaling)["rope_type"] != "default":
            raise ValueError(
                "axial rope takes no scaling (each axis has its own ladder); "
                f"got rope_type {dict(self.scaling)['rope_type']!r}"
            )


@register
class Rotary(Scheme):
    """Rotates queries and keys by angles ``p·ω_k`` (``ω_k = θ^(-2k/r)``, or a long-context
    scaling of it) from each token's own position, so ``q_i·k_j`` depends on ``p_j - p_i`` only.
    Keys are rotated before they enter the KV cache. YaRN also scales q and k by its attention
    factor (logits by its square), as the paper and Hugging Face do. With ``sections``, pair ``m``
    turns by the coordinate of its axis instead, ``coords[axis(m)]·ω'_m`` (M-RoPE, axial RoPE:
    :mod:`relpos.functional.rope_axes`), so ``q_i·k_j`` depends on coordinate differences only.
    """

    config_class = RotaryConfig
    hooks = frozenset({"rotate"})

    def __init__(self, config: RotaryConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        c = self.config
        r = self.head_dim if c.rotary_dim is None else c.rotary_dim
        if r > self.head_dim or r % 2:
            raise ValueError(f"rotary_dim must be even and <= head_dim ({self.head_dim}), got {r}")
        self.rotary_dim = r
        inv_freq, self.attention_factor = scaled_rope_frequencies(r, c.theta, c.scaling_dict)
        inv_freq = axis_frequencies(inv_freq, r, c.theta, c.sections, axial=c.axial)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axes = None if c.sections is None else pair_axes(c.sections)
        self.register_buffer("pair_axis", axes, persistent=False)

    def rotate(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> tuple[Tensor, Tensor]:
        il = self.config.interleaved
        q = apply_rope(q, self.angles(q_positions), interleaved=il)
        k = apply_rope(k, self.angles(k_positions), interleaved=il)
        if self.attention_factor != 1.0:
            q, k = q * self.attention_factor, k * self.attention_factor
        return q, k

    def angles(self, positions: Positions) -> Tensor:
        """Angles ``(b|1, n, r/2)`` of every token and pair: ``pos·ω_m``, or with ``sections``
        and multi-axis positions ``coords[axis(m)]·ω'_m``."""
        sections = self.config.sections
        if sections is None or positions.coords is None:
            return rope_angles(positions.pos, self.inv_freq)
        if positions.coords.shape[-1] != len(sections):
            raise ValueError(
                f"positions have {positions.coords.shape[-1]} coordinate axes, but the rope "
                f"sections {list(sections)} read {len(sections)}"
            )
        return axis_angles(positions.coords, self.inv_freq, self.pair_axis)
