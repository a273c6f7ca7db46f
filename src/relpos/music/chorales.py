"""The four-part Bach chorales of the music21 corpus (ships inside the ``music21`` package, so this
works offline), as ``(T, 4)`` arrays on a 16th-note grid.

Selection:
    every score of ``music21.corpus.getComposer("bach")`` in a score format (``.mxl``, ``.xml``,
    ``.krn``; the Roman-numeral analyses are skipped), one file per chorale (when the same chorale
    ships in several formats, MusicXML wins over Humdrum), that has **exactly four parts** named
    Soprano, Alto, Tenor and Bass (by part name, else part id; case-insensitive, first word).
    Cantata movements with instrumental parts are skipped. With music21 10.5 this keeps 365 of
    410 scores.

Quantisation:
    step ``t`` is quarter-note offset ``t/4``; a voice's value at step ``t`` is the pitch
    sounding at that instant (a note with offset ``o`` and length ``d`` covers the steps with
    ``o ≤ t/4 < o + d``), so a note shorter than a 16th that does not cross a grid point
    vanishes, and grace notes (length 0) are ignored. Where a part sounds several notes at once
    (a chord, or two voices in one staff) the highest wins. ``-1`` = nothing sounds. Repeats are
    written out as performed (``Score.expandRepeats``, first/second endings included), as in the
    JSB data; fermatas, ties and dynamics are not represented (a tied note is simply held). The
    array covers the whole score (``ceil(4 · highestTime)`` steps, pickup bar included).

Checked against the JSB reference file (another edition of the same chorales): 277 of the 365
corpus chorales start with exactly the same 32 steps as some JSB chorale (6 more do up to a
transposition); of these 277, 222 have the same length or are exactly one quarter shorter (JSB
holds the final chord one beat longer) and 73 are identical over their common length; the
others differ by edition (octave doublings in the bass, an inner-voice note, repeats).

This split is not the JSB standard split, and the two data sets hold largely the same chorales:
train and evaluate on the same source, never across them.

Split (deterministic, by chorale, independent of ``limit`` and of what else is in the corpus):
    a chorale's *group* is its file name without extension and without any ``-suffix``
    (``bwv18.5-lz`` and ``bwv18.5-w`` are the same chorale in two versions: same group); the
    first 8 bytes of ``sha256("relpos-split-v1:" + group)`` as a fraction ``u`` in [0, 1) give
    train if ``u < 0.8``, valid if ``u < 0.9``, else test. Within a split, chorales are in corpus
    path order.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import sys
import warnings
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .cache import cached_splits, default_cache_dir
from .splits import NUM_VOICES, SILENCE, SPLITS, VOICE_NAMES, ChoraleSplits

__all__ = [
    "SPLIT_FRACTIONS",
    "STEPS_PER_QUARTER",
    "corpus_chorale_paths",
    "load_music21_chorales",
    "parse_music21_chorales",
    "score_to_array",
    "split_of",
]

log = logging.getLogger(__name__)

#: Grid resolution: 4 steps per quarter note = 16th notes.
STEPS_PER_QUARTER = 4
#: Approximate train / valid / test fractions of the hash split.
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
_SPLIT_SALT = "relpos-split-v1:"
_FORMAT_PREFERENCE = {".mxl": 0, ".xml": 1, ".musicxml": 1, ".krn": 2}
_VOICE_INDEX = {name: i for i, name in enumerate(VOICE_NAMES)}


def _music21() -> Any:
    try:
        import music21
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the music21 chorale loader needs music21: pip install 'relpos[music]'"
        ) from exc
    return music21


def split_of(name: str) -> str:
    """The split (``"train"``, ``"valid"`` or ``"test"``) of the corpus chorale ``name``
    (e.g. ``"bach/bwv66.6"``); see the module docstring."""
    group = Path(name).name.split("-", 1)[0]
    digest = hashlib.sha256((_SPLIT_SALT + group).encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < SPLIT_FRACTIONS[0]:
        return "train"
    if u < SPLIT_FRACTIONS[0] + SPLIT_FRACTIONS[1]:
        return "valid"
    return "test"


def corpus_chorale_paths() -> list[tuple[str, Path]]:
    """Candidate chorale files of the music21 corpus as ``(name, path)`` pairs, sorted by name.

    ``name`` is the corpus-relative path without extension (``"bach/bwv66.6"``), which
    ``music21.corpus.parse`` accepts. One file per name (MusicXML preferred over Humdrum). The
    four-part test needs parsing, so this list still holds scores that
    :func:`parse_music21_chorales` skips.
    """
    music21 = _music21()
    root = Path(music21.common.getCorpusFilePath())
    best: dict[str, Path] = {}
    for p in music21.corpus.getComposer("bach"):
        p = Path(p)
        if p.suffix.lower() not in _FORMAT_PREFERENCE:
            continue
        try:
            rel = p.relative_to(root)
        except ValueError:
            rel = Path("bach") / p.name
        name = rel.with_suffix("").as_posix()
        old = best.get(name)
        if (
            old is None
            or _FORMAT_PREFERENCE[p.suffix.lower()] < _FORMAT_PREFERENCE[old.suffix.lower()]
        ):
            best[name] = p
    return sorted(best.items())


def _voice_of(part: Any) -> int | None:
    for label in (part.partName, part.id, part.partAbbreviation):
        if not label or not isinstance(label, str):
            continue
        words = [w for w in re.split(r"[^a-z]+", label.lower()) if w]
        if words and words[0] in _VOICE_INDEX:
            return _VOICE_INDEX[words[0]]
    return None


def _has_repeats(score: Any) -> bool:
    kinds = ("Repeat", "RepeatBracket", "RepeatExpression")
    return score.recurse().getElementsByClass(kinds).first() is not None


def score_to_array(
    score: Any, *, steps_per_quarter: int = STEPS_PER_QUARTER, expand_repeats: bool = True
) -> np.ndarray:
    """A four-part SATB ``music21`` score as an ``int16`` array ``(T, 4)`` (see module docstring).

    Args:
        score: a ``music21.stream.Score``.
        steps_per_quarter: grid resolution (4 = 16th notes).
        expand_repeats: write repeated sections out as performed (``Score.expandRepeats``); if
            music21 cannot expand a score's repeat marks, the score is used as written and a
            warning is logged.

    Raises:
        ValueError: the score does not have exactly four parts named Soprano, Alto, Tenor, Bass.
    """
    if not isinstance(steps_per_quarter, int) or steps_per_quarter < 1:
        raise ValueError(f"steps_per_quarter: expected a positive int, got {steps_per_quarter!r}")
    parts = list(score.parts)
    if len(parts) != NUM_VOICES:
        raise ValueError(f"score: expected {NUM_VOICES} parts (S, A, T, B), got {len(parts)}")
    voices = [_voice_of(p) for p in parts]
    if sorted(v for v in voices if v is not None) != list(range(NUM_VOICES)):
        labels = [p.partName or p.id for p in parts]
        raise ValueError(f"score: parts {labels} do not map one-to-one onto S, A, T, B")
    if expand_repeats and _has_repeats(score):
        try:
            expanded = score.expandRepeats()
        except Exception as exc:  # music21.repeat.ExpanderException and friends
            log.warning("could not expand the repeats of %s (%s); using it as written", score, exc)
        else:
            expanded_parts = list(expanded.parts)
            if len(expanded_parts) == NUM_VOICES:  # same parts, same order
                parts = expanded_parts
    end = max(Fraction(p.highestTime) for p in parts)
    steps = math.ceil(end * steps_per_quarter)
    out = np.full((steps, NUM_VOICES), SILENCE, dtype=np.int16)
    for part, v in zip(parts, voices, strict=True):
        flat = part.flatten()
        for n in flat.notes:
            if n.duration.isGrace or n.quarterLength == 0:
                continue
            pitches = [p.midi for p in getattr(n, "pitches", ())]
            if not pitches:  # unpitched
                continue
            onset = Fraction(n.getOffsetBySite(flat))
            lo = math.ceil(onset * steps_per_quarter)
            hi = min(math.ceil((onset + Fraction(n.quarterLength)) * steps_per_quarter), steps)
            if hi > lo:
                col = out[lo:hi, v]
                np.maximum(col, max(pitches), out=col)
    return out


def _progress(items: list[Any], enabled: bool, desc: str) -> Iterable[Any]:
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the same extra as music21
        return items
    return tqdm(items, desc=desc, unit="score", file=sys.stderr, dynamic_ncols=True)


def _check_limit(limit: Any) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit: expected a positive int or None, got {limit!r}")


def parse_music21_chorales(*, progress: bool = True, limit: int | None = None) -> ChoraleSplits:
    """Parse the corpus chorales (no cache; about a minute for the full corpus).

    Args:
        progress: show a tqdm progress bar on stderr.
        limit: stop after this many chorales were kept (for tests; the splits of the chorales
            kept are the same as in the full corpus, so some splits may be empty).
    """
    _check_limit(limit)
    music21 = _music21()
    parts: dict[str, tuple[list[np.ndarray], list[str]]] = {s: ([], []) for s in SPLITS}
    kept = 0
    skipped: list[str] = []
    candidates = corpus_chorale_paths()
    bar = _progress(candidates, progress, "Parsing music21 Bach chorales")
    for name, path in bar:
        if limit is not None and kept >= limit:
            break
        try:
            score = music21.converter.parse(path, forceSource=True)
        except Exception as exc:  # a corpus file music21 itself can't read: skip it, loudly
            skipped.append(name)
            warnings.warn(f"music21 could not parse {name} ({exc}); skipped", stacklevel=2)
            continue
        try:
            arr = score_to_array(score)
        except ValueError as exc:  # not a four-part SATB score
            skipped.append(name)
            log.debug("skipping %s: %s", name, exc)
            continue
        chorales, names = parts[split_of(name)]
        chorales.append(arr)
        names.append(name)
        kept += 1
    if hasattr(bar, "close"):
        bar.close()
    log.info("music21 corpus: kept %d chorales, skipped %d scores", kept, len(skipped))
    return ChoraleSplits.from_parts(parts, source=f"music21 {music21.__version__} corpus")


def load_music21_chorales(
    *,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    limit: int | None = None,
    use_cache: bool = True,
    rebuild: bool = False,
) -> ChoraleSplits:
    """The corpus chorales, from the cache when it is valid, else parsed and cached.

    The cache file is ``<cache_dir>/music21-bach-chorales[-limit<N>].npz`` (format:
    :mod:`relpos.music.cache`), keyed by the music21 version and the parsing parameters.

    Args:
        cache_dir: cache directory (default :func:`relpos.music.cache.default_cache_dir`:
            ``$RELPOS_CACHE`` or ``~/.cache/relpos``).
        progress: progress bar while parsing.
        limit: parse only until this many chorales were kept (see :func:`parse_music21_chorales`).
        use_cache: read and write the cache (``False``: always parse, touch no file).
        rebuild: parse even if the cache is valid, and overwrite it.
    """
    _check_limit(limit)
    if not use_cache:
        return parse_music21_chorales(progress=progress, limit=limit)
    music21 = _music21()
    directory = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    suffix = "" if limit is None else f"-limit{limit}"
    key = {
        "music21_version": str(music21.__version__),
        "params": {
            "steps_per_quarter": STEPS_PER_QUARTER,
            "limit": limit,
            "split": [_SPLIT_SALT, *SPLIT_FRACTIONS],
            "selection": "bach, mxl>xml>krn, exactly 4 parts named S/A/T/B; highest note wins",
            "expand_repeats": True,
        },
    }
    return cached_splits(
        directory / f"music21-bach-chorales{suffix}.npz",
        key,
        lambda: parse_music21_chorales(progress=progress, limit=limit),
        rebuild=rebuild,
    )
