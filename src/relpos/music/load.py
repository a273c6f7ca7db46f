"""One entry point for every chorale source: :func:`load_chorales`."""

from __future__ import annotations

import os
from pathlib import Path

from .chorales import load_music21_chorales
from .jsb import JSB, load_jsb_json, packaged_jsb_path
from .splits import SPLITS, ChoraleSplits

__all__ = ["JSB", "MUSIC21", "load_chorales"]

#: The ``source`` value that selects the music21 corpus (as does ``None``).
MUSIC21 = "music21"


def load_chorales(
    source: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    limit: int | None = None,
) -> ChoraleSplits:
    """Load four-part chorales as :class:`ChoraleSplits` (``(T, 4)`` int16 arrays, S, A, T, B).

    Args:
        source: ``None`` or ``"music21"``: the Bach chorales of the music21 corpus, parsed once
            and cached (:func:`relpos.music.chorales.load_music21_chorales`). ``"jsb"``: the
            standard JSB split that ships with relpos (:func:`relpos.music.jsb.packaged_jsb_path`).
            Any other string or path: a JSB JSON file ``{"train", "valid", "test"}``, plain or
            ``.gz`` (:func:`relpos.music.jsb.load_jsb_json`). (A file literally named ``music21``
            or ``jsb`` must be given as a ``Path`` or as ``"./jsb"``.)
        cache_dir: cache directory for the corpus (default ``$RELPOS_CACHE`` or
            ``~/.cache/relpos``); unused for a JSON file.
        progress: progress bar on stderr while parsing the corpus.
        limit: corpus: parse only until this many chorales are kept (for tests). JSON file: keep
            the first ``limit`` chorales of each split.

    Raises:
        TypeError: ``source`` is neither ``None``, a string nor a path.
        ValueError: a malformed JSON file, or a bad ``limit``.
        FileNotFoundError: no file at ``source`` (or no packaged split for ``"jsb"``).
    """
    if source is None or (isinstance(source, str) and source == MUSIC21):
        return load_music21_chorales(cache_dir=cache_dir, progress=progress, limit=limit)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"source: expected None, {MUSIC21!r} or a path to a JSON file, got "
            f"{type(source).__name__}"
        )
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit: expected a positive int or None, got {limit!r}")
    path = packaged_jsb_path() if isinstance(source, str) and source == JSB else Path(source)
    splits = load_jsb_json(path)
    if limit is None:
        return splits
    return ChoraleSplits(
        **{s: splits.split(s)[:limit] for s in SPLITS},
        **{f"{s}_names": splits.names(s)[:limit] for s in SPLITS},
        source=splits.source,
    )
