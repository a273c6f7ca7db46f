"""The common return type of every chorale loader: :class:`ChoraleSplits`.

A *chorale* is a ``numpy.int16`` array of shape ``(T, 4)``: one row per 16th-note step, columns
soprano, alto, tenor, bass (S, A, T, B), each entry the MIDI pitch sounding in that voice at that
step or ``-1`` (:data:`SILENCE`) when the voice is silent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = [
    "NUM_VOICES",
    "SILENCE",
    "SPLITS",
    "VOICE_NAMES",
    "ChoraleSplits",
    "SplitName",
    "check_chorale",
]

#: Value of a silent voice at a step.
SILENCE = -1
#: Number of voices (columns) of a chorale array.
NUM_VOICES = 4
#: Column names of a chorale array, in order.
VOICE_NAMES = ("soprano", "alto", "tenor", "bass")
#: Split names, in order.
SPLITS = ("train", "valid", "test")

SplitName = Literal["train", "valid", "test"]


def check_chorale(chorale: Any, name: str = "chorale") -> np.ndarray:
    """Validate one chorale and return it as a C-contiguous ``int16`` array of shape ``(T, 4)``.

    Accepts any integer array-like (a list of ``[S, A, T, B]`` steps works). ``T`` may be 0.

    Raises:
        TypeError: ``chorale`` is not an integer array-like.
        ValueError: wrong shape, or a value that is neither ``-1`` nor a MIDI pitch 0..127.
    """
    if isinstance(chorale, np.ndarray):
        arr = chorale
    else:
        try:
            arr = np.asarray(chorale)
        except (TypeError, ValueError) as exc:  # ragged nested lists
            raise ValueError(
                f"{name}: expected an array of shape (T, {NUM_VOICES}), got a ragged "
                f"{type(chorale).__name__} ({exc})"
            ) from None
    if arr.ndim != 2 or arr.shape[1] != NUM_VOICES:
        raise ValueError(
            f"{name}: expected shape (T, {NUM_VOICES}) (columns S, A, T, B), got shape "
            f"{tuple(arr.shape)}"
        )
    if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) gives float64
        arr = arr.astype(np.int16)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name}: expected an integer array (MIDI pitches, -1 = silent), got dtype {arr.dtype}"
        )
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < SILENCE or hi > 127:
            bad = arr[(arr < SILENCE) | (arr > 127)]
            raise ValueError(
                f"{name}: values must be -1 (silent) or MIDI pitches 0..127, got "
                f"{int(bad[0])} (range of values {lo}..{hi})"
            )
    return np.ascontiguousarray(arr, dtype=np.int16)


def _freeze(
    chorales: Sequence[Any], split: str, names: Sequence[Any], source: Any
) -> tuple[np.ndarray, ...]:
    out = []
    for i, c in enumerate(chorales):
        # The message names the chorale and where it came from, not only its index.
        label = f"{split}[{i}] ({names[i]!s}" + (f", from {source}" if source else "") + ")"
        # A view, so that making it read-only never flips the flag on the caller's array.
        arr = check_chorale(c, label).view()
        arr.flags.writeable = False
        out.append(arr)
    return tuple(out)


@dataclass(frozen=True, eq=False)  # arrays inside: compare contents explicitly
class ChoraleSplits:
    """Chorales of the train / valid / test splits, with their names.

    Every chorale is a read-only ``int16`` array of shape ``(T, 4)`` (see the module docstring);
    ``*_names[i]`` names ``*[i]``. Lists given to the constructor are stored as tuples, and each
    array is validated with :func:`check_chorale`.

    Attributes:
        train, valid, test: the chorales of each split.
        train_names, valid_names, test_names: one name per chorale (e.g. ``"bach/bwv66.6"`` for
            the music21 corpus, ``"train/000"`` for a JSON file).
        source: where the data came from, for logs (e.g. ``"music21 10.5.1 corpus"``).
    """

    train: tuple[np.ndarray, ...]
    valid: tuple[np.ndarray, ...]
    test: tuple[np.ndarray, ...]
    train_names: tuple[str, ...]
    valid_names: tuple[str, ...]
    test_names: tuple[str, ...]
    source: str = ""

    def __post_init__(self) -> None:
        for split in SPLITS:
            chorales = getattr(self, split)
            names = getattr(self, f"{split}_names")
            if isinstance(chorales, np.ndarray) or not isinstance(chorales, Sequence):
                raise TypeError(
                    f"ChoraleSplits.{split}: expected a sequence of (T, 4) arrays, got "
                    f"{type(chorales).__name__}"
                )
            if isinstance(names, str) or not isinstance(names, Sequence):
                raise TypeError(
                    f"ChoraleSplits.{split}_names: expected a sequence of str, got "
                    f"{type(names).__name__}"
                )
            if len(names) != len(chorales):
                raise ValueError(
                    f"ChoraleSplits: {len(chorales)} {split} chorales but {len(names)} "
                    f"{split}_names"
                )
            object.__setattr__(self, split, _freeze(chorales, split, names, self.source))
            object.__setattr__(self, f"{split}_names", tuple(str(n) for n in names))
        if not isinstance(self.source, str):
            raise TypeError(f"ChoraleSplits.source: expected str, got {type(self.source).__name__}")

    @classmethod
    def from_parts(
        cls, parts: dict[str, tuple[list[np.ndarray], list[str]]], source: str = ""
    ) -> ChoraleSplits:
        """Build from ``{split: (chorales, names)}`` for the three splits."""
        fields = {}
        for split in SPLITS:
            fields[split], fields[f"{split}_names"] = parts[split]
        return cls(**fields, source=source)

    def split(self, name: SplitName) -> tuple[np.ndarray, ...]:
        """The chorales of split ``name`` (``"train"``, ``"valid"`` or ``"test"``)."""
        if name not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {name!r}")
        return getattr(self, name)

    def names(self, name: SplitName) -> tuple[str, ...]:
        """The chorale names of split ``name``."""
        if name not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {name!r}")
        return getattr(self, f"{name}_names")

    def num_steps(self, name: SplitName | None = None) -> int:
        """Total number of 16th-note steps in split ``name`` (all splits when ``None``)."""
        names = SPLITS if name is None else (name,)
        return sum(len(c) for n in names for c in self.split(n))

    def summary(self) -> dict[str, Any]:
        """Counts for logs: chorales and steps per split, and the source."""
        return {
            "source": self.source,
            **{f"{s}_chorales": len(self.split(s)) for s in SPLITS},
            **{f"{s}_steps": self.num_steps(s) for s in SPLITS},
        }

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={len(self.split(s))}" for s in SPLITS)
        return f"ChoraleSplits({counts}, steps={self.num_steps()}, source={self.source!r})"
