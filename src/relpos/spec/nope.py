"""NoPE: no positional term (a causal decoder still infers order from its mask)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, register_config

__all__ = ["NoPEConfig"]


@register_config
@dataclass(frozen=True)
class NoPEConfig(SchemeConfig):
    """No fields."""

    name = "nope"
