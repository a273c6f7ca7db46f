"""What the command line checks of its arguments before any work: files, folders, data.

Every failure is a :class:`CLIError`, one line naming the flag, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "CLIError",
    "Parser",
    "UsageError",
    "check_data",
    "input_file",
    "output_folder",
    "writable_run_files",
]


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class UsageError(CLIError):
    """A malformed command line (argparse's errors), printed as one line instead of the usage."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing the usage and exiting, so that
    every mistake ends the same way (one line, status 2) and ``main`` returns in-process."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(self.prog, message)


def input_file(flag: str, path: str | os.PathLike[str], expected: str) -> Path:
    """An existing regular file, or a :class:`CLIError` naming ``flag``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CLIError(f"{flag}: {p} does not exist (expected {expected})")
    if p.is_dir():
        raise CLIError(f"{flag}: {p} is a folder, expected {expected}")
    if not os.access(p, os.R_OK):
        raise CLIError(f"{flag}: {p} is not readable (permission denied)")
    return p


def output_folder(flag: str, path: str | os.PathLike[str]) -> Path:
    """A folder that exists and is writable, or that can be created."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise CLIError(f"{flag}: {p} exists and is not a folder")
    ancestor = p
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CLIError(f"{flag}: cannot create {p}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CLIError(f"{flag}: cannot write in {ancestor} (permission denied)")
    # Permission bits are not the whole story (root, /proc, a read-only mount): try a file.
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".relpos-probe.", suffix=".tmp")
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise CLIError(f"{flag}: cannot create {p}: cannot write in {ancestor} ({why})") from None
    os.close(fd)
    os.unlink(probe)
    return p


def writable_run_files(flag: str, folder: Path, names: Iterable[str]) -> None:
    """The files ``names`` of an existing run ``folder`` can be written
    (:func:`relpos.atomic.check_writable`), or a :class:`CLIError` naming ``flag``: a folder
    named ``last.pt`` is found before training, not at the first checkpoint."""
    from ..atomic import check_writable

    if not folder.is_dir():
        return  # created by the run, empty: output_folder checked its parent
    try:
        check_writable(folder / name for name in names)
    except OSError as e:
        raise CLIError(f"{flag}: {e}") from None


def check_data(flag: str, data: str) -> None:
    """``--data``: ``music21`` with the package installed, ``jsb`` with the packaged split
    present, or an existing file."""
    if data == "music21":
        if importlib.util.find_spec("music21") is None:
            raise CLIError(
                f"{flag} music21: the music21 package is not installed (pip install "
                "'relpos[music]'), or pass 'jsb' or a JSB JSON file"
            )
        return
    if data == "jsb":
        from ..music.jsb import packaged_jsb_path

        try:
            packaged_jsb_path()
        except FileNotFoundError as e:
            raise CLIError(f"{flag} {e}") from None
        return
    input_file(flag, data, "'music21', 'jsb' or a JSB JSON file")
