"""The scheme study: same model, same budget, different positions, on the standard JSB split.

    # the first look (docs/results.md): the demo's model for 600 steps, flags for the budget
    python benchmarks/chorale_study.py --data jsb \
        --out runs/study --steps 600

    # at the recipe's quality: every scheme with configs/jsb-music.json, a second seed for the
    # headline rows, runs side by side (on a GPU, 12 small runs share it; on a CPU, give each run
    # its own core)
    python benchmarks/chorale_study.py --config configs/jsb-music.json --seeds 0 \
        --schemes music,shaw,t5,t5-lr10,alibi,rope,learned,sinusoidal,nope --parallel 9 \
        --device cuda --out runs/study-recipe
    python benchmarks/chorale_study.py --config configs/jsb-music.json --seeds 1 \
        --schemes music,rope,sinusoidal --parallel 3 --device cuda --out runs/study-recipe

    # where the config's data path does not exist (a GPU machine without ../shared): a copy
    python benchmarks/chorale_study.py --config configs/jsb-music.json \
        --data .devdata/Jsb16thSeparated.json ...

Each run is `relpos train` (the scheme, and with --config every other field from the file), then
`relpos eval` of its best checkpoint; the first seed of each scheme also samples a chorale with
`relpos generate`. A run folder that finished is skipped and one that stopped is resumed, so the
study can be stopped and started again. `results.md` and `results.json` (mean and spread over the
seeds of each scheme) and `valid_curves.png` are written into --out, each atomically.
`--table-only --out DIR` writes them again from the finished runs in DIR and trains nothing: a
run's config.json, metrics.jsonl and eval.json are all it needs
(benchmarks/results/2026-11-26-cpu-amd-epyc-jsb-study keeps just those).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from relpos.atomic import atomic_path
from relpos.cli.argtypes import int_type
from relpos.models import Transformer
from relpos.training import RUN_FILES, TrainConfig, load_checkpoint

#: The flags that choose each scheme (with --config they replace the file's scheme).
SCHEMES = {
    "music": ["--scheme", "music"],
    # Windows of 256 tokens never see a distance past 255: the same function with a table of
    # 257 rows instead of 1025 (fewer parameters, closer to the absolute models' size).
    "music-256": ["--scheme", "music", "--scheme-arg", "max_distance=256"],
    "shaw": ["--scheme", "shaw"],
    "t5": ["--scheme", "t5"],
    # Adam moves T5's scalar table by about the learning rate a step: ten times that rate for
    # the table alone (docs/results.md, T5).
    "t5-lr10": ["--scheme", "t5", "--position-lr-scale", "10"],
    # The same for the Music Transformer's relative embeddings (the recipe's table of 513 rows).
    "music-lr10": [
        "--scheme",
        "music",
        "--scheme-arg",
        "max_distance=512",
        "--position-lr-scale",
        "10",
    ],
    "alibi": ["--scheme", "alibi"],
    "rope": ["--scheme", "rope"],
    "sinusoidal": ["--scheme", "sinusoidal"],
    "learned": ["--scheme", "learned", "--scheme-arg", "max_len=512"],
    "nope": ["--scheme", "nope"],
}
DEFAULT = "music,shaw,t5,alibi,rope,learned,sinusoidal,nope"  # the study's eight schemes


def relpos_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "relpos.cli", *args]


def run_one(out: Path, name: str, seed: int, args: argparse.Namespace, env: dict) -> str:
    """Train (or resume) and evaluate one run; returns its folder name, or raises on failure."""
    run = out / f"{name}-seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    log = run / "study.log"
    train = ["train", "--run-dir", str(run), "--no-progress"]
    if args.device:
        train += ["--device", args.device]
    if (run / "eval.json").exists():
        return run.name  # finished
    if (run / "last.pt").exists():
        done = load_checkpoint(run / "last.pt")["step"]
        steps = json.loads((run / "config.json").read_text())["steps"]
        train = [*train, "--resume"] if done < steps else []
    else:
        # Stopped before its first checkpoint (or never started): nothing to resume, start over.
        for file in RUN_FILES:
            (run / file).unlink(missing_ok=True)
        if args.config:
            # The file's own scheme keeps the file's arguments (the recipe's music table is 513
            # rows).
            own = json.loads(Path(args.config).read_text())["model"].get("scheme", {}).get("name")
            flags = [] if SCHEMES[name] == ["--scheme", name] and own == name else SCHEMES[name]
            train += ["--config", args.config, "--seed", str(seed), *flags]
            train += ["--data", args.data] if args.data else []
        else:
            every = str(max(args.steps // 6, 1))
            train += ["--data", args.data, "--steps", str(args.steps), "--eval-every", every]
            train += ["--seed", str(seed), *SCHEMES[name]]
    commands = [train] if train else []
    commands.append(["eval", "--run-dir", str(run), "--no-progress"])
    if seed == args.seed_list[0]:
        sample = ["--length", "64", "--prime-steps", "16", "--prime-from", "test:0", "--top-k", "8"]
        commands.append(["generate", "--run-dir", str(run), *sample, "--no-progress"])
    with open(log, "a") as f:
        for command in commands:
            done = subprocess.run(relpos_command(*command), stdout=f, stderr=f, env=env)
            if status := done.returncode:
                raise RuntimeError(f"{run.name}: relpos {command[0]} exited {status}; see {log}")
    return run.name


def finished_seeds(out: Path, name: str) -> list[int]:
    """The seeds of ``name``'s finished runs in ``out``, ascending (any invocation's)."""
    seeds = []
    for run in out.glob(f"{name}-seed*"):
        suffix = run.name.removeprefix(f"{name}-seed")
        if suffix.isdigit() and (run / "eval.json").exists():
            seeds.append(int(suffix))
    return sorted(seeds)


def count_parameters(run: Path, result: dict) -> int:
    """The model's size: from its evaluation, or (evaluations from before it was recorded) from
    the model its saved config builds; no checkpoint is needed either way."""
    if "parameters" in result:
        return result["parameters"]
    config = TrainConfig.load(run / "config.json")
    return Transformer(config.model).num_parameters()


def summarize(out: Path, names: list[str]) -> list[dict]:
    """One row per scheme with at least one finished run in ``out`` (from any invocation): mean
    and spread (max - min) of the valid and test NLL over its seeds."""
    rows = []
    for name in names:
        seeds = finished_seeds(out, name)
        if not seeds:
            continue
        runs = [out / f"{name}-seed{seed}" for seed in seeds]
        results = [json.loads((run / "eval.json").read_text()) for run in runs]
        valid = [r["valid_nll"] for r in results]
        test = [r["test_nll"] for r in results]
        rows.append(
            {
                "scheme": name,
                "seeds": len(results),
                "parameters": count_parameters(runs[0], results[0]),
                "best_steps": [r["step"] for r in results],
                "valid_nll": statistics.fmean(valid),
                "valid_spread": max(valid) - min(valid),
                "test_nll": statistics.fmean(test),
                "test_spread": max(test) - min(test),
            }
        )
    return rows


def spread(row: dict, key: str) -> str:
    """`` (0.0123)`` for a scheme run with several seeds; nothing for one (no spread to show)."""
    return f" ({row[key]:.4f})" if row["seeds"] > 1 else ""


def render(rows: list[dict]) -> str:
    lines = [
        "| scheme | seeds | parameters | best step | valid NLL (spread) | test NLL (spread) |",
        "| --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        steps = ", ".join(str(s) for s in r["best_steps"])
        lines.append(
            f"| {r['scheme']} | {r['seeds']} | {r['parameters']:,} | {steps} "
            f"| {r['valid_nll']:.4f}{spread(r, 'valid_spread')} "
            f"| {r['test_nll']:.4f}{spread(r, 'test_spread')} |"
        )
    return "\n".join(lines) + "\n"


def plot_valid_curves(out: Path, runs: list[str]) -> None:
    """Validation NLL against step into ``out/valid_curves.png``: one colour per scheme, a dashed
    line for each further seed; the right panel zooms on the second half, where the leading
    schemes lie within a few hundredths of each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for name in runs:
        records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [(r["step"], r["valid_nll"]) for r in records if "valid_nll" in r]
    scheme_of = {name: name.rsplit("-seed", 1)[0] for name in runs}
    schemes = sorted(set(scheme_of.values()))
    colour = {s: plt.get_cmap("tab10")(k % 10) for k, s in enumerate(schemes)}
    # Each scheme's lowest seed draws a solid line, its further seeds dashed ones.
    first = {s: f"{s}-seed{seeds[0]}" for s in schemes if (seeds := finished_seeds(out, s))}
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    half = max(step for points in curves.values() for step, _ in points) / 2
    late = [nll for points in curves.values() for step, nll in points if step >= half]
    for name, points in curves.items():
        scheme = scheme_of[name]
        style = "o-" if first.get(scheme) == name else "s--"
        for ax in (full, zoom):
            ax.plot(
                *zip(*points, strict=True), style, color=colour[scheme], label=name, markersize=3
            )
    full.set(xlabel="step", ylabel="valid NLL (nats per token)", title="JSB chorales, same budget")
    zoom.set(xlabel="step", title="second half, leading runs", xlim=(half, None))
    zoom.set_ylim(min(late) - 0.005, min(late) + 0.12)
    for ax in (full, zoom):
        ax.grid(alpha=0.3)
    full.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out / "valid_curves.png", suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        help="'jsb' (the shipped split) or a JSB JSON file: the demo's model for --steps; with "
        "--config, it replaces the file's data",
    )
    p.add_argument("--config", help="a TrainConfig JSON file (e.g. configs/jsb-music.json)")
    p.add_argument("--out", default="runs/study")
    p.add_argument(
        "--steps",
        type=int_type(1),
        default=None,
        help="training steps of the demo's model (default 600); with --data only: with --config "
        "the file's steps count (refused beside it)",
    )
    p.add_argument("--schemes", default=DEFAULT, help=f"comma-separated, from {list(SCHEMES)}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, one run each")
    p.add_argument("--parallel", type=int_type(1), default=1, help="runs at a time")
    p.add_argument("--device", default=None, help="cpu or cuda (default: relpos train's)")
    p.add_argument(
        "--threads",
        type=int_type(1),
        help="torch threads per run (default: the cores / --parallel)",
    )
    p.add_argument(
        "--table-only",
        action="store_true",
        help="train nothing: tabulate and plot the finished runs in --out (e.g. runs gathered "
        "from several machines)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.table_only:
        if not out.is_dir():
            p.error(f"--out: {out} is not a folder of study runs")
        return 0 if write_table(out) else 1
    if not (args.data or args.config):
        p.error("give --data (the demo's model) or --config (a recipe)")
    if args.config and args.steps is not None:
        p.error(
            f'--steps {args.steps} with --config: the file\'s steps count (its "steps" field); '
            "expected --steps with --data only"
        )
    if args.steps is None:
        args.steps = 600
    names = [n for n in args.schemes.split(",") if n]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown or not names:
        p.error(f"--schemes: unknown {unknown or args.schemes!r}; choose from {list(SCHEMES)}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not args.seed_list:
        p.error(f"--seeds: expected at least one seed, got {args.seeds!r}")
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.parallel)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    jobs = [(name, seed) for seed in args.seed_list for name in names]
    failed = []
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(run_one, out, n, s, args, env) for n, s in jobs]
        for future in futures:
            try:
                print(f"done: {future.result()}", flush=True)
            except RuntimeError as e:
                failed.append(str(e))
                print(f"failed: {e}", file=sys.stderr, flush=True)
    write_table(out)
    return 1 if failed else 0


def write_table(out: Path) -> list[dict]:
    """``results.md``, ``results.json`` and ``valid_curves.png`` in ``out``, over every finished
    run there (several invocations may share it); the rows, empty where none has finished."""
    rows = summarize(out, list(SCHEMES))
    table = render(rows)
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text(table)
    with atomic_path(out / "results.json") as tmp:
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
    finished = [r.name for r in sorted(out.glob("*-seed*")) if (r / "eval.json").exists()]
    if finished:
        plot_valid_curves(out, finished)
    print(table if rows else f"no finished runs in {out}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
