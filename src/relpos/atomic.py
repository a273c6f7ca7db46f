"""Atomic file writes: write a temporary file beside the target, fsync it, ``os.replace`` it.

A reader never sees a half-written file, and a crash or an exception leaves the old file (or no
file) and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path"]

# The process umask, read once, so that finished files get the usual permissions (mkstemp
# creates them 0600).
_UMASK = os.umask(0)
os.umask(_UMASK)


def _fsync_path(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); silently skipped where directories can't be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, suffix: str = "") -> Iterator[Path]:
    """Context manager giving a temporary path to write; on success it replaces ``path``.

    The temporary file is created (empty) in ``path``'s directory, named
    ``.<name>.<random>.tmp<suffix>`` (``suffix`` helps writers that choose a format by extension).
    When the block exits normally the file is fsynced and moved onto ``path`` with
    :func:`os.replace`; when it raises, the temporary file is removed and the exception
    propagates. The parent directory must exist.
    """
    target = Path(path)
    directory = target.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"path: directory {str(directory)!r} does not exist")
    fd, tmp_name = tempfile.mkstemp(
        dir=directory, prefix=f".{target.name}.", suffix=f".tmp{suffix}"
    )
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"the writer did not produce the temporary file {tmp}")
        os.chmod(tmp, 0o666 & ~_UMASK)
        _fsync_path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(directory)
