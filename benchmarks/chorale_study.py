"""The scheme study: same model, same budget, different positions, on the standard JSB split.

    python benchmarks/chorale_study.py --data ../shared/data/jsb-chorales/Jsb16thSeparated.json \
        --out runs/study --steps 1200

Trains one model per scheme with `relpos train`, evaluates its best checkpoint with `relpos eval`,
samples a chorale with `relpos generate`, and writes `results.md` (a markdown table) into --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from relpos.cli import main as relpos
from relpos.data.atomic import atomic_path

SCHEMES = {
    "music": ["--scheme", "music"],
    "sinusoidal": ["--scheme", "sinusoidal"],
    "learned": ["--scheme", "learned", "--scheme-arg", "max_len=512"],
    "nope": ["--scheme", "nope"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/study")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.schemes.split(","):
        run = out / name
        start = time.perf_counter()
        if not (run / "best.pt").exists():
            status = relpos(
                [
                    "train",
                    "--run-dir",
                    str(run),
                    "--data",
                    args.data,
                    "--steps",
                    str(args.steps),
                    "--eval-every",
                    str(max(args.steps // 6, 1)),
                    "--no-progress",
                    *SCHEMES[name],
                ]
            )
            if status:
                return status
        minutes = (time.perf_counter() - start) / 60
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
        result = json.loads((run / "eval.json").read_text())
        params = sum(
            v.numel()
            for v in __import__("torch").load(run / "best.pt", weights_only=True)["model"].values()
        )
        rows.append(
            (name, params, result["step"], result["valid_nll"], result["test_nll"], minutes)
        )
    lines = [
        "| scheme | parameters | best step | valid NLL | test NLL | train minutes |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {p:,} | {s} | {v:.4f} | {t:.4f} | {m:.1f} |" for n, p, s, v, t, m in rows]
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
