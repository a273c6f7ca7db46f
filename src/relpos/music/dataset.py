"""Chorales as a :class:`~relpos.training.TokenDataset` for training and evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..training.dataset import TokenDataset
from ..training.windows import WindowGrid
from .augment import allowed_shifts, transpose
from .load import load_chorales
from .splits import NUM_VOICES, ChoraleSplits
from .tokens import PAD, encode

__all__ = ["CHORALE_GRID", "TokenData", "load_token_data"]

#: Windows of an encoded chorale start at BOS or at a soprano token (a whole time step).
CHORALE_GRID = WindowGrid(step=NUM_VOICES, head=1, pad=PAD)


@dataclass(frozen=True)
class TokenData(TokenDataset):
    """Encoded chorales. ``train`` holds every allowed transposition of every training chorale
    (augmentation, training only); ``valid`` and ``test`` hold the chorales as written."""

    splits: ChoraleSplits | None = None


def load_token_data(source: str, *, max_shift: int, progress: bool = True) -> TokenData:
    """Load chorales (``"music21"``, ``"jsb"`` or a JSB JSON path: :func:`load_chorales`) and
    encode them, augmenting training."""
    splits = load_chorales(source, progress=progress)
    train = []
    for chorale in splits.train:
        shifts = allowed_shifts(chorale, max_shift) if max_shift else np.array([0])
        train += [encode(transpose(chorale, int(s))) for s in (shifts if shifts.size else [0])]
    return TokenData(
        train=train,
        valid=[encode(c) for c in splits.valid],
        test=[encode(c) for c in splits.test],
        grid=CHORALE_GRID,
        splits=splits,
    )
