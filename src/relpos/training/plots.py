"""The learning curve of a run, as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..atomic import save_png

__all__ = ["plot_learning_curve"]


def plot_learning_curve(
    records: list[dict[str, Any]], path: str | Path, *, title: str = ""
) -> Path:
    """Plot training loss and validation NLL against step; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    valid = [(r["step"], r["valid_nll"]) for r in records if "valid_nll" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", color="tab:blue", alpha=0.7)
    if valid:
        ax.plot(*zip(*valid, strict=True), "o-", label="valid NLL", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title(title or "learning curve")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_png(fig, path)
