"""A versioned, checksummed, pickle-free on-disk cache of :class:`ChoraleSplits`.

File format (``.npz``, written with :func:`numpy.savez`, read with ``allow_pickle=False``):

=========== ================ ==========================================================
array       dtype, shape     content
=========== ================ ==========================================================
``header``  uint8 ``(n,)``   UTF-8 JSON: ``format``, ``format_version``, ``key`` (what was
                             built: e.g. the music21 version and the parsing parameters),
                             ``source``, counts, and ``checksum``
``steps``   int16 ``(N, 4)`` all chorales concatenated (train, then valid, then test)
``offsets`` int64 ``(C+1,)`` chorale ``i`` is ``steps[offsets[i]:offsets[i+1]]``
``split``   int8 ``(C,)``    0 = train, 1 = valid, 2 = test
``names``   unicode ``(C,)`` chorale names
=========== ================ ==========================================================

``checksum`` is ``"sha256:<hex>"`` over the header without its checksum (canonical JSON) and the
name, dtype, shape and bytes of each array. :func:`cached_splits` rebuilds the file, with a
:class:`CacheWarning`, when it is *stale* (another format version or another ``key``) or
*corrupt* (unreadable, missing arrays, checksum mismatch, inconsistent offsets); files are
replaced atomically (:func:`relpos.atomic.atomic_path`).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_path
from ..cachedir import CACHE_ENV_VAR, default_cache_dir
from .splits import NUM_VOICES, SPLITS, ChoraleSplits

__all__ = [
    "CACHE_ENV_VAR",
    "FORMAT_VERSION",
    "CacheError",
    "CacheWarning",
    "CorruptCacheError",
    "StaleCacheError",
    "cached_splits",
    "default_cache_dir",
    "load_splits",
    "save_splits",
]

#: Bump when the file layout or the meaning of its arrays changes.
FORMAT_VERSION = 1
FORMAT_NAME = "relpos-chorales"
_ARRAYS = ("steps", "offsets", "split", "names")


class CacheWarning(UserWarning):
    """A cache file was stale, corrupt or could not be written; the data was rebuilt."""


class CacheError(Exception):
    """A cache file cannot be used."""


class CorruptCacheError(CacheError):
    """Unreadable file, missing or malformed arrays, or checksum mismatch."""


class StaleCacheError(CacheError):
    """Readable file built by another format version or with another key (versions, params)."""


def _normalise(key: Mapping[str, Any]) -> dict[str, Any]:
    """``key`` as it reads back from JSON (tuples become lists), or TypeError if not JSON-able."""
    if not isinstance(key, Mapping):
        raise TypeError(f"key: expected a mapping, got {type(key).__name__}")
    try:
        return json.loads(json.dumps(dict(key), sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"key: must be JSON-serialisable ({exc})") from None


def _checksum(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    body = {k: v for k, v in header.items() if k != "checksum"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for name in _ARRAYS:
        arr = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{arr.dtype.str}\0{arr.shape}\0".encode())
        h.update(arr.tobytes())
    return "sha256:" + h.hexdigest()


def save_splits(
    path: str | os.PathLike[str], splits: ChoraleSplits, *, key: Mapping[str, Any]
) -> None:
    """Write ``splits`` to ``path`` (atomically), tagged with ``key``.

    Args:
        path: target file; its directory must exist.
        splits: the data.
        key: JSON-serialisable mapping describing what was built (versions, parameters);
            :func:`load_splits` refuses the file unless given an equal key.
    """
    if not isinstance(splits, ChoraleSplits):
        raise TypeError(f"splits: expected ChoraleSplits, got {type(splits).__name__}")
    key = _normalise(key)
    chorales = [c for s in SPLITS for c in splits.split(s)]
    names = [n for s in SPLITS for n in splits.names(s)]
    lengths = np.array([len(c) for c in chorales], dtype=np.int64)
    arrays = {
        "steps": (
            np.concatenate(chorales).astype(np.int16)
            if chorales
            else np.zeros((0, NUM_VOICES), np.int16)
        ),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "split": np.repeat(
            np.arange(len(SPLITS), dtype=np.int8), [len(splits.split(s)) for s in SPLITS]
        ),
        "names": np.array(names, dtype=f"<U{max([1, *map(len, names)])}"),
    }
    header: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "key": key,
        "source": splits.source,
        "num_chorales": len(chorales),
        "num_steps": int(lengths.sum()),
    }
    header["checksum"] = _checksum(header, arrays)
    header_bytes = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    with atomic_path(path, suffix=".npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, header=header_bytes, **arrays)


def load_splits(path: str | os.PathLike[str], *, key: Mapping[str, Any]) -> ChoraleSplits:
    """Read a file written by :func:`save_splits`, checking version, key and checksum.

    Raises:
        FileNotFoundError: no file at ``path``.
        StaleCacheError: another format version, or a key different from ``key``.
        CorruptCacheError: anything else wrong with the file.
    """
    key = _normalise(key)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no cache file at {str(path)!r}")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"header", *_ARRAYS} - set(z.files)
            if missing:
                raise CorruptCacheError(f"missing arrays {sorted(missing)}")
            header = json.loads(z["header"].tobytes().decode("utf-8"))
            if not isinstance(header, dict):
                raise CorruptCacheError("header is not a JSON object")
            if header.get("format") != FORMAT_NAME:
                raise CorruptCacheError(
                    f"not a {FORMAT_NAME} file (format={header.get('format')!r})"
                )
            if header.get("format_version") != FORMAT_VERSION:
                raise StaleCacheError(
                    f"format version {header.get('format_version')!r}, expected {FORMAT_VERSION}"
                )
            arrays = {name: z[name] for name in _ARRAYS}
    except CacheError:
        raise
    except Exception as exc:  # zipfile.BadZipFile, OSError, ValueError, EOFError, ...
        raise CorruptCacheError(f"unreadable ({type(exc).__name__}: {exc})") from exc
    if header.get("checksum") != _checksum(header, arrays):
        raise CorruptCacheError("checksum mismatch")
    if header.get("key") != key:
        raise StaleCacheError(f"built with {header.get('key')!r}, wanted {key!r}")
    steps, offsets, split, names = (arrays[n] for n in _ARRAYS)
    n = len(names)
    if (
        steps.dtype != np.int16
        or steps.ndim != 2
        or steps.shape[1] != NUM_VOICES
        or offsets.dtype != np.int64
        or offsets.shape != (n + 1,)
        or split.shape != (n,)
        or names.dtype.kind != "U"
        or offsets[0] != 0
        or offsets[-1] != len(steps)
        or np.any(np.diff(offsets) < 0)
        or np.any((split < 0) | (split >= len(SPLITS)))
    ):
        raise CorruptCacheError("inconsistent arrays")
    # Slices of one array: chorales are views, the whole corpus stays in one block.
    parts: dict[str, tuple[list[np.ndarray], list[str]]] = {s: ([], []) for s in SPLITS}
    for i in range(n):
        chorales, chorale_names = parts[SPLITS[int(split[i])]]
        chorales.append(steps[offsets[i] : offsets[i + 1]])
        chorale_names.append(str(names[i]))
    return ChoraleSplits.from_parts(parts, source=str(header.get("source", "")))


def cached_splits(
    path: str | os.PathLike[str],
    key: Mapping[str, Any],
    build: Callable[[], ChoraleSplits],
    *,
    rebuild: bool = False,
) -> ChoraleSplits:
    """Load ``path`` if it holds valid data for ``key``, else ``build()`` and write it.

    A stale or corrupt file triggers a :class:`CacheWarning` and a rebuild; a missing file is
    built silently. If the file can't be written (read-only directory, full disk) the built data
    is still returned, with a :class:`CacheWarning`. The parent directory is created if needed.

    Args:
        path: the cache file.
        key: JSON-serialisable description of what ``build`` makes (see :func:`save_splits`).
        build: makes the data when the cache can't be used.
        rebuild: ignore any existing file.
    """
    path = Path(path)
    key = _normalise(key)
    if not rebuild and path.exists():
        try:
            return load_splits(path, key=key)
        except StaleCacheError as exc:
            warnings.warn(
                f"chorale cache {str(path)!r} is stale ({exc}); rebuilding it",
                CacheWarning,
                stacklevel=2,
            )
        except CorruptCacheError as exc:
            warnings.warn(
                f"chorale cache {str(path)!r} is corrupt ({exc}); rebuilding it",
                CacheWarning,
                stacklevel=2,
            )
    splits = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_splits(path, splits, key=key)
    except OSError as exc:
        warnings.warn(
            f"could not write chorale cache {str(path)!r} ({exc}); continuing without it",
            CacheWarning,
            stacklevel=2,
        )
    return splits
