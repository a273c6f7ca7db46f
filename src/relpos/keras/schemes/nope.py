"""NoPE in Keras: no positional term."""

from __future__ import annotations

from .base import AttentionScheme, register

__all__ = ["NoPositions"]


@register
class NoPositions(AttentionScheme):
    """NoPE: no positional term; with a causal mask a decoder still infers order."""

    scheme_name = "nope"
