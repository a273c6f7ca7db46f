"""Write ``(T, 4)`` chorales as MIDI or MusicXML through music21.

The score has four parts, Soprano, Alto, Tenor, Bass. Within a voice, consecutive steps with the
same pitch become **one held note**: the grid representation cannot tell a held note from a
repeated one (both are "pitch p at steps t and t+1"), so a repeated note comes out held; ``-1``
steps become rests. One step is a 16th note (``steps_per_quarter=4``). Files are written
atomically (temporary file beside the target, then ``os.replace``).
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_path
from .splits import NUM_VOICES, SILENCE, VOICE_NAMES, check_chorale

__all__ = ["chorale_to_score", "voice_runs", "write_midi", "write_musicxml"]


def _music21() -> Any:
    try:
        import music21
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "writing MIDI/MusicXML needs music21: pip install 'relpos[music]'"
        ) from exc
    return music21


def voice_runs(column: Any) -> list[tuple[int, int, int]]:
    """Runs of equal values in one voice: ``(start_step, num_steps, pitch)``, pitch ``-1`` =
    rest, in order, covering the whole column."""
    col = np.asarray(column)
    if col.ndim != 1:
        raise ValueError(f"column: expected a 1-D array, got shape {col.shape}")
    if not col.size:
        return []
    change = np.flatnonzero(col[1:] != col[:-1]) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(col)]])
    return [(int(s), int(e - s), int(col[s])) for s, e in zip(starts, ends, strict=True)]


def _check_tempo(tempo_bpm: Any) -> float | None:
    if tempo_bpm is None:
        return None
    if isinstance(tempo_bpm, bool) or not isinstance(tempo_bpm, (int, float, np.number)):
        raise TypeError(f"tempo_bpm: expected a number, got {type(tempo_bpm).__name__}")
    if not math.isfinite(tempo_bpm) or tempo_bpm <= 0:
        raise ValueError(f"tempo_bpm: expected a positive finite number, got {tempo_bpm!r}")
    return float(tempo_bpm)


def chorale_to_score(
    chorale: Any,
    *,
    tempo_bpm: float | None = None,
    steps_per_quarter: int = 4,
    title: str | None = None,
) -> Any:
    """A ``music21.stream.Score`` for a ``(T, 4)`` chorale (see the module docstring).

    Args:
        chorale: ``(T, 4)`` integer array, columns S, A, T, B, ``-1`` = silent.
        tempo_bpm: quarter notes per minute (a metronome mark at the start), or ``None``.
        steps_per_quarter: grid resolution of ``chorale``.
        title: score title (MusicXML metadata).

    Raises:
        ValueError: ``chorale`` is not ``(T, 4)`` / has values outside ``-1``, 0..127.
    """
    arr = check_chorale(chorale, "chorale")
    tempo = _check_tempo(tempo_bpm)
    if not isinstance(steps_per_quarter, int) or steps_per_quarter < 1:
        raise ValueError(f"steps_per_quarter: expected a positive int, got {steps_per_quarter!r}")
    m21 = _music21()
    score = m21.stream.Score()
    if title is not None:
        score.insert(0, m21.metadata.Metadata(title=str(title)))
    instruments = (
        m21.instrument.Soprano,
        m21.instrument.Alto,
        m21.instrument.Tenor,
        m21.instrument.Bass,
    )
    for v in range(NUM_VOICES):
        part = m21.stream.Part(id=VOICE_NAMES[v].capitalize())
        part.partName = VOICE_NAMES[v].capitalize()
        part.insert(0, instruments[v]())
        part.insert(0, m21.meter.TimeSignature("4/4"))
        if tempo is not None:
            part.insert(0, m21.tempo.MetronomeMark(number=tempo))
        for start, steps, pitch in voice_runs(arr[:, v]):
            ql = Fraction(steps, steps_per_quarter)
            n = m21.note.Rest(quarterLength=ql) if pitch == SILENCE else m21.note.Note(pitch)
            n.quarterLength = ql
            part.insert(Fraction(start, steps_per_quarter), n)
        score.insert(0, part)
    return score


def _write(score: Any, fmt: str, path: str | os.PathLike[str], suffix: str) -> Path:
    target = Path(path)
    with atomic_path(target, suffix=suffix) as tmp:
        written = score.write(fmt, fp=tmp)
        if Path(written) != tmp:  # music21 chose another name: move it into place
            os.replace(written, tmp)
    return target


def write_midi(
    chorale: Any,
    path: str | os.PathLike[str],
    *,
    tempo_bpm: float = 80.0,
    steps_per_quarter: int = 4,
) -> Path:
    """Write ``chorale`` ``(T, 4)`` as a 4-track MIDI file at ``path`` (atomically); returns the
    path. ``tempo_bpm`` is in quarter notes per minute."""
    score = chorale_to_score(chorale, tempo_bpm=tempo_bpm, steps_per_quarter=steps_per_quarter)
    return _write(score, "midi", path, ".mid")


def write_musicxml(
    chorale: Any,
    path: str | os.PathLike[str],
    *,
    tempo_bpm: float | None = None,
    steps_per_quarter: int = 4,
    title: str | None = None,
) -> Path:
    """Write ``chorale`` ``(T, 4)`` as a 4-part MusicXML score at ``path`` (atomically; notes are
    split and tied at bar lines of a 4/4 meter); returns the path."""
    score = chorale_to_score(
        chorale, tempo_bpm=tempo_bpm, steps_per_quarter=steps_per_quarter, title=title
    )
    return _write(score, "musicxml", path, ".musicxml")
