"""Atomic file writes: write a temporary file beside the target, fsync it, ``os.replace`` it.

A reader never sees a half-written file, and a crash or an exception leaves the old file (or no
file) and no temporary file behind. A process killed outright (SIGKILL, power loss) runs no
cleanup: its temporary file stays, under a name :func:`stale_temporaries` recognises, for the
next writer of that folder to remove (:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_path",
    "check_writable",
    "remove_stale_temporaries",
    "save_png",
    "stale_temporaries",
]

# The random part of a tempfile.mkstemp name: 8 characters of this alphabet.
_RANDOM = r"[a-z0-9_]{8}"

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


def check_writable(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Raise an ``OSError`` naming the path unless :func:`atomic_path` can write every one of
    ``paths`` (their folders must exist): a temporary file is created beside each and removed,
    and moved onto a path that does not exist yet (then removed too), so a folder where a file
    belongs, a read-only folder or a file system that refuses the name is found before any work
    rather than at the first write. An existing file is left untouched (replacing it needs only
    its folder).
    """
    for path in paths:
        target = Path(path)
        if target.is_dir():
            raise IsADirectoryError(f"cannot write {target}: a folder is in its place")
        try:
            fd, tmp_name = tempfile.mkstemp(
                dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
            )
        except OSError as e:
            raise type(e)(f"cannot write {target}: {e.strerror or e}") from None
        os.close(fd)
        try:
            if not target.exists():
                os.replace(tmp_name, target)
                target.unlink()
        except OSError as e:
            raise type(e)(f"cannot write {target}: {e.strerror or e}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def save_png(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Lay out a matplotlib figure, write it as a PNG at ``path`` atomically, and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        fig.tight_layout()
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return path


def stale_temporaries(directory: str | os.PathLike[str], names: Iterable[str]) -> list[Path]:
    """The temporary files :func:`atomic_path` left in ``directory`` for the targets ``names``.

    Only regular files (not links, not folders) named exactly as :func:`atomic_path` names them,
    ``.<name>.<8 random characters>.tmp<suffix>``, for one of ``names``; sorted.
    """
    directory = Path(directory)
    targets = "|".join(re.escape(n) for n in names if n)
    if not targets:
        return []
    pattern = re.compile(rf"\.(?:{targets})\.{_RANDOM}\.tmp(?:\.[A-Za-z0-9]+)?")
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not pattern.fullmatch(entry.name):
            continue
        try:
            regular = stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode)
        except FileNotFoundError:  # gone meanwhile
            continue
        if regular:
            found.append(Path(entry.path))
    return sorted(found)


def remove_stale_temporaries(directory: str | os.PathLike[str], names: Iterable[str]) -> list[Path]:
    """Remove what :func:`stale_temporaries` finds; return the paths removed.

    Call it only where no other process is writing those targets at the same time (a run folder
    when its one trainer starts): a live writer's temporary file looks the same as a dead one's.
    """
    removed = []
    for path in stale_temporaries(directory, names):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
