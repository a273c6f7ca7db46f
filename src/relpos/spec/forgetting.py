"""The Forgetting Transformer's forget gate (Lin et al., 2025): config."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, register_config

__all__ = ["ForgetGateConfig"]


@register_config
@dataclass(frozen=True)
class ForgetGateConfig(SchemeConfig):
    """No fields: one scalar gate per head and token, ``σ(w_h·x_t + b_h)`` (the paper's data-
    dependent "full" gate). Causal only."""

    name = "forgetting"
    causal_only = True
