"""A comparison's table (markdown and JSON) and plot, from its finished cells.

Pure functions of the cells' results; :func:`write_report` writes the three files atomically.
A cell result is ``{"scheme": label, "seed": int, "values": {length: value or None}, "notes":
[...], ...}``; a value is ``None`` where the scheme could not be tested (a length past a learned
table) or the cell diverged.

A folder whose schemes do not all have every seed finished (a rerun added schemes or seeds) says
so: a value from fewer seeds than the folder's is marked ``[k/n seeds]``, and every (scheme, seed)
without a finished cell is listed as not finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from .spec import CompareSpec

__all__ = [
    "PLOT",
    "RESULTS",
    "TABLE",
    "json_safe",
    "metric_of",
    "not_finished",
    "render_table",
    "summarise",
    "write_report",
]

TABLE, RESULTS, PLOT = "table.md", "results.json", "curves.png"


def metric_of(spec: CompareSpec) -> dict[str, Any]:
    """What the cells measure: its key, its words, whether higher is better, how to print it."""
    if spec.synthetic:
        return {
            "key": "exact_match",
            "name": "exact-match accuracy (%)",
            "higher_is_better": True,
            "scale": 100.0,
            "digits": 0,
        }
    return {
        "key": "nll",
        "name": "test NLL (nats per token)",
        "higher_is_better": False,
        "scale": 1.0,
        "digits": 3,
    }


def summarise(
    cells: list[dict[str, Any]],
    schemes: list[str],
    lengths: list[int],
    key: str = "values",
    *,
    seeds: int | None = None,
) -> dict:
    """Per scheme and length: the mean, min and max of the cells' ``key`` over the seeds with a
    value, how many seeds finished (``n``) and had a value (``n_valid``), and how many the
    comparison holds (``seeds``; default ``n``: a scheme with fewer finished has cells to run)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label in schemes:
        mine = [c for c in cells if c["scheme"] == label]
        if not mine:
            continue
        row = {}
        for length in lengths:
            vals = [(c.get(key) or {}).get(str(length)) for c in mine]
            got = [v for v in vals if v is not None]
            row[str(length)] = {
                "mean": sum(got) / len(got) if got else None,
                "min": min(got) if got else None,
                "max": max(got) if got else None,
                "n": len(vals),
                "n_valid": len(got),
                "seeds": len(vals) if seeds is None else seeds,
            }
        out[label] = row
    return out


def _cell_text(entry: dict[str, Any], metric: dict[str, Any]) -> str:
    if entry["mean"] is None:
        return "n/a"
    scale, digits = metric["scale"], metric["digits"]
    text = f"{entry['mean'] * scale:.{digits}f}"
    if entry["n_valid"] > 1:
        text += f" ({entry['min'] * scale:.{digits}f}–{entry['max'] * scale:.{digits}f})"
    total = entry.get("seeds", entry["n"])
    if entry["n_valid"] < total:
        text += f" [{entry['n_valid']}/{total} seeds]"
    return text


def not_finished(
    cells: list[dict[str, Any]], schemes: list[str], seeds: list[int]
) -> list[tuple[str, int]]:
    """Every (scheme, seed) of the comparison without a finished cell, scheme by scheme."""
    done = {(c["scheme"], c["seed"]) for c in cells}
    return [(s, seed) for s in schemes for seed in seeds if (s, seed) not in done]


def _missing_text(missing: list[tuple[str, int]]) -> str:
    """``rope (seed 1), alibi (seeds 0, 1)``."""
    by_scheme: dict[str, list[int]] = {}
    for label, seed in missing:
        by_scheme.setdefault(label, []).append(seed)
    return ", ".join(
        f"{label} (seed{'s' if len(s) > 1 else ''} {', '.join(map(str, s))})"
        for label, s in by_scheme.items()
    )


def _rows(
    summary: dict, schemes: list[str], lengths: list[int], n: int, metric: dict[str, Any]
) -> list[str]:
    """A markdown table: a header, then one row per scheme with results."""
    lines = [
        "| scheme | " + " | ".join(f"{L}" + (" (N)" if L == n else "") for L in lengths) + " |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " |",
    ]
    for label in schemes:
        if label in summary:
            row = summary[label]
            cells = " | ".join(_cell_text(row[str(L)], metric) for L in lengths)
            lines.append(f"| {label} | {cells} |")
    return lines


def _setup_line(spec: CompareSpec, seeds: list[int]) -> str:
    n = spec.train_length
    model = (
        f"{spec.num_layers} layer{'s' if spec.num_layers > 1 else ''}, d_model {spec.d_model}, "
        f"{spec.num_heads} heads, dropout {spec.dropout:g}"
    )
    budget = (
        f"{spec.steps} steps of {spec.batch_size} {'examples' if spec.synthetic else 'windows'}, "
        f"lr {spec.lr:g}, warm-up {spec.warmup}"
    )
    seeds_text = f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
    if spec.synthetic:
        unit = "digits per operand" if spec.task == "add" else "digits"
        what = (
            f"Trained on strings of 1–{n} {unit}; tested by greedy decoding (KV cache) on "
            f"{spec.test_examples} held-out strings of each length (columns, in {unit}); a string "
            "counts only if every output token and the final EOS are right."
        )
    else:
        what = (
            f"Trained on windows of {n} tokens of the training chorales ({spec.data}, "
            f"transposition ±{spec.max_shift}); scored on the test chorales in windows of each "
            "length (columns, in tokens), every token once, with the checkpoint of best "
            f"validation NLL at {n}."
        )
    return f"{what} Model: {model}. Budget: {budget}; {seeds_text}."


def render_table(
    spec: CompareSpec,
    schemes: list[str],
    seeds: list[int],
    cells: list[dict[str, Any]],
    *,
    command: str = "",
) -> str:
    """The markdown table: one row per scheme, one column per test length."""
    metric = metric_of(spec)
    lengths = list(spec.test_lengths)
    summary = summarise(cells, schemes, lengths, seeds=len(seeds))
    better = "higher" if metric["higher_is_better"] else "lower"
    missing = not_finished(cells, schemes, seeds)
    partial = any(0 < e["n_valid"] < e["seeds"] for row in summary.values() for e in row.values())
    lines = [f"# relpos compare: {spec.task}", ""]
    if command:
        lines += ["```bash", command, "```", ""]
    lines += [
        _setup_line(spec, seeds),
        "",
        f"{metric['name'][0].upper()}{metric['name'][1:]} by test length ({better} is better; "
        f"training length {spec.train_length}"
        + ("; mean (min–max) over seeds" if len(seeds) > 1 else "")
        + ("; [k/n seeds]: over the k of the n seeds with a value" if partial else "")
        + "):",
        "",
        *_rows(summary, schemes, lengths, spec.train_length, metric),
    ]
    if spec.synthetic:
        tokens = summarise(cells, schemes, lengths, key="token_accuracy", seeds=len(seeds))
        lines += [
            "",
            "Token accuracy (%: the share of target tokens, EOS included, written right by the "
            "same greedy decoding; a first wrong token is fed back, so later ones may follow it):",
            "",
            *_rows(tokens, schemes, lengths, spec.train_length, {**metric, "digits": 1}),
        ]
    notes = sorted({f"{c['scheme']}: {note}" for c in cells for note in c.get("notes", [])})
    if notes or missing:
        lines.append("")
    for note in notes:
        lines.append(f"- {note}")
    if missing:
        lines.append(f"- not finished yet: {_missing_text(missing)}")
    seconds = sum(c.get("train_seconds", 0.0) + c.get("eval_seconds", 0.0) for c in cells)
    lines += [
        "",
        f"{len(cells)} of {len(schemes) * len(seeds)} cell(s) finished; {seconds / 60:.1f} "
        "minutes of training and testing.",
    ]
    return "\n".join(lines) + "\n"


def _plot(spec: CompareSpec, schemes: list[str], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = metric_of(spec)
    lengths = list(spec.test_lengths)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label in schemes:
        if label not in summary:
            continue
        row = [summary[label][str(n)] for n in lengths]
        xs = [n for n, e in zip(lengths, row, strict=True) if e["mean"] is not None]
        if not xs:
            continue
        scale = metric["scale"]
        mean = [e["mean"] * scale for e in row if e["mean"] is not None]
        (line,) = ax.plot(xs, mean, "o-", label=label)
        if any(e["n_valid"] > 1 for e in row):
            low = [e["min"] * scale for e in row if e["mean"] is not None]
            high = [e["max"] * scale for e in row if e["mean"] is not None]
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
    ax.axvline(spec.train_length, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        "training length",
        (spec.train_length, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12),
        textcoords="offset points",
        fontsize=8,
        color="grey",
    )
    if not spec.synthetic:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("test length (tokens)" if not spec.synthetic else "test length (digits)")
    ax.set_ylabel(metric["name"])
    ax.set_title(f"relpos compare: {spec.task}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_report(
    run_dir: Path,
    spec: CompareSpec,
    schemes: list[str],
    seeds: list[int],
    cells: list[dict[str, Any]],
    *,
    command: str = "",
) -> dict[str, Path]:
    """Write ``table.md``, ``results.json`` and ``curves.png`` (each atomically)."""
    lengths = list(spec.test_lengths)
    results = {
        "task": spec.task,
        "metric": metric_of(spec)["key"],
        "spec": spec.to_dict(),
        "schemes": schemes,
        "seeds": seeds,
        "summary": summarise(cells, schemes, lengths, seeds=len(seeds)),
        "cells": cells,
        "not_finished": [
            {"scheme": label, "seed": seed} for label, seed in not_finished(cells, schemes, seeds)
        ],
        "command": command,
    }
    paths = {"table": run_dir / TABLE, "results": run_dir / RESULTS, "plot": run_dir / PLOT}
    with atomic_path(paths["results"]) as tmp:
        tmp.write_text(json.dumps(json_safe(results), indent=2, allow_nan=False) + "\n")
    with atomic_path(paths["table"]) as tmp:
        tmp.write_text(render_table(spec, schemes, seeds, cells, command=command))
    _plot(spec, schemes, results["summary"], paths["plot"])
    return paths
