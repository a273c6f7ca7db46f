"""What the trainer needs from a dataset: token sequences per split, and where windows start."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .windows import WindowGrid

__all__ = ["TokenDataset"]


@dataclass(frozen=True)
class TokenDataset:
    """Token sequences for next-token training (``train``) and evaluation (``valid``, ``test``).

    Any task fits: chorales (:func:`relpos.music.load_token_data`), synthetic sequences, text.
    ``grid`` says where a window may start and which id pads it.
    """

    train: list[np.ndarray]
    valid: list[np.ndarray]
    test: list[np.ndarray]
    grid: WindowGrid = field(default_factory=WindowGrid)

    def split(self, name: str) -> list[np.ndarray]:
        if name not in ("train", "valid", "test"):
            raise ValueError(f"split must be 'train', 'valid' or 'test', got {name!r}")
        return getattr(self, name)
