"""The Music Transformer's relative attention (Huang et al., 2018)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, check_int, register_config

__all__ = ["MusicConfig"]


@register_config
@dataclass(frozen=True)
class MusicConfig(SchemeConfig):
    """Args:
    max_distance: the largest ``|k_pos - q_pos|`` with its own embedding. Farther pairs use the
        embedding at ``±max_distance`` (clipping, as in Shaw et al.), so any length runs.
    """

    name = "music"
    max_distance: int = 1024

    def validate(self) -> None:
        check_int("max_distance", self.max_distance, minimum=0)
