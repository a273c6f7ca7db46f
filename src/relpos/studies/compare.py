"""``relpos compare``: train and test a list of schemes on one task, resumably.

The run folder::

    compare.json        the spec (:class:`~.spec.CompareSpec`), the schemes and the seeds
    cells/<scheme>-seed<k>/
        result.json     the cell's results; its presence means the cell is finished
        last.pt, ...    the cell's training state (a synthetic cell: last.pt; a chorale cell:
                        a whole trainer run folder)
    results.json        every finished cell, and per scheme and length the mean, min and max
    table.md            the table (one row per scheme, one column per test length)
    curves.png          the metric against the test length, one curve per scheme

A *cell* is one (scheme, seed). A rerun of the same comparison skips finished cells, resumes an
interrupted one from its last checkpoint, and rewrites the table, results and plot after every
cell (each file atomically). A rerun may add schemes or seeds; it may not change the spec: a
folder holding another comparison (another task, lengths, model or budget), or anything that is
not a comparison, is refused before anything is written.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from ..models.transformer import TransformerConfig
from ..training.config import TrainConfig
from ..training.dataset import TokenDataset
from ..training.loop import TrainingDiverged
from . import extrapolate, synthetic
from .report import json_safe, write_report
from .spec import CompareSpec, check_grid, scheme_label
from .tasks import sequence_length, vocab_size

__all__ = [
    "GRID_FILE",
    "ComparisonMismatch",
    "Grid",
    "cell_config",
    "cell_name",
    "prepare",
    "run_compare",
]

GRID_FILE = "compare.json"
FORMAT = 1
#: Seed of the held-out test strings: the same for every scheme and training seed.
TEST_SEED = 20230531


class ComparisonMismatch(ValueError):
    """The run folder holds another comparison, or something that is not a comparison."""


def cell_name(label: str, seed: int) -> str:
    """The cell's folder name: the scheme label with unsafe characters replaced, and the seed."""
    return f"{re.sub(r'[^A-Za-z0-9._=-]', '_', label)}-seed{seed}"


class Grid:
    """The comparison in a folder: its spec, its schemes (labels and dicts) and seeds."""

    def __init__(self, spec: CompareSpec, schemes: list[dict[str, Any]], seeds: list[int]):
        self.spec, self.schemes, self.seeds = spec, schemes, seeds

    @property
    def labels(self) -> list[str]:
        return [scheme_label(s) for s in self.schemes]

    def cells(self) -> list[tuple[dict[str, Any], int]]:
        """Every (scheme, seed), seed by seed: the first seed's row of the table fills first."""
        return [(s, seed) for seed in self.seeds for s in self.schemes]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "spec": self.spec.to_dict(),
            "schemes": self.schemes,
            "seeds": self.seeds,
        }


def _saved_grid(run_dir: Path) -> Grid | None:
    path = run_dir / GRID_FILE
    if not path.exists():
        if run_dir.is_dir() and any(run_dir.iterdir()):
            found = sorted(p.name for p in run_dir.iterdir())[:5]
            raise ComparisonMismatch(
                f"{run_dir} is not empty ({', '.join(found)}) and holds no {GRID_FILE}: it is not "
                "a comparison's folder; choose a new or empty --run-dir"
            )
        return None
    try:
        saved = json.loads(path.read_text())
        if saved.get("format") != FORMAT:
            raise ValueError(f"format {saved.get('format')!r}, expected {FORMAT}")
        return Grid(CompareSpec.from_dict(saved["spec"]), saved["schemes"], saved["seeds"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ComparisonMismatch(
            f"{path} cannot be read as a comparison ({e}); choose another --run-dir"
        ) from None


def prepare(
    run_dir: Path, spec: CompareSpec, schemes: list[str], seeds: list[int]
) -> tuple[Grid, list[tuple[dict[str, Any], int]]]:
    """Check the request against the folder, before anything is written.

    Returns the folder's grid after this request (the saved schemes and seeds, then the new
    ones) and the cells this request asks for.

    Raises:
        ValueError: an unknown scheme, a repeated one, a bad seed, a learned table shorter than
            the training sequences.
        ComparisonMismatch: the folder holds another comparison, or other files.
    """
    parsed = check_grid(schemes, seeds)
    for scheme in parsed:
        cell_config(spec, scheme, 0)  # a scheme that cannot train on this task fails here
    if run_dir.exists() and not run_dir.is_dir():
        raise ComparisonMismatch(f"{run_dir} exists and is not a folder")
    saved = _saved_grid(run_dir)
    if saved is None:
        grid = Grid(spec, parsed, list(dict.fromkeys(seeds)))
    else:
        if saved.spec != spec:
            old, new = saved.spec.to_dict(), spec.to_dict()
            diff = [f"{k}: {old[k]!r} there, {new[k]!r} asked" for k in old if old[k] != new[k]]
            raise ComparisonMismatch(
                f"{run_dir} holds another comparison ({'; '.join(diff)}); repeat its settings to "
                "continue it, or choose another --run-dir"
            )
        labels = [scheme_label(s) for s in saved.schemes]
        extra = [s for s in parsed if scheme_label(s) not in labels]
        grid = Grid(spec, saved.schemes + extra, list(dict.fromkeys([*saved.seeds, *seeds])))
    wanted = {scheme_label(s) for s in parsed}
    asked = [(s, seed) for s, seed in grid.cells() if scheme_label(s) in wanted and seed in seeds]
    return grid, asked


def cell_config(spec: CompareSpec, scheme: dict[str, Any], seed: int) -> TrainConfig:
    """The training config of one cell (a :class:`TrainConfig`, as the trainer's)."""
    if spec.synthetic:
        vocab, context = vocab_size(spec.task), sequence_length(spec.task, spec.train_length) - 1
        data = f"synthetic:{spec.task}"
    else:
        from ..music import VOCAB_SIZE

        vocab, context, data = VOCAB_SIZE, spec.train_length, spec.data
    model = TransformerConfig(
        vocab_size=vocab,
        d_model=spec.d_model,
        num_heads=spec.num_heads,
        num_layers=spec.num_layers,
        dropout=spec.dropout,
        scheme=scheme,
        backend=spec.backend,
    )
    if model.scheme["name"] == "learned" and model.scheme["max_len"] < context:
        raise ValueError(
            f"schemes: {scheme_label(scheme)} holds {model.scheme['max_len']} positions, fewer "
            f"than the {context} of a training sequence; raise its max_len"
        )
    return TrainConfig(
        model=model,
        data=data,
        context=context,
        batch_size=spec.batch_size,
        steps=spec.steps,
        lr=spec.lr,
        warmup=spec.warmup,
        eval_every=spec.eval_every,
        max_shift=spec.max_shift,
        seed=seed,
    )


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return result if isinstance(result, dict) and "values" in result else None


def _summary_text(spec: CompareSpec, values: dict[str, Any]) -> str:
    parts = []
    for n, v in values.items():
        if v is None:
            parts.append(f"{n}: n/a")
        elif spec.synthetic:
            parts.append(f"{n}: {100 * v:.0f}%")
        else:
            parts.append(f"{n}: {v:.3f}")
    return ", ".join(parts)


def run_compare(
    spec: CompareSpec,
    schemes: list[str],
    seeds: list[int],
    run_dir: str | Path,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    data: TokenDataset | None = None,
    command: str = "",
) -> dict[str, Any]:
    """Run the cells of ``schemes`` × ``seeds`` not finished yet; write the table, results and
    plot after each.

    Args:
        data: the chorales (a chorale task); default: loaded from ``spec.data``.
        command: the command line, recorded in the table.

    Returns:
        ``{"run_dir", "cells", "ran", "skipped", "paths", "interrupted", "exit_status"}``.

    Raises:
        ValueError, ComparisonMismatch: see :func:`prepare` (nothing written).
    """
    run_dir = Path(run_dir)
    grid, asked = prepare(run_dir, spec, schemes, seeds)
    if not spec.synthetic and data is None:
        from ..music import load_token_data

        data = load_token_data(spec.data, max_shift=spec.max_shift, progress=progress)
    run_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(run_dir / GRID_FILE) as tmp:
        tmp.write_text(json.dumps(grid.to_dict(), indent=2) + "\n")

    def finished() -> list[dict[str, Any]]:
        out = []
        for scheme, seed in grid.cells():
            result = _read_result(
                run_dir / "cells" / cell_name(scheme_label(scheme), seed) / "result.json"
            )
            if result is not None:
                out.append(result)
        return out

    ran, skipped, exit_status = 0, 0, 0
    paths: dict[str, Path] = {}
    for i, (scheme, seed) in enumerate(asked, 1):
        label = scheme_label(scheme)
        cell_dir = run_dir / "cells" / cell_name(label, seed)
        where = f"[{i}/{len(asked)}] {label} seed {seed}"
        if _read_result(cell_dir / "result.json") is not None:
            log(f"{where}: finished earlier, skipped")
            skipped += 1
            continue
        cfg = cell_config(spec, scheme, seed)
        resuming = (cell_dir / "last.pt").is_file()
        log(f"{where}: {'resuming' if resuming else 'training'} ({spec.steps} steps)")
        start = time.perf_counter()
        try:
            if spec.synthetic:
                result = synthetic.synthetic_cell(
                    cfg, spec, cell_dir, test_seed=TEST_SEED, progress=progress
                )
            else:
                assert data is not None
                result = extrapolate.chorale_cell(
                    cfg, cell_dir, data, spec.test_lengths, progress=progress
                )
        except TrainingDiverged as e:
            result = {"values": dict.fromkeys(spec.test_lengths), "notes": [str(e)]}
            result["diverged"] = True
        except extrapolate.CellInterrupted as e:
            exit_status = e.exit_status
            log(f"{where}: interrupted; rerun the same command to continue")
            break
        result = {
            "scheme": label,
            "seed": seed,
            **result,
            "values": {str(k): v for k, v in result["values"].items()},
        }
        cell_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(cell_dir / "result.json") as tmp:
            tmp.write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
        ran += 1
        log(
            f"{where}: done in {time.perf_counter() - start:.0f} s — "
            f"{_summary_text(spec, result['values'])}"
        )
        paths = write_report(run_dir, spec, grid.labels, grid.seeds, finished(), command=command)
    if not paths:  # nothing ran (all finished earlier, or interrupted at once): refresh anyway
        paths = write_report(run_dir, spec, grid.labels, grid.seeds, finished(), command=command)
    return {
        "run_dir": str(run_dir),
        "cells": len(asked),
        "ran": ran,
        "skipped": skipped,
        "paths": paths,
        "interrupted": exit_status != 0,
        "exit_status": exit_status,
    }
