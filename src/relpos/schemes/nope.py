"""NoPE: no positional information, an explicit scheme for comparisons."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Scheme, SchemeConfig, register

__all__ = ["NoPE", "NoPEConfig"]


@dataclass(frozen=True)
class NoPEConfig(SchemeConfig):
    name = "nope"


@register
class NoPE(Scheme):
    """No positions at all: attention is permutation-equivariant apart from the causal mask
    (Kazemnejad et al., 2023, "The Impact of Positional Encoding on Length Generalization")."""

    config_class = NoPEConfig
    hooks = frozenset()
