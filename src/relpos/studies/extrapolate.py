"""The chorale extrapolation cell: train on windows of ``N`` tokens, score longer windows.

Training is the ordinary trainer (:func:`relpos.training.train`) in the cell's folder, so an
interrupted cell resumes from its ``last.pt`` with the same data order. The best checkpoint (by
validation NLL at ``N``) is then scored on the **test** chorales with :func:`evaluate_nll` at each
test length ``L``: every token of every test chorale scored once, the chorales cut into windows
of ``L`` tokens at time-step boundaries (each window's context restarts at its first token). A
longer window gives the model more of the chorale to condition on, at positions (and distances)
it never saw in training; a scheme that extrapolates gets a lower NLL as ``L`` grows, one that
does not gets a higher one.

A learned absolute table of ``max_len`` positions cannot read a window longer than ``max_len``:
that length is reported as ``None`` with a note, not run.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from ..models.transformer import Transformer
from ..training.checkpoint import load_checkpoint
from ..training.config import TrainConfig
from ..training.dataset import TokenDataset
from ..training.evaluate import evaluate_nll
from ..training.loop import RUN_FILES, train

__all__ = ["CellInterrupted", "chorale_cell"]


class CellInterrupted(Exception):
    """Training stopped on a signal (Ctrl-C, SIGTERM) with ``last.pt`` written; rerun resumes."""

    def __init__(self, exit_status: int) -> None:
        super().__init__(f"interrupted (exit status {exit_status})")
        self.exit_status = exit_status


def chorale_cell(
    cfg: TrainConfig,
    cell_dir: Path,
    data: TokenDataset,
    test_lengths: tuple[int, ...],
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) the run ``cfg`` in ``cell_dir``; NLL of its best checkpoint on the test
    split at each test length.

    Returns ``{"values": {L: nll or None}, "notes", "parameters", "train_seconds",
    "eval_seconds", "best_valid_nll", "best_step"}``.

    Raises:
        CellInterrupted: a signal stopped training (``last.pt`` holds the last step).
        TrainingDiverged: the run diverged.
    """
    cell_dir.mkdir(parents=True, exist_ok=True)
    resume = (cell_dir / "last.pt").is_file()
    if resume:
        saved = load_checkpoint(cell_dir / "last.pt", mmap=True)["config"]
        if saved != cfg.with_absolute_data().to_dict():
            raise ValueError(f"{cell_dir} holds another run; delete the folder to start it over")
    else:  # a run killed before its first checkpoint: start it over
        for name in RUN_FILES:
            (cell_dir / name).unlink(missing_ok=True)
    t0 = time.perf_counter()
    summary = train(None if resume else cfg, cell_dir, resume=resume, progress=progress, data=data)
    if summary["interrupted"]:
        raise CellInterrupted(int(summary["exit_status"] or 130))
    train_seconds = time.perf_counter() - t0
    state = load_checkpoint(cell_dir / "best.pt")
    run_cfg = TrainConfig.from_dict(state["config"])
    model = Transformer(run_cfg.model)
    average = state.get("ema")
    model.load_state_dict(average["model"] if isinstance(average, dict) else state["model"])
    model.eval()
    scheme = run_cfg.model.scheme
    limit = scheme["max_len"] if scheme["name"] == "learned" else None
    values: dict[int, float | None] = {}
    notes: list[str] = []
    t1 = time.perf_counter()
    for length in test_lengths:
        if limit is not None and length > limit:
            values[length] = None
            notes.append(f"{length}: the learned table holds {limit} positions")
            continue
        nll = evaluate_nll(model, data.test, context=length, grid=data.grid)
        values[length] = nll if math.isfinite(nll) else None
        if not math.isfinite(nll):
            notes.append(f"{length}: the NLL is not finite ({nll})")
    return {
        "values": values,
        "notes": notes,
        "parameters": model.num_parameters(),
        "train_seconds": train_seconds,
        "eval_seconds": time.perf_counter() - t1,
        "best_valid_nll": state.get("best_valid_nll"),
        "best_step": state["step"],
    }
