"""Absolute schemes' configs and the sinusoid table (Vaswani et al., 2017, §3.5)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import SchemeConfig, check_bool, check_int, check_positive_float, register_config

__all__ = [
    "LearnedAbsoluteConfig",
    "SinusoidalConfig",
    "check_even_width",
    "sinusoid_frequencies",
    "sinusoidal_table",
]


def check_even_width(scheme: str, width: int) -> None:
    """A sin/cos table needs an even width ``d_model = h·d``: a ``ValueError`` naming the
    scheme."""
    if width % 2:
        raise ValueError(f"{scheme} needs an even d_model, got {width} (sin/cos pairs)")


def sinusoid_frequencies(dim: int, base: float = 10000.0) -> np.ndarray:
    """Angular frequencies ``base^(-2i/dim)``, float32 ``(dim/2,)`` (computed in float32)."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"dim must be a positive even number (sin/cos pairs), got {dim}")
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(base) ** (-exponent)).astype(np.float32)


def sinusoidal_table(
    pos: np.ndarray, dim: int, *, base: float = 10000.0, interleaved: bool = True
) -> np.ndarray:
    """Sinusoidal encodings of integer positions ``pos (...)``: float32 ``(..., dim)``.

    ``PE[p, 2i] = sin(p·ω_i)``, ``PE[p, 2i+1] = cos(p·ω_i)`` (``interleaved``, the paper's
    layout), or ``[sin(p·ω), cos(p·ω)]`` as two halves; angles in float32.
    """
    freqs = sinusoid_frequencies(dim, base)
    angles = np.asarray(pos).astype(np.float32)[..., None] * freqs
    sin, cos = np.sin(angles), np.cos(angles)
    if interleaved:
        return np.stack([sin, cos], axis=-1).reshape(*angles.shape[:-1], dim)
    return np.concatenate([sin, cos], axis=-1)


@register_config
@dataclass(frozen=True)
class SinusoidalConfig(SchemeConfig):
    """Args:
    base: wavelength base (10000 in the paper).
    interleaved: ``sin, cos, sin, cos, …`` (the paper) or ``[sin…, cos…]`` halves.
    """

    name = "sinusoidal"
    base: float = 10000.0
    interleaved: bool = True

    def validate(self) -> None:
        check_positive_float("base", self.base)
        check_bool("interleaved", self.interleaved)

    def validate_dims(self, *, num_heads: int, head_dim: int, causal: bool) -> None:
        super().validate_dims(num_heads=num_heads, head_dim=head_dim, causal=causal)
        check_even_width("sinusoidal encoding", num_heads * head_dim)


@register_config
@dataclass(frozen=True)
class LearnedAbsoluteConfig(SchemeConfig):
    """Args:
    max_len: number of positions in the table; a position ``>= max_len`` is an error.
    """

    name = "learned"
    max_len: int = 1024

    def validate(self) -> None:
        check_int("max_len", self.max_len, minimum=1)
