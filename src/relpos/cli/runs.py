"""Run folders for ``relpos eval`` and ``relpos generate``: the folder, its model (from a
checkpoint, with the moving average where the run kept one), its chorales; every error names the
flag that led to it."""

from __future__ import annotations

import os
from pathlib import Path

from .argtypes import SPLIT_NAMES
from .checks import CLIError, check_data, input_file

__all__ = ["load_model", "parse_splits", "run_chorales", "run_folder"]


def run_folder(flag: str, path: str | os.PathLike[str]) -> Path:
    """An existing run folder (for ``eval`` and ``generate``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CLIError(
            f"{flag}: {p} does not exist (expected the folder of a run: relpos train --run-dir "
            f"{p} writes one)"
        )
    if not p.is_dir():
        raise CLIError(f"{flag}: {p} is not a folder (expected the folder of a run)")
    return p


def load_model(run_dir: Path, which: str):
    """The model of a run folder, from ``best``/``last`` checkpoint or a checkpoint path."""
    import torch

    from ..models import Transformer
    from ..training import TrainConfig, load_checkpoint

    if which in ("best", "last"):
        path = run_dir / f"{which}.pt"
        if not path.exists():
            other = run_dir / ("last.pt" if which == "best" else "best.pt")
            if not other.is_file():
                raise CLIError(
                    f"--run-dir {run_dir}: holds no checkpoint (best.pt or last.pt): not the "
                    "folder of a run, or a run that has not written one yet"
                )
            raise CLIError(
                f"--checkpoint {which}: {path} does not exist (the run has {other.name}: pass "
                f"--checkpoint {other.stem})"
            )
    else:
        path = input_file("--checkpoint", which, "best, last, or a checkpoint file")
    try:
        state = load_checkpoint(path)
    except (ValueError, TypeError) as e:
        raise CLIError(f"--checkpoint: {e}") from None
    try:
        cfg = TrainConfig.from_dict(state["config"])
    except (ValueError, TypeError) as e:
        raise CLIError(f"--checkpoint: {path} holds an invalid config: {e}") from None
    # A run that kept a moving average of its weights is evaluated (and generates) with it.
    average = state.get("ema")
    weights = average.get("model") if isinstance(average, dict) else state["model"]
    if not isinstance(weights, dict):
        raise CLIError(f"--checkpoint: {path} holds no model weights")
    bad = [
        name
        for name, t in weights.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(t.isfinite().all())
    ]
    if bad:
        raise CLIError(
            f"--checkpoint: {path} (step {state.get('step')}) holds non-finite weights (NaN or "
            f"inf in {len(bad)} tensor(s), e.g. {bad[0]}): the run diverged before it was "
            "written; use an earlier checkpoint (--checkpoint best, last or a path) or retrain "
            "with a lower --lr"
        )
    model = Transformer(cfg.model)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise CLIError(f"--checkpoint: {path} does not match its own config ({first})") from None
    return model.eval(), cfg, state, path


def run_chorales(cfg, flag: str):
    """The chorales of the run's data (:func:`relpos.music.load_chorales`); errors name ``flag``."""
    from ..music import load_chorales

    check_data(f"the run's data, which {flag} reads", cfg.data)
    try:
        return load_chorales(cfg.data, progress=False)
    except ValueError as e:
        raise CLIError(f"{flag}: {e}") from None


def parse_splits(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise CLIError(f"--splits: expected a comma-separated list of {SPLIT_NAMES}, got {text!r}")
    for name in names:
        if name not in SPLIT_NAMES:
            raise CLIError(f"--splits: unknown split {name!r}; expected some of {SPLIT_NAMES}")
    return list(dict.fromkeys(names))
