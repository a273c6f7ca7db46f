"""Absolute position embeddings: sinusoidal (Vaswani et al., 2017, §3.5) and learned (Gehring et
al., 2017; Devlin et al., 2019)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional.sinusoidal import sinusoidal_table
from ..positions import Positions
from ..spec.absolute import LearnedAbsoluteConfig, SinusoidalConfig
from .base import Scheme, register

__all__ = ["LearnedAbsolute", "LearnedAbsoluteConfig", "Sinusoidal", "SinusoidalConfig"]


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

    def embed(self, positions: Positions) -> Tensor:
        c = self.config
        return sinusoidal_table(positions.pos, self.d_model, base=c.base, interleaved=c.interleaved)


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
