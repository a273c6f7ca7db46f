"""KERPLE, kernelized relative positional embeddings (Chi et al., 2022, §4): config."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, check_heads_field, register_config

__all__ = ["KERPLE_EPS", "KERPLE_VARIANTS", "KerpleConfig"]

#: The kernels: ``-r1·log(1 + r2·|Δ|)`` and ``-r1·|Δ|^r2``.
KERPLE_VARIANTS = ("log", "power")
#: The smallest ``r1``, ``r2`` at use (and above which they are initialised).
KERPLE_EPS = 1e-2


@register_config
@dataclass(frozen=True)
class KerpleConfig(SchemeConfig):
    """Args:
    variant: ``"log"`` (``-r1·log(1 + r2·|Δ|)``, the paper's better extrapolator) or ``"power"``
        (``-r1·|Δ|^r2``).
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "kerple"
    variant: str = "log"
    heads: tuple[int, ...] | None = None

    def validate(self) -> None:
        if self.variant not in KERPLE_VARIANTS:
            raise ValueError(f"variant must be one of {KERPLE_VARIANTS}, got {self.variant!r}")
        object.__setattr__(self, "heads", check_heads_field(self.heads))
