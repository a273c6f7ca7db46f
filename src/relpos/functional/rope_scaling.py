"""RoPE scalings for long contexts: the frequencies and attention factor of each ``rope_type``.

A scaling is given as the dict language-model checkpoints ship (``rope_scaling`` /
``rope_parameters`` in a Hugging Face config), pasted as is:

============  ==============================================================================
rope_type     frequencies ``ω'_m`` from ``ω_m = θ^(-2m/r)``
============  ==============================================================================
``linear``    ``ω_m / factor`` (position interpolation; Chen et al., 2023)
``ntk``       base change ``θ' = θ·factor^(r/(r-2))`` ("NTK-aware" scaling; bloc97, 2023)
``yarn``      per frequency, between ``ω_m`` (fast rotations) and ``ω_m / factor`` (slow ones)
              on a linear ramp over dims ``[low, high]`` from ``beta_fast``/``beta_slow``;
              q and k scaled by ``0.1·ln(factor) + 1`` (Peng et al., 2023, "YaRN", §3)
``llama3``    wavelengths ``λ = 2π/ω`` below ``L/high_freq_factor`` kept, above
              ``L/low_freq_factor`` divided by ``factor``, smooth in between (Llama 3.1)
============  ==============================================================================

``L`` is ``original_max_position_embeddings``. Scalings are static: they do not depend on the
batch, so every row and every cached key sees the same frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["ROPE_TYPES", "check_rope_scaling", "scaled_rope_frequencies"]

#: Required and optional keys of each supported ``rope_type`` (optional ones with defaults).
ROPE_TYPES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "default": ((), {}),
    "linear": (("factor",), {}),
    "ntk": (("factor",), {}),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": None,
            "mscale_all_dim": None,
            "attention_factor": None,
            "truncate": True,
        },
    ),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        {},
    ),
}
#: Types checkpoints use that relpos does not compute yet: refused, never silently unscaled.
_NOT_YET = {
    "dynamic": "dynamic NTK depends on each row's length",
    "longrope": "LongRoPE switches factors with the sequence length",
}
_IGNORED = ("rope_theta", "partial_rotary_factor")


def check_rope_scaling(scaling: dict[str, Any], *, theta: float) -> dict[str, Any]:
    """Validate a ``rope_scaling`` dict and return it normalised: ``rope_type`` set (HF's older
    ``type`` accepted), optional keys filled with their defaults.

    ``rope_theta`` may appear (HF v5 puts it there) but must equal ``theta``;
    ``partial_rotary_factor`` must be 1 (set ``rotary_dim`` instead).
    """
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a dict (a checkpoint's rope_scaling), got {scaling!r}")
    s = dict(scaling)
    kind = s.pop("rope_type", None) or s.pop("type", None)
    s.pop("type", None)
    if kind in _NOT_YET:
        raise ValueError(f"rope_type {kind!r} is not supported yet ({_NOT_YET[kind]})")
    if kind not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {kind!r}; supported: {sorted(ROPE_TYPES)}")
    if "rope_theta" in s and float(s.pop("rope_theta")) != float(theta):
        raise ValueError(
            f"rope_theta in scaling ({scaling['rope_theta']}) differs from theta ({theta})"
        )
    if float(s.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor is not read here: set rotary_dim instead")
    required, optional = ROPE_TYPES[kind]
    missing = [k for k in required if s.get(k) is None]
    if missing:
        raise ValueError(f"rope_type {kind!r} needs key(s) {missing}; got {sorted(scaling)}")
    unknown = sorted(set(s) - set(required) - set(optional) - set(_IGNORED))
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} for rope_type {kind!r}; valid: "
            f"{sorted([*required, *optional])}"
        )
    for k in required:
        if isinstance(s[k], bool) or not isinstance(s[k], int | float) or not s[k] > 0:
            raise ValueError(f"{k} must be a number > 0, got {s[k]!r}")
    if kind == "llama3" and not s["high_freq_factor"] > s["low_freq_factor"]:
        raise ValueError("high_freq_factor must exceed low_freq_factor")
    return {
        "rope_type": kind,
        **{k: s[k] for k in required},
        **{k: s.get(k, v) for k, v in optional.items()},
    }


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def scaled_rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[Tensor, float]:
    """The inverse frequencies ``(r/2,)`` float32 of a scaled RoPE and its attention factor (the
    scale applied to both q and k; 1 except for YaRN). ``scaling``: a dict normalised by
    :func:`check_rope_scaling`, or None."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv = theta ** (-exponent)
    kind = "default" if scaling is None else scaling["rope_type"]
    factor = 1.0 if scaling is None else float(scaling.get("factor", 1.0))
    attention = 1.0
    if kind == "linear":
        inv = inv / factor
    elif kind == "ntk":
        inv = (theta * factor ** (rotary_dim / (rotary_dim - 2))) ** (-exponent)
    elif kind == "llama3":
        length = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv
        smooth = ((length / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        inv = (1 - smooth) * inv / factor + smooth * inv  # smooth = 1: kept; 0: ÷ factor
    elif kind == "yarn":
        length = scaling["original_max_position_embeddings"]

        def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times
            return rotary_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = dim_of(scaling["beta_fast"]), dim_of(scaling["beta_slow"])
        if scaling["truncate"]:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        hi = hi + 0.001 if hi == lo else hi
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)  # ramp 0: fast dims kept; 1: interpolated
        attention = scaling["attention_factor"]
        if attention is None:
            m, m_all = scaling["mscale"], scaling["mscale_all_dim"]
            attention = (
                _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
                if m and m_all
                else _yarn_mscale(factor)
            )
    return inv.to(torch.float32), float(attention)
