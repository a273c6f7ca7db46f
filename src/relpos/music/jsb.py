"""Loader for the JSB chorales with the standard split (Boulanger-Lewandowski et al., 2012), in the
JSON edition of the Coconet ``Jsb16thSeparated`` data:

.. code-block:: text

    {"train": [chorale, ...], "valid": [...], "test": [...]}
    chorale = [[S, A, T, B], [S, A, T, B], ...]     one entry per 16th-note step
    S, A, T, B = MIDI pitch (int), -1 = the voice is silent

What the reference file holds (``Jsb16thSeparated.json``, checked when this loader was written):
229 / 76 / 77 chorales with 55,228 / 18,408 / 18,900 steps; every step has exactly four entries,
every entry is an int; pitches 36..81; ``-1`` occurs (a few hundred steps per split, where a voice
rests). So the strict rules below reject nothing in it.

Rules:

* the top level must be an object with the keys ``train``, ``valid`` and ``test`` (other keys are
  ignored), each a list of chorales (a split may be empty);
* a chorale is a non-empty list of steps; a step is a list of **exactly four** values — a step
  with fewer or more entries is an error, since one can't tell which voice is missing;
* a value is an int in 0..127 or ``-1``; also accepted: a float with an integral value
  (``60.0``), and ``null`` or ``NaN`` as silence (``-1``), which is how the ``.npz`` edition of the
  same data marks silent voices; anything else (``60.5``, ``"C4"``, ``true``, ``Infinity``) is an
  error;
* a pitch must also have a token (:data:`relpos.music.tokens.MIN_PITCH` ..
  :data:`~relpos.music.tokens.MAX_PITCH`, 24..96), so that a file that loads can be trained on:
  a valid MIDI pitch outside that range is an error here, naming the file, the chorale, the step
  and the voice, not later inside the tokenizer.

Every error is a ``ValueError`` whose message names the file and the place (split, chorale, step).
Chorales are named ``"<split>/<index>"`` (``"train/000"``), in file order.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from .splits import NUM_VOICES, SILENCE, SPLITS, VOICE_NAMES, ChoraleSplits
from .tokens import MAX_PITCH, MIN_PITCH

__all__ = ["JSB", "load_jsb_json", "packaged_jsb_path", "parse_jsb_splits"]

#: The ``--data`` name of the standard split that ships inside the package.
JSB = "jsb"
_PACKAGED = Path(__file__).with_name("data") / "Jsb16thSeparated.json.gz"


def _value(x: Any, where: str) -> int:
    if isinstance(x, bool):
        raise ValueError(f"{where}: expected a MIDI pitch or -1, got {x!r}")
    if x is None:
        return SILENCE
    if isinstance(x, float):
        if math.isnan(x):
            return SILENCE
        if not x.is_integer():
            raise ValueError(f"{where}: expected an integer MIDI pitch or -1, got {x!r}")
        x = int(x)
    if not isinstance(x, int):
        raise ValueError(
            f"{where}: expected an integer MIDI pitch or -1, got {type(x).__name__} {x!r}"
        )
    if x != SILENCE and not 0 <= x <= 127:
        raise ValueError(f"{where}: expected -1 or a MIDI pitch 0..127, got {x}")
    return x


def _chorale(raw: Any, where: str) -> np.ndarray:
    if not isinstance(raw, list):
        raise ValueError(f"{where}: expected a list of time steps, got {type(raw).__name__}")
    if not raw:
        raise ValueError(f"{where}: empty chorale (no time steps)")
    # Fast path: a clean integer grid, as in the reference file.
    try:
        arr = np.array(raw)
    except (TypeError, ValueError):  # ragged
        arr = None
    if (
        arr is not None
        and arr.dtype.kind == "i"
        and arr.ndim == 2
        and not any(type(x) is bool for step in raw for x in step)  # numpy turns True into 1
        and arr.shape[1] == NUM_VOICES
        and int(arr.min()) >= SILENCE
        and int(arr.max()) <= 127
    ):
        return arr.astype(np.int16)
    out = np.empty((len(raw), NUM_VOICES), dtype=np.int16)
    for t, step in enumerate(raw):
        if not isinstance(step, list):
            raise ValueError(
                f"{where}, step {t}: expected a list of {NUM_VOICES} pitches [S, A, T, B], got "
                f"{type(step).__name__} {step!r}"
            )
        if len(step) != NUM_VOICES:
            raise ValueError(
                f"{where}, step {t}: expected {NUM_VOICES} pitches [S, A, T, B], got "
                f"{len(step)}: {step!r}"
            )
        for v, x in enumerate(step):
            out[t, v] = _value(x, f"{where}, step {t}, voice {v}")
    return out


def _check_vocabulary(chorale: np.ndarray, where: str) -> None:
    bad = (chorale != SILENCE) & ((chorale < MIN_PITCH) | (chorale > MAX_PITCH))
    if bad.any():
        step, voice = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{where}, step {step}, voice {voice} ({VOICE_NAMES[voice]}): pitch "
            f"{int(chorale[step, voice])} is outside the token vocabulary {MIN_PITCH}..{MAX_PITCH} "
            "(it cannot be encoded for training)"
        )


def parse_jsb_splits(data: Any, *, source: str = "<data>") -> ChoraleSplits:
    """Validate already-decoded JSON ``data`` (see the module docstring) into
    :class:`ChoraleSplits`; ``source`` is used in error messages and as ``.source``."""
    if not isinstance(data, dict):
        raise ValueError(
            f"{source}: expected a JSON object with keys {list(SPLITS)}, got {type(data).__name__}"
        )
    missing = [s for s in SPLITS if s not in data]
    if missing:
        raise ValueError(
            f"{source}: missing key(s) {missing}; expected {list(SPLITS)}, found "
            f"{sorted(map(str, data))}"
        )
    chorales: dict[str, list[np.ndarray]] = {}
    for split in SPLITS:
        raw = data[split]
        if not isinstance(raw, list):
            raise ValueError(
                f"{source}: {split!r} must be a list of chorales, got {type(raw).__name__}"
            )
        chorales[split] = []
        for i, c in enumerate(raw):
            where = f"{source}: {split} chorale {i}"
            chorale = _chorale(c, where)
            _check_vocabulary(chorale, f"{where} ({split}/{i:03d})")
            chorales[split].append(chorale)
    return ChoraleSplits(
        train=chorales["train"],
        valid=chorales["valid"],
        test=chorales["test"],
        train_names=[f"train/{i:03d}" for i in range(len(chorales["train"]))],
        valid_names=[f"valid/{i:03d}" for i in range(len(chorales["valid"]))],
        test_names=[f"test/{i:03d}" for i in range(len(chorales["test"]))],
        source=source,
    )


def packaged_jsb_path() -> Path:
    """The standard split shipped with relpos (``relpos/music/data/Jsb16thSeparated.json.gz``;
    provenance in the README beside it).

    Raises:
        FileNotFoundError: this installation lacks the file (a build that left out the package
            data), with the advice to pass a JSB JSON file by path.
    """
    if not _PACKAGED.is_file():
        raise FileNotFoundError(
            f"{JSB!r}: the packaged JSB split {_PACKAGED} is missing from this installation of "
            "relpos (a build without its package data); reinstall relpos or pass a JSB JSON file "
            "by path"
        )
    return _PACKAGED


def load_jsb_json(path: str | os.PathLike[str]) -> ChoraleSplits:
    """Load a JSB chorales JSON file, plain or gzip-compressed (``.gz``); format and rules in the
    module docstring.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8 JSON, or not in the expected format (the message names the path
            and what is wrong).
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        else:
            text = path.read_text(encoding="utf-8")
    except (gzip.BadGzipFile, EOFError) as exc:
        raise ValueError(f"{str(path)!r}: not a gzip file ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{str(path)!r}: not a UTF-8 text file ({exc})") from None
    except IsADirectoryError:
        raise ValueError(f"{str(path)!r}: is a directory, expected a JSON file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r}: not valid JSON ({exc})") from None
    return parse_jsb_splits(data, source=str(path))
