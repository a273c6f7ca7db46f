"""Rotary position embedding's config, checks and constant tables (RoFormer, Su et al., 2021,
§3.4; long-context scalings; xPos; M-RoPE and axial sections), in numpy.

Tables: the frequency ladder ``θ^(-2m/r)`` (:func:`rope_frequencies`), one ladder per axis
(:func:`axial_frequencies`), a config's frequencies and attention factor
(:meth:`RotaryConfig.frequencies`) and xPos's per-pair decay ``ζ_m`` (:func:`xpos_decay`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import (
    SchemeConfig,
    check_bool,
    check_int,
    check_positive_float,
    register_config,
)
from .rope_scaling import (
    LENGTH_DEPENDENT,
    check_rope_scaling,
    longrope_factors,
    scaled_rope_frequencies,
)

__all__ = [
    "RotaryConfig",
    "axial_frequencies",
    "check_sections",
    "check_xpos_position",
    "rope_frequencies",
    "split_mrope_scaling",
    "xpos_decay",
    "xpos_max_position",
]

_XPOS_GAMMA = 0.4  # ζ's offset in the xPos paper
#: The largest finite value of each float dtype, by name (numpy has no bfloat16).
_FLOAT_MAX = {
    "float16": float(np.finfo(np.float16).max),
    "bfloat16": 3.3895313892515355e38,
    "float32": float(np.finfo(np.float32).max),
    "float64": float(np.finfo(np.float64).max),
}


def rope_frequencies(rotary_dim: int, theta: float = 10000.0) -> np.ndarray:
    """Inverse frequencies ``θ^(-2m/r)``, float32 ``(r/2,)`` (computed in float32)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (np.float32(theta) ** (-exponent)).astype(np.float32)


def check_sections(sections: Any, rotary_dim: int | None = None) -> tuple[int, ...]:
    """Validate rotary pairs per axis and return them as a tuple (JSON gives lists).

    Args:
        sections: one positive int per axis, the number of rotary pairs that read it.
        rotary_dim: the rotated features ``r``, if known: the sections must sum to ``r/2``.
    """
    if isinstance(sections, str | bytes) or not isinstance(sections, Sequence):
        raise TypeError(f"sections must be a list of ints (pairs per axis), got {sections!r}")
    out = tuple(sections)
    if not out or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in out):
        raise ValueError(f"sections must be positive ints, one per axis, got {list(out)}")
    if rotary_dim is not None and 2 * sum(out) != rotary_dim:
        raise ValueError(
            f"sections {list(out)} hold {sum(out)} rotary pairs, but rotary_dim {rotary_dim} has "
            f"{rotary_dim // 2}: they must sum to rotary_dim / 2"
        )
    return out


def split_mrope_scaling(scaling: Any) -> tuple[Any, tuple[int, ...] | None]:
    """Split a pasted Qwen2-VL ``rope_scaling`` / ``rope_parameters`` dict into the scaling proper
    and its ``mrope_section``.

    Checkpoints write M-RoPE as ``{"type": "mrope", "mrope_section": [16, 24, 24]}`` (config
    files of transformers 4) or ``{"rope_type": "default", "mrope_section": [...], ...}``
    (transformers 5). ``"mrope"`` names the unscaled ladder, so it becomes ``"default"``.

    Returns:
        ``(scaling, sections)``: the dict without ``mrope_section``, and the sections; anything
        else (no dict, no ``mrope_section``) comes back as is, with ``None``.
    """
    if not isinstance(scaling, dict) or "mrope_section" not in scaling:
        return scaling, None
    rest = {k: v for k, v in scaling.items() if k != "mrope_section"}
    for key in ("rope_type", "type"):
        if rest.get(key) == "mrope":
            rest[key] = "default"
    return rest, check_sections(scaling["mrope_section"])


def axial_frequencies(sections: Sequence[int], theta: float) -> np.ndarray:
    """One full ladder per axis: ``θ^(-2m/(2S))`` for ``m < S``, ``S`` the axis' pairs.

    Returns:
        float32 ``(r/2,)``, ``r/2 = sum(sections)``, the sections one after another.
    """
    return np.concatenate([rope_frequencies(2 * s, theta) for s in sections])


def xpos_decay(rotary_dim: int) -> np.ndarray:
    """xPos's ``ζ_m = (2m/r + 0.4)/1.4`` per rotated pair, float32 ``(r/2,)`` (Sun et al., 2022,
    §3.2)."""
    m = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    return ((m + _XPOS_GAMMA) / (1 + _XPOS_GAMMA)).astype(np.float32)


def xpos_max_position(dtype: str, scale_base: float) -> int:
    """The largest position whose xPos scales stay within ``dtype``'s range (a name:
    ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``) with room to spare:
    ``ζ_0^(±p/γ)`` between ``1/√max`` and ``√max`` (so scaled queries and keys neither overflow
    nor lose precision to underflow); ``ζ_0 = 0.4/1.4`` whatever the width."""
    name = str(dtype).removeprefix("torch.")
    if name not in _FLOAT_MAX:
        raise ValueError(f"xPos runs in {sorted(_FLOAT_MAX)}, got dtype {dtype}")
    room = np.log(_FLOAT_MAX[name]) / 2
    return int(room * scale_base / -np.log(_XPOS_GAMMA / (1 + _XPOS_GAMMA)))


def check_xpos_position(largest: int, dtype: Any, scale_base: float) -> None:
    """Raise a ``ValueError`` if a position of magnitude ``largest`` is beyond
    :func:`xpos_max_position` for ``dtype`` (a torch dtype or a dtype name, as Keras gives it):
    its xPos scales would overflow."""
    limit = xpos_max_position(str(dtype), scale_base)
    if largest > limit:
        # Advise only what reaches the position: a dtype of wider range, or the scale base.
        wider = [n for n in _FLOAT_MAX if xpos_max_position(n, scale_base) >= largest]
        base = math.ceil(scale_base * largest / max(limit, 1))
        advice = f"use {' or '.join(wider)}, or " if wider else ""
        raise ValueError(
            f"xPos scales overflow {dtype} beyond position {limit} (xpos_scale_base={scale_base}); "
            f"got position {largest}: {advice}an xpos_scale_base of at least {base}"
        )


@register_config
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
        (:mod:`relpos.spec.rope_scaling`). Stored normalised, as sorted ``(key, value)``
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
        check_bool("interleaved", self.interleaved)
        if self.scaling is not None:
            given = dict(self.scaling) if isinstance(self.scaling, tuple) else self.scaling
            normal = check_rope_scaling(given, theta=self.theta)
            object.__setattr__(self, "scaling", tuple(sorted(normal.items())))
        if self.xpos_scale_base is not None:
            check_positive_float("xpos_scale_base", self.xpos_scale_base)
        check_bool("learned_freq", self.learned_freq)
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
        check_bool("axial", self.axial)
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

    def rotated(self, head_dim: int) -> int:
        """``r``: the features of each head that rotate."""
        return head_dim if self.rotary_dim is None else self.rotary_dim

    def validate_dims(self, *, num_heads: int, head_dim: int, causal: bool) -> None:
        super().validate_dims(num_heads=num_heads, head_dim=head_dim, causal=causal)
        r = self.rotated(head_dim)
        if r > head_dim or r % 2:
            raise ValueError(f"rotary_dim must be even and <= head_dim ({head_dim}), got {r}")
        if self.xpos_scale_base is not None and not causal:
            raise ValueError(
                "xPos needs causal attention: its scale ζ^((n-m)/γ) grows without bound for keys "
                "after the query"
            )
        if self.sections is not None:
            check_sections(self.sections, r)
        scaling = self.scaling_dict
        if scaling is not None and scaling["rope_type"] == "longrope":
            longrope_factors(r, scaling)

    def frequencies(self, head_dim: int) -> tuple[np.ndarray, float]:
        """``(ω', attention_factor)``: the frequencies ``(r/2,)`` float32 of every rotated pair
        (scaled; per axis with ``sections``: the axial ladders or M-RoPE's share of one) and the
        factor on q and k (1 except for YaRN and LongRoPE). For a length-dependent scaling,
        those of sequences up to ``original_max_position_embeddings``."""
        r = self.rotated(head_dim)
        inv, factor = scaled_rope_frequencies(r, self.theta, self.scaling_dict)
        if self.sections is not None and self.axial:
            inv = axial_frequencies(check_sections(self.sections, r), self.theta)
        return inv, factor
