"""The scheme study: same model, same budget, different positions, on the standard JSB split.

    python benchmarks/chorale_study.py --data ../shared/data/jsb-chorales/Jsb16thSeparated.json \
        --out runs/study --steps 600

Trains one model per scheme with `relpos train`, evaluates its best checkpoint with `relpos eval`,
samples a chorale with `relpos generate`, and writes `results.md` (a markdown table) into --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from relpos.atomic import atomic_path
from relpos.cli import main as relpos
from relpos.training import load_checkpoint

SCHEMES = {
    "music": ["--scheme", "music"],
    # Windows hold 256 tokens, so no distance past 255 is ever seen: the same function with a
    # table of 257 rows instead of 1025 (fewer parameters, closer to the absolute models' size).
    "music-256": ["--scheme", "music", "--scheme-arg", "max_distance=256"],
    "sinusoidal": ["--scheme", "sinusoidal"],
    "learned": ["--scheme", "learned", "--scheme-arg", "max_len=512"],
    "nope": ["--scheme", "nope"],
}


def plot_valid_curves(out: Path, names: list[str]) -> None:
    """Validation NLL against step, one line per scheme, into ``out/valid_curves.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for name in names:
        records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        points = [(r["step"], r["valid_nll"]) for r in records if "valid_nll" in r]
        ax.plot(*zip(*points, strict=True), "o-", label=name)
    ax.set(xlabel="step", ylabel="valid NLL (nats per token)", title="JSB chorales, same budget")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out / "valid_curves.png", suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/study")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.schemes.split(","):
        run = out / name
        train = ["train", "--run-dir", str(run), "--no-progress"]
        if not (run / "last.pt").exists():
            train += [
                "--data",
                args.data,
                "--steps",
                str(args.steps),
                "--eval-every",
                str(max(args.steps // 6, 1)),
                *SCHEMES[name],
            ]
        elif load_checkpoint(run / "last.pt")["step"] < args.steps:
            train.append("--resume")  # an interrupted run continues where it stopped
        else:
            train = []
        if train and (status := relpos(train)):
            return status
        relpos(["eval", "--run-dir", str(run), "--no-progress"])
        relpos(
            [
                "generate",
                "--run-dir",
                str(run),
                "--length",
                "64",
                "--prime-steps",
                "16",
                "--prime-from",
                "test:0",
                "--top-k",
                "8",
            ]
        )
    # The table covers every finished run in --out (several invocations may share it).
    rows = []
    for name in SCHEMES:
        run = out / name
        if not (run / "eval.json").exists():
            continue
        result = json.loads((run / "eval.json").read_text())
        state = torch.load(run / "best.pt", weights_only=True)["model"]
        params = sum(v.numel() for v in state.values())
        rows.append((name, params, result["step"], result["valid_nll"], result["test_nll"]))
    lines = [
        "| scheme | parameters | best step | valid NLL | test NLL |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {p:,} | {s} | {v:.4f} | {t:.4f} |" for n, p, s, v, t in rows]
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    plot_valid_curves(out, [r[0] for r in rows])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
