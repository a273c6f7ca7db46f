"""Transposition augmentation for the training split.

Shifting every pitch of a chorale by the same number of semitones keeps its harmony and voice
leading; silence (``-1``) stays silence. :func:`random_transpose` only draws shifts that keep every
voice inside its range, :data:`VOICE_RANGES` by default:

======= ========= ==========================================================
voice   MIDI      source
======= ========= ==========================================================
soprano 57..81    lowest / highest pitch each voice has anywhere in the JSB
alto    52..74    reference file (train: S 60..81, A 52..74, T 46..69,
tenor   46..69    B 36..66) and the music21 corpus chorales (S 57..81,
bass    36..66    A 53..74, T 48..69, B 36..64), whichever is wider
======= ========= ==========================================================

so augmentation never takes a voice where Bach never wrote it in these data, and every shifted
pitch stays inside the token vocabulary (24..96). :func:`voice_ranges` computes ranges from other
data (e.g. the training split only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .splits import NUM_VOICES, SILENCE, check_chorale

__all__ = [
    "VOICE_RANGES",
    "allowed_shifts",
    "random_transpose",
    "transpose",
    "voice_ranges",
]

#: Inclusive (lowest, highest) MIDI pitch per voice, S, A, T, B (see module docstring).
VOICE_RANGES: tuple[tuple[int, int], ...] = ((57, 81), (52, 74), (46, 69), (36, 66))


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_ranges(ranges: Any) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple((int(lo), int(hi)) for lo, hi in ranges)
    except (TypeError, ValueError):
        raise ValueError(
            f"ranges: expected {NUM_VOICES} (low, high) pairs, got {ranges!r}"
        ) from None
    if len(out) != NUM_VOICES or any(lo > hi for lo, hi in out):
        raise ValueError(
            f"ranges: expected {NUM_VOICES} (low, high) pairs with low <= high, got {ranges!r}"
        )
    return out


def transpose(chorale: Any, semitones: int) -> np.ndarray:
    """A copy of ``chorale`` ``(T, 4)`` with every pitch shifted by ``semitones``; ``-1`` kept.

    Raises:
        ValueError: a shifted pitch would leave MIDI 0..127.
    """
    arr = check_chorale(chorale, "chorale")
    k = _check_int("semitones", semitones)
    sounding = arr != SILENCE
    out = arr.astype(np.int32)
    out[sounding] += k
    if sounding.any():
        lo, hi = int(out[sounding].min()), int(out[sounding].max())
        if lo < 0 or hi > 127:
            raise ValueError(
                f"semitones: shifting by {k} takes pitches to {lo}..{hi}, outside MIDI 0..127"
            )
    return out.astype(np.int16)


def voice_ranges(chorales: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    """Lowest and highest pitch of each voice over ``chorales`` (silence ignored).

    Raises:
        ValueError: no chorales, or a voice that never sounds.
    """
    if isinstance(chorales, np.ndarray) or not isinstance(chorales, Sequence) or not chorales:
        raise ValueError("chorales: expected a non-empty sequence of (T, 4) arrays")
    arr = np.concatenate([check_chorale(c, f"chorales[{i}]") for i, c in enumerate(chorales)])
    out = []
    for v in range(NUM_VOICES):
        col = arr[:, v][arr[:, v] != SILENCE]
        if not col.size:
            raise ValueError(f"chorales: voice {v} never sounds, its range is undefined")
        out.append((int(col.min()), int(col.max())))
    return tuple(out)


def allowed_shifts(
    chorale: Any, max_shift: int = 6, ranges: Sequence[tuple[int, int]] = VOICE_RANGES
) -> np.ndarray:
    """The shifts in ``-max_shift..max_shift`` that keep every voice of ``chorale`` in ``ranges``,
    ascending (``int64``). Empty when none does (e.g. the chorale is already outside them)."""
    arr = check_chorale(chorale, "chorale")
    m = _check_int("max_shift", max_shift)
    if m < 0:
        raise ValueError(f"max_shift: expected >= 0, got {m}")
    lo_shift, hi_shift = -m, m
    for v, (lo, hi) in enumerate(_check_ranges(ranges)):
        col = arr[:, v][arr[:, v] != SILENCE]
        if col.size:
            lo_shift = max(lo_shift, lo - int(col.min()))
            hi_shift = min(hi_shift, hi - int(col.max()))
    return np.arange(lo_shift, hi_shift + 1, dtype=np.int64)


def random_transpose(
    chorale: Any,
    rng: np.random.Generator,
    max_shift: int = 6,
    ranges: Sequence[tuple[int, int]] = VOICE_RANGES,
) -> np.ndarray:
    """``chorale`` transposed by a shift drawn uniformly from :func:`allowed_shifts`.

    A chorale that no shift keeps in range (not the case for the JSB or corpus data with the
    default ranges) is returned unchanged (as a copy), rather than pushed further out.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected numpy.random.Generator, got {type(rng).__name__}")
    shifts = allowed_shifts(chorale, max_shift, ranges)
    k = int(rng.choice(shifts)) if shifts.size else 0
    return transpose(chorale, k)
