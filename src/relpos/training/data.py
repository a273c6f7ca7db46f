"""Chorales as token sequences for training and evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data import ChoraleSplits, allowed_shifts, encode, load_chorales, transpose

__all__ = ["TokenData", "load_token_data"]


@dataclass(frozen=True)
class TokenData:
    """Encoded chorales. ``train`` holds every allowed transposition of every training chorale
    (augmentation, training only); ``valid`` and ``test`` hold the chorales as written."""

    train: list[np.ndarray]
    valid: list[np.ndarray]
    test: list[np.ndarray]
    splits: ChoraleSplits

    def split(self, name: str) -> list[np.ndarray]:
        if name not in ("train", "valid", "test"):
            raise ValueError(f"split must be 'train', 'valid' or 'test', got {name!r}")
        return getattr(self, name)


def load_token_data(source: str, *, max_shift: int, progress: bool = True) -> TokenData:
    """Load chorales (``"music21"`` or a JSB JSON path) and encode them, augmenting training."""
    splits = load_chorales(None if source == "music21" else source, progress=progress)
    train = []
    for chorale in splits.train:
        shifts = allowed_shifts(chorale, max_shift) if max_shift else np.array([0])
        train += [encode(transpose(chorale, int(s))) for s in (shifts if shifts.size else [0])]
    return TokenData(
        train=train,
        valid=[encode(c) for c in splits.valid],
        test=[encode(c) for c in splits.test],
        splits=splits,
    )
