"""RoPE scalings for long contexts: each ``rope_type``'s keys, their checks, and the static
frequencies and attention factor, in numpy.

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
``dynamic``   for a sequence of length ``n > L``: base ``θ·(factor·n/L - factor + 1)^(r/(r-2))``;
              plain RoPE up to ``L`` (dynamic NTK; emozilla, 2023)
``longrope``  ``ω_m / short_factor[m]`` for sequences up to ``L``, ``ω_m / long_factor[m]``
              beyond; q and k scaled by ``√(1 + ln(factor)/ln(L))`` (Ding et al., 2024,
              "LongRoPE"; Phi-3)
============  ==============================================================================

``L`` is ``original_max_position_embeddings``. The first four are static: every row and every
cached key sees the same frequencies. ``dynamic`` and ``longrope`` depend on the length ``n`` of
each token's own sequence: each framework computes those per token
(:func:`relpos.functional.rope_scaling.sequence_rope_frequencies`, its Keras twin) from the
values checked here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import check_bool, check_int, check_positive_float

__all__ = [
    "LENGTH_DEPENDENT",
    "ROPE_TYPES",
    "check_rope_scaling",
    "longrope_factors",
    "ntk_power",
    "rope_ladder",
    "scaled_rope_frequencies",
]

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
    "dynamic": (("factor", "original_max_position_embeddings"), {}),
    "longrope": (
        ("short_factor", "long_factor", "original_max_position_embeddings"),
        {"factor": None, "attention_factor": None, "max_position_embeddings": None},
    ),
}
#: Types whose frequencies depend on the length of each token's sequence.
LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})
_LISTS = ("short_factor", "long_factor")
_LENGTHS = ("original_max_position_embeddings", "max_position_embeddings")
_FLAGS = ("truncate",)
_IGNORED = ("rope_theta", "partial_rotary_factor")


def _check_key(key: str, value: Any) -> Any:
    """One key's value, typed and range-checked (a length an int >= 1, a flag a bool, a list of
    factors positive numbers, any other number finite and > 0); returned normalised."""
    if key in _LISTS:  # stored as tuples: the config stays hashable
        if not isinstance(value, list | tuple) or not value:
            raise ValueError(f"{key} must be a non-empty list of numbers, got {value!r}")
        for m, v in enumerate(value):
            check_positive_float(f"{key}[{m}]", v)
        return tuple(float(v) for v in value)
    if key in _LENGTHS:
        check_int(key, value, minimum=1)
        return value
    if key in _FLAGS:
        check_bool(key, value)
        return bool(value)
    check_positive_float(key, value)
    return value


def _rope_type(scaling: dict[str, Any]) -> Any:
    """The scaling's ``rope_type`` (HF's older ``type`` accepted); both given must agree."""
    kind, old = scaling.get("rope_type"), scaling.get("type")
    if kind is not None and old is not None and kind != old:
        raise ValueError(
            f"rope_type {kind!r} and type {old!r} disagree: give one (type is HF's older name)"
        )
    return kind if kind is not None else old


def check_rope_scaling(scaling: dict[str, Any], *, theta: float) -> dict[str, Any]:
    """Validate a ``rope_scaling`` dict and return it normalised: ``rope_type`` set (HF's older
    ``type`` accepted), optional keys filled with their defaults.

    ``rope_theta`` may appear (HF v5 puts it there) but must equal ``theta``;
    ``partial_rotary_factor`` must be 1 (set ``rotary_dim`` instead). Every key is typed and
    range-checked: lengths are ints ``>= 1``, ``truncate`` a bool, every other number finite and
    ``> 0``; YaRN's ``beta_fast`` must exceed ``beta_slow``, Llama 3's ``high_freq_factor`` its
    ``low_freq_factor``.
    """
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a dict (a checkpoint's rope_scaling), got {scaling!r}")
    kind = _rope_type(scaling)
    s = {k: v for k, v in scaling.items() if k not in ("rope_type", "type")}
    if kind not in ROPE_TYPES:
        raise ValueError(f"unknown rope_type {kind!r}; supported: {sorted(ROPE_TYPES)}")
    if "rope_theta" in s:
        given = s.pop("rope_theta")
        check_positive_float("rope_theta", given)
        if float(given) != float(theta):
            raise ValueError(f"rope_theta in scaling ({given}) differs from theta ({theta})")
    partial = s.pop("partial_rotary_factor", 1.0)
    check_positive_float("partial_rotary_factor", partial)
    if float(partial) != 1.0:
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
    out = {k: _check_key(k, s[k]) for k in required}
    for k, default in optional.items():
        value = default if s.get(k) is None else s[k]  # None (JSON null): the default
        out[k] = None if value is None else _check_key(k, value)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(
            f"high_freq_factor ({out['high_freq_factor']}) must exceed low_freq_factor "
            f"({out['low_freq_factor']})"
        )
    if kind == "yarn" and not out["beta_fast"] > out["beta_slow"]:
        raise ValueError(
            f"beta_fast ({out['beta_fast']}) must exceed beta_slow ({out['beta_slow']}): the "
            "fast rotations' bound (kept) comes before the slow ones' (interpolated)"
        )
    if kind == "yarn" and not float(theta) > 1:
        raise ValueError(
            f"rope_type 'yarn' needs theta > 1 (its ramp divides by ln θ), got {theta}"
        )
    if kind == "longrope" and out["original_max_position_embeddings"] < 2:
        raise ValueError(
            "rope_type 'longrope' needs original_max_position_embeddings >= 2 (its attention "
            f"scale divides by its log), got {out['original_max_position_embeddings']}"
        )
    if kind == "longrope" and all(out[k] is None for k in optional):
        raise ValueError(
            "rope_type 'longrope' needs factor, attention_factor or max_position_embeddings "
            "(the attention scale √(1 + ln(factor)/ln(original_max_position_embeddings)) "
            "comes from factor = max_position_embeddings / original_max_position_embeddings)"
        )
    return {"rope_type": kind, **out}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def ntk_power(rotary_dim: int) -> float:
    """``r/(r-2)``: NTK's base grows by ``factor`` to this power. With one pair (``r = 2``) the
    base is moot (``ω_0 = θ^0 = 1``), so any finite power does."""
    return rotary_dim / (rotary_dim - 2) if rotary_dim > 2 else 0.0


def rope_ladder(rotary_dim: int) -> np.ndarray:
    """Exponents ``2m/r`` of the frequency ladder, float64 ``(r/2,)``."""
    return np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim


def longrope_factors(rotary_dim: int, scaling: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """LongRoPE's short and long per-pair factors, float64 ``(r/2,)`` each; a clear error when
    their length is not one per rotated pair."""
    factors = []
    for key in _LISTS:
        values = scaling[key]
        if len(values) != rotary_dim // 2:
            raise ValueError(
                f"{key} has {len(values)} entries; rotary_dim {rotary_dim} needs one per rotated "
                f"pair ({rotary_dim // 2})"
            )
        factors.append(np.asarray(values, dtype=np.float64))
    return factors[0], factors[1]


def scaled_rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[np.ndarray, float]:
    """The inverse frequencies ``(r/2,)`` float32 of a scaled RoPE and its attention factor (the
    scale applied to both q and k; 1 except for YaRN and LongRoPE), computed in float64.

    ``scaling``: a dict normalised by :func:`check_rope_scaling`, or None. For a length-dependent
    type (``dynamic``, ``longrope``) these are the frequencies of sequences up to
    ``original_max_position_embeddings``.
    """
    exponent = rope_ladder(rotary_dim)
    inv = float(theta) ** (-exponent)
    kind = "default" if scaling is None else scaling["rope_type"]
    factor = 1.0 if scaling is None else float(scaling.get("factor") or 1.0)
    attention = 1.0
    if kind == "linear":
        inv = inv / factor
    elif kind == "ntk":
        inv = (theta * factor ** ntk_power(rotary_dim)) ** (-exponent)
    elif kind == "llama3":
        length = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv
        smooth = np.clip((length / wavelength - low) / (high - low), 0.0, 1.0)
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
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)  # ramp 0: fast dims kept; 1: interpolated
        attention = scaling["attention_factor"]
        if attention is None:
            m, m_all = scaling["mscale"], scaling["mscale_all_dim"]
            attention = (
                _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
                if m and m_all
                else _yarn_mscale(factor)
            )
    elif kind == "longrope":
        inv = inv / longrope_factors(rotary_dim, scaling)[0]
        length = scaling["original_max_position_embeddings"]
        attention = scaling["attention_factor"]
        if attention is None:
            if scaling["factor"] is None:
                factor = scaling["max_position_embeddings"] / length
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(length))
    return np.asarray(inv, dtype=np.float32), float(attention)
