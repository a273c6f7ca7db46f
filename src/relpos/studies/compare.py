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
not a comparison, is refused before anything is written. So is a scheme that cannot train with
these settings (:func:`check_cell`: its model cannot be built, or its backend cannot train it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_path
from ..attention import MultiheadAttention, get_backend
from ..attention.chunked import chunked_supports
from ..attention.flex import flex_supports
from ..attention.fused import fused_supports
from ..attention.sdpa import sdpa_supports
from ..models.transformer import Transformer, TransformerConfig
from ..positions import Positions
from ..schemes.base import Scheme
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
    "cell_device",
    "cell_name",
    "check_cell",
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
            the training sequences, a scheme whose model cannot be built or whose backend cannot
            train it (:func:`check_cell`).
        ComparisonMismatch: the folder holds another comparison, or other files.
    """
    parsed = check_grid(schemes, seeds)
    for scheme in parsed:
        check_cell(spec, scheme)  # a scheme that cannot train with these settings fails here
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


def cell_device(spec: CompareSpec) -> torch.device:
    """Where a cell trains: a synthetic cell on the CPU (:func:`.synthetic.train_synthetic`), a
    chorale cell where :func:`relpos.training.train` puts it by default (CUDA when there is one)."""
    if spec.synthetic:
        return torch.device("cpu")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _trains(backend: str, scheme: Scheme, device: torch.device, dropout: float) -> bool:
    """Whether ``backend`` can train ``scheme`` on ``device``: the backend's own support check,
    with gradients (``flex`` also refuses attention dropout in training)."""
    if backend == "sdpa":
        return sdpa_supports(scheme, device=device, needs_grad=True)
    if backend == "chunked":
        return chunked_supports(scheme)
    if backend == "flex":
        return flex_supports(scheme, device=device, needs_grad=True) and dropout == 0
    if backend == "fused":
        return fused_supports(scheme, device=device)
    return True  # eager runs every scheme; auto picks, per call, a backend that can


def _refusal(attn: MultiheadAttention, device: torch.device) -> str:
    """Why ``attn``'s backend refuses to train its scheme, in the backend's own words: a call on
    a two-token input, which it refuses before computing anything (:func:`_trains` said so)."""
    name = attn.backend
    try:
        q, k, v = (
            torch.zeros(1, attn.num_heads, 2, attn.head_dim, device=device, requires_grad=True)
            for _ in range(3)
        )
        positions = Positions.from_length(2, device=device)
        with torch.enable_grad():
            get_backend(name)(
                q,
                k,
                v,
                attn.scheme,
                positions,
                positions,
                causal=attn.causal,
                dropout_p=attn.dropout,
                training=True,
            )
    except ValueError as e:
        return str(e)
    except Exception:  # a device it cannot reach, say: fall back to the words below
        pass
    return f"the {name} backend cannot train scheme {type(attn.scheme).__name__} on {device.type}"


def _probe(model: TransformerConfig) -> Transformer:
    """The cell's model with one layer and a one-unit MLP (a comparison's layers are alike, and
    its MLP holds no positions), on the CPU, the random state left as it was."""
    with torch.random.fork_rng(devices=[]):
        return Transformer(dataclasses.replace(model, num_layers=1, d_ff=1))


def check_cell(spec: CompareSpec, scheme: dict[str, Any]) -> None:
    """Refuse a scheme that cannot train with ``spec``, before anything is written: build the
    model a cell builds (:func:`_probe`), and ask the backend whether it can train every layer's
    scheme on the device the cell trains on (:func:`cell_device`), with gradients and the
    spec's dropout: ``sdpa_supports``, ``chunked_supports``, ``flex_supports`` or
    ``fused_supports``; the reason given is the backend's own.

    Raises:
        ValueError: beginning ``schemes:`` (the scheme's own fields cannot be built with this
            model, e.g. ``alibi:heads=[7]`` with 2 heads; or a learned table shorter than the
            training sequences), ``d_model/num_heads:`` (the scheme as named, without fields,
            cannot be built at this width, e.g. ``rope`` with a head dim of 3) or ``backend:``
            (the backend cannot train it).
    """
    cfg = cell_config(spec, scheme, 0)
    label = scheme_label(scheme)
    try:
        model = _probe(cfg.model)
    except (ValueError, TypeError) as e:
        if len(scheme) > 1:  # fields given: are they to blame, or the width?
            try:
                _probe(dataclasses.replace(cfg.model, scheme={"name": scheme["name"]}))
            except (ValueError, TypeError):
                pass
            else:
                raise ValueError(f"schemes: {label} cannot be built: {e}") from None
        d, h = spec.d_model, spec.num_heads
        raise ValueError(
            f"d_model/num_heads: {label} cannot be built with d_model {d} and num_heads {h} "
            f"(head dim {d // h}): {e}"
        ) from None
    device = cell_device(spec)
    for attn in model.modules():
        if isinstance(attn, MultiheadAttention) and not _trains(
            attn.backend, attn.scheme, device, attn.dropout
        ):
            raise ValueError(
                f"backend: {spec.backend} cannot train {label} (a cell trains on {device.type}): "
                f"{_refusal(attn, device)}"
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
