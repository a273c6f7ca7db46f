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
``dynamic``   for a sequence of length ``n > L``: base ``θ·(factor·n/L - factor + 1)^(r/(r-2))``;
              plain RoPE up to ``L`` (dynamic NTK; emozilla, 2023)
``longrope``  ``ω_m / short_factor[m]`` for sequences up to ``L``, ``ω_m / long_factor[m]``
              beyond; q and k scaled by ``√(1 + ln(factor)/ln(L))`` (Ding et al., 2024,
              "LongRoPE"; Phi-3)
============  ==============================================================================

``L`` is ``original_max_position_embeddings``. The first four are static: every row and every
cached key sees the same frequencies. ``dynamic`` and ``longrope`` depend on the length ``n`` of
each token's own sequence (:func:`sequence_rope_frequencies`): the rotary scheme then rotates
keys after they enter the KV cache, with the frequencies of the sequence's current length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LENGTH_DEPENDENT",
    "ROPE_TYPES",
    "check_rope_scaling",
    "ntk_power",
    "scaled_rope_frequencies",
    "sequence_rope_frequencies",
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
_IGNORED = ("rope_theta", "partial_rotary_factor")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


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
        if k in _LISTS:  # stored as tuples: the config stays hashable
            if not isinstance(s[k], list | tuple) or not s[k]:
                raise ValueError(f"{k} must be a non-empty list of numbers, got {s[k]!r}")
            for m, value in enumerate(s[k]):
                _check_positive(f"{k}[{m}]", value)
            s[k] = tuple(float(value) for value in s[k])
        else:
            _check_positive(k, s[k])
    if kind == "llama3" and not s["high_freq_factor"] > s["low_freq_factor"]:
        raise ValueError("high_freq_factor must exceed low_freq_factor")
    if kind == "longrope":
        given = [k for k in optional if s.get(k) is not None]
        if not given:
            raise ValueError(
                "rope_type 'longrope' needs factor, attention_factor or max_position_embeddings "
                "(the attention scale √(1 + ln(factor)/ln(original_max_position_embeddings)) "
                "comes from factor = max_position_embeddings / original_max_position_embeddings)"
            )
        for k in given:
            _check_positive(k, s[k])
    return {
        "rope_type": kind,
        **{k: s[k] for k in required},
        **{k: s.get(k, v) for k, v in optional.items()},
    }


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def ntk_power(rotary_dim: int) -> float:
    """``r/(r-2)``: NTK's base grows by ``factor`` to this power. With one pair (``r = 2``) the
    base is moot (``ω_0 = θ^0 = 1``), so any finite power does."""
    return rotary_dim / (rotary_dim - 2) if rotary_dim > 2 else 0.0


def _ladder(rotary_dim: int) -> Tensor:
    """Exponents ``2m/r`` of the frequency ladder, float64 ``(r/2,)``."""
    return torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim


def _longrope_factors(rotary_dim: int, scaling: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """LongRoPE's short and long per-pair factors, float64 ``(r/2,)`` each."""
    factors = []
    for key in _LISTS:
        values = scaling[key]
        if len(values) != rotary_dim // 2:
            raise ValueError(
                f"{key} has {len(values)} entries; rotary_dim {rotary_dim} needs one per rotated "
                f"pair ({rotary_dim // 2})"
            )
        factors.append(torch.tensor(values, dtype=torch.float64))
    return factors[0], factors[1]


def scaled_rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[Tensor, float]:
    """The inverse frequencies ``(r/2,)`` float32 of a scaled RoPE and its attention factor (the
    scale applied to both q and k; 1 except for YaRN and LongRoPE). ``scaling``: a dict normalised
    by :func:`check_rope_scaling`, or None. For a length-dependent type (``dynamic``,
    ``longrope``) these are the frequencies of sequences up to ``original_max_position_embeddings``;
    :func:`sequence_rope_frequencies` gives them per sequence length."""
    exponent = _ladder(rotary_dim)
    inv = theta ** (-exponent)
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
    elif kind == "longrope":
        inv = inv / _longrope_factors(rotary_dim, scaling)[0]
        length = scaling["original_max_position_embeddings"]
        attention = scaling["attention_factor"]
        if attention is None:
            if scaling["factor"] is None:
                factor = scaling["max_position_embeddings"] / length
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(length))
    return inv.to(torch.float32), float(attention)


def sequence_rope_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: dict[str, Any],
    lengths: Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-token inverse frequencies of a length-dependent scaling (``dynamic``, ``longrope``),
    from the length of each token's own sequence.

    Args:
        lengths: ``(b, n)`` int, the length of the sequence each token belongs to (its document in
            a packed row; everything seen so far when decoding).

    Returns:
        ``(b, n, r/2)`` in ``dtype`` (float32; float64 for a float64 model). Sequences up to
        ``original_max_position_embeddings`` get exactly :func:`scaled_rope_frequencies`.
    """
    kind = scaling["rope_type"]
    if kind not in LENGTH_DEPENDENT:
        raise ValueError(f"rope_type {kind!r} does not depend on the sequence length")
    exponent = _ladder(rotary_dim).to(lengths.device)
    original = scaling["original_max_position_embeddings"]
    n = lengths.to(torch.float64).unsqueeze(-1)  # (b, n, 1)
    long = n > original
    if kind == "dynamic":
        factor = scaling["factor"]
        # ln θ' = ln θ + r/(r-2)·ln(factor·n/L - factor + 1), for n > L (the argument is > 1)
        growth = (factor * n.clamp_min(original) / original - factor + 1).log()
        log_base = math.log(theta) + ntk_power(rotary_dim) * growth
        inv = torch.where(long, (-exponent * log_base).exp(), theta ** (-exponent))
    else:
        short_f, long_f = (f.to(lengths.device) for f in _longrope_factors(rotary_dim, scaling))
        inv = theta ** (-exponent) / torch.where(long, long_f, short_f)
    return inv.to(dtype)
