"""Checkpoints: written atomically, loaded with ``weights_only=True``, checked before use.

A checkpoint is a plain dict of tensors and Python values (no pickled objects): the model and
optimiser states, the step, the RNG states and the run's config. It is written to a temporary
file and renamed into place, so the previous checkpoint stays usable if anything fails midway;
loading checks every member of its zip archive against its CRC-32 first.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_path

__all__ = ["FORMAT_VERSION", "load_checkpoint", "save_checkpoint"]

FORMAT_VERSION = 1
_REQUIRED = ("format", "step", "model", "optimizer", "config")


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (plus the format version) to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save({"format": FORMAT_VERSION, **state}, tmp)
    return path


def _load_error(path: Path, e: Exception) -> str:
    """Why ``torch.load`` failed, in our words.

    torch's own message for a file holding Python objects advises loading it with
    ``weights_only=False`` (or allow-listing the class), which runs code from the file; a
    checkpoint from elsewhere is untrusted, so that advice is never passed on.
    """
    text = str(e)
    if isinstance(e, pickle.UnpicklingError) or "weights_only" in text:
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if found:
            return (
                f"checkpoint {path} is not a relpos checkpoint: it holds Python objects "
                f"({found.group(1)}), not only tensors and plain values; relpos never runs code "
                "from a checkpoint, so it does not load this file"
            )
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        why = detail.group(1).strip() if detail else "not a pickle of tensors and plain values"
        return f"checkpoint {path} is corrupt or not a relpos checkpoint ({why})"
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"checkpoint {path} is corrupt or not a relpos checkpoint ({first})"


def _check_crcs(path: Path) -> None:
    """Every member of the checkpoint's zip archive against its CRC-32: ``torch.load`` reads
    tensors without checking them, so a flipped bit would load as a wrong weight, silently."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"checkpoint {path} is corrupt or not a relpos checkpoint ({e})") from None
    if bad is not None:
        raise ValueError(
            f"checkpoint {path} is corrupt: {bad} does not match its checksum (CRC-32); use "
            "another checkpoint (--checkpoint best, last or a path)"
        )


def load_checkpoint(path: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """Load and check a checkpoint; a clear ``ValueError`` if it is missing pieces or corrupt.
    With ``mmap`` its tensors are mapped from the file, not read: for a caller that reads the
    config alone (``relpos train --resume`` before the run loads it whole)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    _check_crcs(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise ValueError(_load_error(path, e)) from None
    if not isinstance(state, dict) or any(k not in state for k in _REQUIRED):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"checkpoint {path} is not a relpos checkpoint: expected keys "
            f"{list(_REQUIRED)}, found {keys}"
        )
    if state["format"] != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {state['format']}, this relpos reads "
            f"format {FORMAT_VERSION}"
        )
    return state
