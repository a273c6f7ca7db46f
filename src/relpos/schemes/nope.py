"""NoPE: no positional information, an explicit scheme for comparisons."""

from __future__ import annotations

from ..spec.nope import NoPEConfig
from .base import Scheme, register

__all__ = ["NoPE", "NoPEConfig"]


@register
class NoPE(Scheme):
    """No positions at all: attention is permutation-equivariant apart from the causal mask
    (Kazemnejad et al., 2023, "The Impact of Positional Encoding on Length Generalization")."""

    config_class = NoPEConfig
    hooks = frozenset()
