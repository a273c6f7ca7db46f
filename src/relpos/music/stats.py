"""Simple statistics of four-part chorales, to judge generated ones against Bach's.

A chorale is a ``(T, 4)`` array of MIDI pitches on the 16th-note grid, voices soprano, alto,
tenor, bass, ``-1`` = silence (:mod:`relpos.music.chorales`). Rates are per 100 grid steps (25
quarter notes), so chorales of different lengths compare.

* **out of range**: sounding notes outside their voice's :data:`~relpos.music.VOICE_RANGES`
  (counted per step: a note held for 4 steps out of range counts 4);
* **voice crossings**: steps where a voice sounds below the next lower voice (S < A, A < T or
  T < B), both sounding;
* **parallel fifths / octaves**: a step ``t → t+1`` at which two voices (any of the six pairs)
  both change pitch in the same direction, both sounding at both steps, and their interval is a
  perfect fifth (7 semitones modulo 12) before and after, or a unison/octave (0 modulo 12) before
  and after — the progressions the rules of four-part writing forbid. Motion into the same
  interval by one voice while the other holds (oblique motion) is not counted;
* **pitch-class histogram**: the share of each of the 12 pitch classes among sounding steps;
  two sets of chorales are compared by the total-variation distance of their pooled histograms
  (:func:`pitch_class_distance`: 0 same, 1 disjoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .augment import VOICE_RANGES
from .splits import NUM_VOICES, SILENCE, check_chorale

__all__ = [
    "chorale_statistics",
    "compare_chorales",
    "parallel_motion",
    "pitch_class_distance",
    "pitch_class_histogram",
]

PER = 100.0  # rates are per this many grid steps


def _pitches(chorale: Any, name: str = "chorale") -> np.ndarray:
    """The checked chorale (:func:`~relpos.music.check_chorale`) as int64, for differences."""
    return check_chorale(chorale, name).astype(np.int64)


def parallel_motion(chorale: Any) -> dict[str, int]:
    """Counts of parallel fifths and parallel octaves/unisons over every pair of voices.

    Returns:
        ``{"fifths": n, "octaves": m}``.
    """
    c = _pitches(chorale)
    fifths = octaves = 0
    if len(c) < 2:
        return {"fifths": 0, "octaves": 0}
    a, b = c[:-1], c[1:]
    sounding = (a != SILENCE) & (b != SILENCE)  # (T-1, 4)
    move = np.sign(b - a)  # per voice: -1, 0, +1
    for upper in range(NUM_VOICES):
        for lower in range(upper + 1, NUM_VOICES):
            both = sounding[:, upper] & sounding[:, lower]
            similar = (move[:, upper] != 0) & (move[:, upper] == move[:, lower])
            before = (a[:, upper] - a[:, lower]) % 12
            after = (b[:, upper] - b[:, lower]) % 12
            parallel = both & similar & (before == after)
            fifths += int((parallel & (before == 7)).sum())
            octaves += int((parallel & (before == 0)).sum())
    return {"fifths": fifths, "octaves": octaves}


def pitch_class_histogram(chorales: Sequence[Any]) -> np.ndarray:
    """``(12,)`` share of each pitch class among the sounding steps of ``chorales`` (pooled);
    zeros when nothing sounds."""
    counts = np.zeros(12)
    for i, chorale in enumerate(chorales):
        c = _pitches(chorale, f"chorales[{i}]")
        notes = c[c != SILENCE]
        counts += np.bincount(notes % 12, minlength=12)
    total = counts.sum()
    return counts / total if total else counts


def pitch_class_distance(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Total-variation distance ``½·Σ|p − q|`` between the pooled pitch-class histograms of two
    sets of chorales, in ``[0, 1]``."""
    return float(0.5 * np.abs(pitch_class_histogram(a) - pitch_class_histogram(b)).sum())


def chorale_statistics(
    chorale: Any, ranges: Sequence[tuple[int, int]] = VOICE_RANGES, *, skip: int = 0
) -> dict[str, float]:
    """The rates of one chorale (see the module docstring), per 100 grid steps.

    Args:
        skip: leading steps that are context only (a primed prefix): the rates count the steps
            after them, and a parallel motion *into* the first counted step (from the last
            skipped one) counts too.

    Returns:
        ``steps`` (counted), ``out_of_range``, ``voice_crossings``, ``parallel_fifths``,
        ``parallel_octaves`` (the last four per 100 counted steps).
    """
    full = _pitches(chorale)
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    c = full[skip:]
    steps = len(c)
    scale = PER / steps if steps else 0.0
    lo = np.array([r[0] for r in ranges])
    hi = np.array([r[1] for r in ranges])
    sounding = c != SILENCE
    out = int((sounding & ((c < lo) | (c > hi))).sum())
    upper, lower = c[:, :-1], c[:, 1:]
    crossings = int((sounding[:, :-1] & sounding[:, 1:] & (upper < lower)).sum())
    motion = parallel_motion(full[max(skip - 1, 0) :] if steps else c)
    return {
        "steps": float(steps),
        "out_of_range": out * scale,
        "voice_crossings": crossings * scale,
        "parallel_fifths": motion["fifths"] * scale,
        "parallel_octaves": motion["octaves"] * scale,
    }


def compare_chorales(
    generated: Sequence[Any], real: Sequence[Any], *, skip: int = 0
) -> dict[str, Any]:
    """Mean rates of ``generated`` and ``real`` chorales side by side, and the pitch-class
    distance between the two sets; ``skip`` leading steps of each generated chorale are context
    (a primed prefix, :func:`chorale_statistics`).

    Returns:
        ``{"generated": {rate: mean}, "real": {rate: mean}, "pitch_class_distance": float}``;
        a rate's mean weighs each chorale by its length (the total count per 100 steps of all).
    """
    if not len(generated) or not len(real):
        raise ValueError(
            f"compare_chorales needs at least one chorale on each side, got {len(generated)} "
            f"generated and {len(real)} real"
        )

    def pooled(chorales: Sequence[Any], skip: int = 0) -> dict[str, float]:
        stats = [chorale_statistics(c, skip=skip) for c in chorales]
        steps = sum(s["steps"] for s in stats)
        rates = ("out_of_range", "voice_crossings", "parallel_fifths", "parallel_octaves")
        return {
            "steps": steps,
            **{r: sum(s[r] * s["steps"] for s in stats) / steps if steps else 0.0 for r in rates},
        }

    counted = [_pitches(c, f"generated[{i}]")[skip:] for i, c in enumerate(generated)]
    return {
        "generated": pooled(generated, skip),
        "real": pooled(real),
        "pitch_class_distance": pitch_class_distance(counted, real),
    }
