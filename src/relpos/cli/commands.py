"""The ``relpos`` command line: ``train``, ``eval``, ``generate``, ``demo``, ``bench``, ``tour``.

Every subcommand reports bad input as one clear line on stderr and exit status 2, not a traceback.
Every subcommand first turns on flush-to-zero for float32 denormals, before PyTorch's thread pool
starts (:mod:`relpos.runtime`: attention's backward pass runs many times slower on denormals on
many x86 CPUs); ``relpos bench --keep-denormals`` measures without it. It also makes glibc keep
freed memory for reuse (:mod:`relpos.runtime`: the ``chunked`` backend's temporaries otherwise fault
their pages in anew on every call); ``relpos bench --default-malloc`` measures without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..runtime import flush_denormals, retain_freed_memory

__all__ = ["main"]

# The README's main job: a small model, a few minutes on a laptop CPU.
DEMO = {
    "scheme": "music",
    "d_model": 128,
    "num_heads": 4,
    "num_layers": 3,
    "context": 256,
    "batch_size": 16,
    "steps": 600,
    "eval_every": 150,
    "lr": 2e-3,
    "warmup": 60,
}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------- arguments


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _scheme_from_args(name: str, pairs: list[str]) -> dict[str, Any]:
    scheme: dict[str, Any] = {"name": name}
    for pair in pairs:
        if "=" not in pair:
            raise CLIError(f"--scheme-arg expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        scheme[key] = _parse_value(value)
    return scheme


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (ignored with --config or --resume)")
    g.add_argument("--scheme", default=DEMO["scheme"], help="positional scheme (default: music)")
    g.add_argument(
        "--scheme-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a scheme config field, e.g. max_distance=512 (repeatable)",
    )
    g.add_argument("--d-model", type=int, default=DEMO["d_model"])
    g.add_argument("--num-heads", type=int, default=DEMO["num_heads"])
    g.add_argument("--num-layers", type=int, default=DEMO["num_layers"])
    g.add_argument("--dropout", type=float, default=0.1)
    g.add_argument(
        "--backend",
        default="auto",
        help="attention backend: auto (the fastest that fits), eager, sdpa, chunked, flex",
    )
    t = p.add_argument_group("training (ignored with --config or --resume)")
    t.add_argument(
        "--data",
        default="music21",
        help="'music21' (the corpus in the music21 package) or a JSB JSON file",
    )
    t.add_argument("--context", type=int, default=DEMO["context"], help="tokens per window")
    t.add_argument("--batch-size", type=int, default=DEMO["batch_size"])
    t.add_argument("--steps", type=int, default=DEMO["steps"])
    t.add_argument("--lr", type=float, default=DEMO["lr"])
    t.add_argument("--warmup", type=int, default=DEMO["warmup"])
    t.add_argument("--eval-every", type=int, default=DEMO["eval_every"])
    t.add_argument("--max-shift", type=int, default=5, help="transposition augmentation (0: off)")
    t.add_argument("--seed", type=int, default=0)


def _train_config(args: argparse.Namespace):
    from ..models import TransformerConfig
    from ..music import VOCAB_SIZE
    from ..training import TrainConfig

    if args.config:
        return TrainConfig.load(args.config)
    model = TransformerConfig(
        vocab_size=VOCAB_SIZE,
        d_model=args.d_model,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        dropout=args.dropout,
        scheme=_scheme_from_args(args.scheme, args.scheme_arg),
        backend=args.backend,
    )
    return TrainConfig(
        model=model,
        data=str(args.data),
        context=args.context,
        batch_size=args.batch_size,
        steps=args.steps,
        lr=args.lr,
        warmup=args.warmup,
        eval_every=args.eval_every,
        max_shift=args.max_shift,
        seed=args.seed,
    )


def _load_model(run_dir: Path, which: str):
    """The model of a run folder, from ``best``/``last`` checkpoint or a checkpoint path."""
    from ..models import Transformer
    from ..training import TrainConfig, load_checkpoint

    path = Path(which) if which not in ("best", "last") else run_dir / f"{which}.pt"
    state = load_checkpoint(path)
    cfg = TrainConfig.from_dict(state["config"])
    model = Transformer(cfg.model)
    model.load_state_dict(state["model"])
    return model.eval(), cfg, state, path


# ----------------------------------------------------------------------------- subcommands


def cmd_train(args: argparse.Namespace) -> int:
    from ..training import train

    cfg = None if args.resume else _train_config(args)
    summary = train(
        cfg, args.run_dir, resume=args.resume, progress=not args.no_progress, device=args.device
    )
    if summary["interrupted"]:
        print(
            f"stopped at step {summary['step']}/{summary['steps']}; checkpoint in "
            f"{args.run_dir}/last.pt — continue with: relpos train --run-dir {args.run_dir} "
            "--resume",
            file=sys.stderr,
        )
        return 130
    print(
        f"trained {summary['step']} steps; best valid NLL {summary['best_valid_nll']:.4f} "
        f"nats/token; run folder: {args.run_dir}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ..atomic import atomic_path
    from ..music import load_token_data
    from ..training import evaluate_nll

    run_dir = Path(args.run_dir)
    model, cfg, state, path = _load_model(run_dir, args.checkpoint)
    data = load_token_data(args.data or cfg.data, max_shift=0, progress=not args.no_progress)
    result: dict[str, Any] = {
        "checkpoint": str(path),
        "step": state["step"],
        "data": args.data or cfg.data,
        "scheme": cfg.model.scheme,
    }
    for split in args.splits.split(","):
        nll = evaluate_nll(model, data.split(split), context=cfg.context, grid=data.grid)
        result[f"{split}_nll"] = nll
        print(f"{split:>5}: {nll:.4f} nats/token")
    out = run_dir / "eval.json"
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ..music import load_chorales, sample_chorale, write_midi, write_musicxml

    run_dir = Path(args.run_dir)
    model, cfg, _, _ = _load_model(run_dir, args.checkpoint)
    prime = None
    if args.prime_steps:
        split, _, index = args.prime_from.partition(":")
        splits = load_chorales(None if cfg.data == "music21" else cfg.data, progress=False)
        if split not in ("train", "valid", "test"):
            raise CLIError(
                f"--prime-from must be SPLIT:INDEX with SPLIT train/valid/test, got "
                f"{args.prime_from!r}"
            )
        chorales = splits.split(split)
        i = int(index or 0)
        if not 0 <= i < len(chorales):
            raise CLIError(
                f"--prime-from index {i} is out of range: {split} has {len(chorales)} chorales"
            )
        prime = chorales[i][: args.prime_steps]
    chorale = sample_chorale(
        model,
        args.length,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        prime=prime,
    )
    out = Path(args.out) if args.out else run_dir / "samples" / f"sample-seed{args.seed}.mid"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_midi(chorale, out, tempo_bpm=80)
    xml = write_musicxml(chorale, out.with_suffix(".musicxml"))
    print(
        f"wrote {out} and {xml} ({len(chorale)} sixteenth-note steps, "
        f"{'primed with ' + str(len(prime)) + ' steps, ' if prime is not None else ''}"
        f"temperature {args.temperature}, top-k {args.top_k or 'off'}, seed {args.seed})"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's main job: train a small Music Transformer, evaluate it, write a chorale."""
    run_dir = Path(args.run_dir)
    train_args = ["train", "--run-dir", str(run_dir), "--steps", str(args.steps)]
    if (run_dir / "last.pt").exists():
        train_args = ["train", "--run-dir", str(run_dir), "--resume"]
        print(f"{run_dir} holds a run: resuming it (delete the folder to start over)")
    if args.no_progress:
        train_args.append("--no-progress")
    if args.data:
        train_args += ["--data", args.data]
    quiet = ["--no-progress"] if args.no_progress else []
    eval_args = ["eval", "--run-dir", str(run_dir), *quiet]
    generate_args = [
        "generate",
        "--run-dir",
        str(run_dir),
        "--length",
        "64",
        "--prime-steps",
        "16",
        "--prime-from",
        "test:0",
    ]
    for argv in (train_args, eval_args, generate_args):
        status = main(argv)
        if status:
            return status
    print(
        f"\nrun folder: {run_dir.resolve()}\n"
        f"  learning curve: {run_dir / 'learning_curve.png'}\n"
        f"  metrics:        {run_dir / 'metrics.jsonl'}\n"
        f"  evaluation:     {run_dir / 'eval.json'}\n"
        f"  chorale:        {run_dir / 'samples' / 'sample-seed0.mid'} (+ .musicxml)"
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args.bench_args)


def cmd_tour(args: argparse.Namespace) -> int:
    from .tour import main as tour_main

    return tour_main()


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relpos", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a transformer on chorales")
    p.add_argument("--run-dir", default="runs/music", help="run folder (checkpoints, metrics)")
    p.add_argument("--config", help="a TrainConfig JSON file (instead of the flags below)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="note-wise NLL (nats per token) of a run's checkpoint")
    p.add_argument("--run-dir", default="runs/music")
    p.add_argument("--checkpoint", default="best", help="best, last, or a checkpoint path")
    p.add_argument("--data", default=None, help="evaluate on other data (default: the run's)")
    p.add_argument("--splits", default="valid,test")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample a chorale; write MIDI and MusicXML")
    p.add_argument("--run-dir", default="runs/music")
    p.add_argument("--checkpoint", default="best")
    p.add_argument("--length", type=int, default=64, help="sixteenth-note steps to sample")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prime-steps",
        type=int,
        default=0,
        help="continue the first N steps of a held-out chorale",
    )
    p.add_argument("--prime-from", default="test:0", help="SPLIT:INDEX of the priming chorale")
    p.add_argument("--out", default=None, help="MIDI path (default: RUN/samples/…)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the main job: train, evaluate, generate (a few minutes)")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--steps", type=int, default=DEMO["steps"])
    p.add_argument("--data", default=None, help="'music21' (default) or a JSB JSON file")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "bench", help="attention speed and memory per scheme and backend", add_help=False
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tour", help="every scheme: parameters and batch-parity checks")
    p.set_defaults(func=cmd_tour)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # forward every option, leading ones included, to relpos.cli.bench
        from . import bench  # which sets both itself (--keep-denormals, --default-malloc)

        return bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    # Before any parallel op: the intra-op threads inherit it (relpos.runtime explains why).
    flush_denormals()
    retain_freed_memory()
    try:
        return args.func(args)
    except CLIError as e:
        print(f"relpos {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        if os.environ.get("RELPOS_DEBUG"):
            raise
        print(
            f"relpos {args.command}: error: {e}  (RELPOS_DEBUG=1 for a traceback)", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
