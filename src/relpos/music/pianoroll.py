"""A chorale as a piano-roll image: one colour per voice, time across, pitch up."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import save_png
from .splits import SILENCE, VOICE_NAMES, check_chorale

__all__ = ["write_piano_roll"]

#: One colour per voice, soprano to bass (matplotlib's tab10).
VOICE_COLOURS = ("tab:red", "tab:orange", "tab:green", "tab:blue")


def write_piano_roll(
    chorale: Any,
    path: str | os.PathLike[str],
    *,
    title: str = "",
    steps_per_quarter: int = 4,
    prime_steps: int = 0,
) -> Path:
    """Draw ``chorale`` ``(T, 4)`` (MIDI pitches, ``-1`` = silence) as a piano roll and write it
    as a PNG at ``path`` (atomically); returns the path. Each held note is one bar; bar lines
    every 4 quarter notes.

    Args:
        prime_steps: the first steps were given to the model (a prime), the rest generated: the
            prime is shaded and a dashed line marks where generation begins (0: no prime).
    """
    c = check_chorale(chorale).astype(np.int64)
    steps = len(c)
    if isinstance(prime_steps, bool) or not isinstance(prime_steps, int | np.integer):
        raise TypeError(f"prime_steps must be an int, got {prime_steps!r}")
    if not 0 <= prime_steps <= steps:
        raise ValueError(
            f"prime_steps must be in [0, {steps}] (the chorale's steps), got {prime_steps}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, min(30.0, steps / 16)), 4), dpi=110)
    for v in range(c.shape[1]):
        t = 0
        while t < steps:  # runs of one pitch: a held note
            pitch, start = c[t, v], t
            while t < steps and c[t, v] == pitch:
                t += 1
            if pitch != SILENCE:
                ax.broken_barh(
                    [(start, t - start)], (pitch - 0.4, 0.8), color=VOICE_COLOURS[v], alpha=0.85
                )
        ax.plot([], [], color=VOICE_COLOURS[v], label=VOICE_NAMES[v], linewidth=6)
    sounding = c[c != SILENCE]
    lo, hi = (int(sounding.min()), int(sounding.max())) if sounding.size else (60, 72)
    ax.set_ylim(lo - 2, hi + 2)
    ax.set_xlim(0, max(steps, 1))
    bar = 4 * steps_per_quarter
    for x in np.arange(0, steps + 1, bar):
        ax.axvline(x, color="0.85", linewidth=0.6, zorder=0)
    if prime_steps:
        ax.axvspan(0, prime_steps, color="0.93", zorder=-1, label=f"prime ({prime_steps} steps)")
        ax.axvline(prime_steps, color="0.3", linestyle="--", linewidth=1.2)
        ax.annotate(  # at the bottom: the legend takes the top
            "generated →",
            (prime_steps, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize="small",
        )
    ax.set_xlabel(f"16th-note step (bar lines every {bar})")
    ax.set_ylabel("MIDI pitch")
    ax.set_title(title or "chorale")
    ax.legend(loc="upper right", fontsize="small", ncol=5 if prime_steps else 4)
    return save_png(fig, path)
