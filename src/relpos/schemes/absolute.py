"""Absolute position embeddings: sinusoidal (Vaswani et al., 2017, §3.5) and learned (Gehring et
al., 2017; Devlin et al., 2019)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..functional.sinusoidal import sinusoidal_table
from ..positions import Positions
from .base import Scheme, SchemeConfig, check_int, check_positive_float, register

__all__ = ["LearnedAbsolute", "LearnedAbsoluteConfig", "Sinusoidal", "SinusoidalConfig"]


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


@register
class Sinusoidal(Scheme):
    """Fixed sinusoidal absolute encoding of each token's own position; extrapolates to any length.

    Shapes:
        ``embed(positions)`` returns float32 ``(b|1, n, d_model)``; padding tokens read position 0.
    """

    config_class = SinusoidalConfig
    hooks = frozenset({"embed"})

    def __init__(self, config: SinusoidalConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        if self.d_model % 2:
            raise ValueError(f"sinusoidal encoding needs an even d_model, got {self.d_model}")

    def embed(self, positions: Positions) -> Tensor:
        c = self.config
        return sinusoidal_table(positions.pos, self.d_model, base=c.base, interleaved=c.interleaved)


@dataclass(frozen=True)
class LearnedAbsoluteConfig(SchemeConfig):
    """Args:
    max_len: number of positions in the table; a position ``>= max_len`` is an error.
    """

    name = "learned"
    max_len: int = 1024

    def validate(self) -> None:
        check_int("max_len", self.max_len, minimum=1)


@register
class LearnedAbsolute(Scheme):
    """A learned table of ``max_len`` absolute position embeddings.

    Shapes:
        ``embed(positions)`` returns ``(b|1, n, d_model)`` in the table's dtype.
    """

    config_class = LearnedAbsoluteConfig
    hooks = frozenset({"embed"})

    def __init__(self, config: LearnedAbsoluteConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        self.table = nn.Parameter(torch.empty(self.config.max_len, self.d_model))
        nn.init.normal_(self.table, std=0.02)

    def embed(self, positions: Positions) -> Tensor:
        pos = positions.pos
        if not torch.compiler.is_compiling() and pos.numel():
            top = int(pos.max())
            if top >= self.config.max_len:
                raise ValueError(
                    f"position {top} is past the learned table (max_len={self.config.max_len}); "
                    "use a larger max_len or a relative scheme"
                )
        return self.table[pos]
