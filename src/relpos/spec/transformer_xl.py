"""Transformer-XL's relative attention (Dai et al., 2019, §3.3): config and encoding table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .absolute import check_even_width, sinusoidal_table
from .base import SchemeConfig, check_int, register_config

__all__ = ["TransformerXLConfig"]


@register_config
@dataclass(frozen=True)
class TransformerXLConfig(SchemeConfig):
    """Args:
    max_distance: the largest ``|p_i - p_j|`` with its own encoding; farther pairs share the
        encoding at ``max_distance`` (Transformer-XL's ``clamp_len``), so any length runs.
    """

    name = "transformer_xl"
    max_distance: int = 1024

    def validate(self) -> None:
        check_int("max_distance", self.max_distance, minimum=0)

    def validate_dims(self, *, num_heads: int, head_dim: int, causal: bool) -> None:
        super().validate_dims(num_heads=num_heads, head_dim=head_dim, causal=causal)
        check_even_width("transformer_xl", num_heads * head_dim)

    def encodings(self, width: int, *, causal: bool) -> np.ndarray:
        """``R_{p_i - p_j}`` for each table row, float32 ``(R, width)``: rows for the distances
        ``p_j - p_i`` from ``-max_distance`` up to 0 (causal) or ``max_distance``, sinusoids in
        halves ``[sin, cos]``."""
        m = self.max_distance
        distances = np.arange(-m, (0 if causal else m) + 1)
        return sinusoidal_table(-distances, width, interleaved=False)
