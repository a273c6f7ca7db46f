"""The ``relpos`` command line: ``train``, ``eval``, ``generate``, ``demo``, ``bench``, ``tour``,
``compare``.

Every subcommand reports a user error — a malformed or out-of-range value, a device that is not
there, a path that is missing or of the wrong kind, data in the wrong format, a run that cannot fit
in memory, a diverged checkpoint — as one line on stderr that names the argument, and exits with
status 2, never with a traceback (``RELPOS_DEBUG=1`` shows one). A traceback is printed only for an
error of relpos itself, with a request to report it (status 1). Ctrl-C outside training exits 130.

Every subcommand first turns on flush-to-zero for float32 denormals, before PyTorch's thread pool
starts (:mod:`relpos.runtime`: attention's backward pass runs many times slower on denormals on
many x86 CPUs); ``relpos bench --keep-denormals`` measures without it. It also makes glibc keep
freed memory for reuse (:mod:`relpos.runtime`: the ``chunked`` backend's temporaries otherwise fault
their pages in anew on every call); ``relpos bench --default-malloc`` measures without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime import flush_denormals, retain_freed_memory
from .argtypes import MAX_SEED, SEED, OnOffAuto, int_type
from .checks import (
    CLIError,
    Parser,
    UsageError,
    check_data,
    input_file,
    output_folder,
    writable_run_files,
)
from .generate import add_parser as add_generate
from .runs import load_model, parse_splits, run_folder

__all__ = ["MAX_SEED", "CLIError", "build_parser", "main"]

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

_COMMANDS = ("train", "eval", "generate", "demo", "bench", "tour", "compare")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# ----------------------------------------------------------------------------- argument types
# argparse reports a failed type as "argument --flag: <message>", so each names its argument.


# ----------------------------------------------------------------------------- paths and data


# ----------------------------------------------------------------------------- configs

# Config fields the model and training flags set; an error message that starts with a field's name
# is reported against its flag.
_FIELD_FLAGS = {
    "d_model": "--d-model",
    "num_heads": "--num-heads",
    "num_layers": "--num-layers",
    "dropout": "--dropout",
    "backend": "--backend",
    "data": "--data",
    "context": "--context",
    "batch_size": "--batch-size",
    "steps": "--steps",
    "lr": "--lr",
    "warmup": "--warmup",
    "position_lr_scale": "--position-lr-scale",
    "eval_every": "--eval-every",
    "accumulate": "--accumulate",
    "ema": "--ema",
    "patience": "--patience",
    "max_shift": "--max-shift",
    "seed": "--seed",
}


def _flag_of(message: str) -> str | None:
    if message.startswith("d_model (") and "divisible" in message:
        return "--d-model/--num-heads"
    if message.startswith("unknown backend"):
        return "--backend"
    first = re.match(r"\w+", message)
    return _FIELD_FLAGS.get(first.group()) if first else None


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
        if key == "name":
            raise CLIError("--scheme-arg: choose the scheme with --scheme NAME, not name=...")
        scheme[key] = _parse_value(value)
    from ..schemes.base import config_from_dict

    try:
        config_from_dict(scheme)
    except (ValueError, TypeError) as e:
        flag = "--scheme" if str(e).startswith("unknown scheme") else "--scheme-arg"
        raise CLIError(f"{flag}: {e}") from None
    return scheme


@dataclass(frozen=True)
class _Flag:
    """A model or training flag of ``relpos train``: the config field it sets (``model.`` for the
    :class:`~relpos.models.TransformerConfig`), its default without ``--config``, and argparse's
    keywords. Its argparse default is None, so a flag the user gave is told from one left out."""

    name: str
    field: str
    default: Any
    kw: dict[str, Any]

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


_MODEL_FLAGS = [
    _Flag("--scheme", "model.scheme", DEMO["scheme"], {"help": "positional scheme"}),
    _Flag(
        "--scheme-arg",
        "model.scheme",
        [],
        {
            "action": "append",
            "metavar": "KEY=VALUE",
            "help": "a scheme config field, e.g. max_distance=512 (repeatable; with --config, "
            "updates the file's scheme)",
        },
    ),
    _Flag("--d-model", "model.d_model", DEMO["d_model"], {"type": int}),
    _Flag("--num-heads", "model.num_heads", DEMO["num_heads"], {"type": int}),
    _Flag("--num-layers", "model.num_layers", DEMO["num_layers"], {"type": int}),
    _Flag("--dropout", "model.dropout", 0.1, {"type": float}),
    _Flag(
        "--backend",
        "model.backend",
        "auto",
        {"help": "attention backend: auto (the fastest that fits), eager, sdpa, chunked, flex"},
    ),
]
_TRAINING_FLAGS = [
    _Flag(
        "--data",
        "data",
        "music21",
        {
            "help": "'music21' (the corpus in the music21 package), 'jsb' (the standard JSB "
            "split, shipped with relpos) or a JSB JSON file"
        },
    ),
    _Flag("--context", "context", DEMO["context"], {"type": int, "help": "tokens per window"}),
    _Flag("--batch-size", "batch_size", DEMO["batch_size"], {"type": int}),
    _Flag("--steps", "steps", DEMO["steps"], {"type": int}),
    _Flag("--lr", "lr", DEMO["lr"], {"type": float}),
    _Flag("--warmup", "warmup", DEMO["warmup"], {"type": int}),
    _Flag(
        "--position-lr-scale",
        "position_lr_scale",
        1.0,
        {"type": float, "help": "learning-rate multiple for the positional scheme's parameters"},
    ),
    _Flag("--eval-every", "eval_every", DEMO["eval_every"], {"type": int}),
    _Flag(
        "--accumulate",
        "accumulate",
        1,
        {"type": int, "help": "micro-batches per step (same update, less memory)"},
    ),
    _Flag(
        "--ema",
        "ema",
        0.0,
        {
            "type": float,
            "help": "moving average of the weights for evaluation, e.g. 0.999",
        },
    ),
    _Flag(
        "--patience",
        "patience",
        0,
        {"type": int, "help": "stop after this many validations without a new best (0: never)"},
    ),
    _Flag(
        "--autocast",
        "autocast",
        False,
        {
            "action": OnOffAuto,
            "help": "bfloat16 autocast of the forward pass; auto: on where the device computes "
            "bfloat16 natively (CUDA, or a CPU with AVX-512 BF16 or AMX)",
        },
    ),
    _Flag(
        "--max-shift",
        "max_shift",
        5,
        {"type": int, "help": "transposition augmentation (0: off)"},
    ),
    _Flag("--seed", "seed", 0, {"type": SEED}),
]


_DATA = next(f for f in _TRAINING_FLAGS if f.dest == "data")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    for title, flags in (("model", _MODEL_FLAGS), ("training", _TRAINING_FLAGS)):
        group = p.add_argument_group(
            f"{title} (with --config: override the file's value; refused with --resume)"
        )
        for flag in flags:
            kw = dict(flag.kw)
            if kw.get("action") != "append":
                kw["help"] = (kw.get("help", "") + f" (default: {flag.default})").strip()
            group.add_argument(flag.name, default=None, **kw)


def _given_flags(args: argparse.Namespace) -> list[_Flag]:
    """The model and training flags given on the command line."""
    return [f for f in _MODEL_FLAGS + _TRAINING_FLAGS if getattr(args, f.dest) is not None]


def _flag_value(args: argparse.Namespace, flag: _Flag) -> Any:
    value = getattr(args, flag.dest)
    return flag.default if value is None else value


def _train_config(args: argparse.Namespace):
    """The run's config from ``--config`` or from the flags' defaults, with the flags given
    replacing its fields (:func:`_override`); errors name the flag (or the file)."""
    from ..training import TrainConfig

    given = _given_flags(args)
    if args.config:
        path = input_file("--config", args.config, "a TrainConfig JSON file")
        try:
            cfg = TrainConfig.load(path)
        except (ValueError, TypeError) as e:
            raise CLIError(f"--config {path}: {e}") from None
        cfg = _override(cfg, args, given) if given else cfg
    else:
        if _DATA not in given:
            given.append(_DATA)  # the default data is checked like a given one
        cfg = _override(_default_config(), args, given)
    return _fit_warmup(cfg, warmup_given=any(f.dest == "warmup" for f in given))


def _fit_warmup(cfg, *, warmup_given: bool):
    """``cfg`` with a warm-up no longer than the run: a longer one never lets the learning rate
    reach ``lr``. One not given as ``--warmup`` (the default's, a config file's) is cut to the
    steps, with a note; a ``--warmup`` longer than the steps is refused."""
    if cfg.warmup <= cfg.steps:
        return cfg
    if warmup_given:
        raise CLIError(
            f"--warmup: {cfg.warmup} is longer than the run's {cfg.steps} steps: the learning "
            "rate would never reach --lr; give a shorter --warmup or more --steps"
        )
    print(f"note: warm-up cut from {cfg.warmup} to the run's {cfg.steps} steps", file=sys.stderr)
    return dataclasses.replace(cfg, warmup=cfg.steps)


def _default_config():
    """The config of the flags' defaults."""
    from ..models import TransformerConfig
    from ..music import VOCAB_SIZE
    from ..training import TrainConfig

    model = {f.field.split(".")[1]: f.default for f in _MODEL_FLAGS if f.field != "model.scheme"}
    return TrainConfig(
        model=TransformerConfig(vocab_size=VOCAB_SIZE, scheme={"name": DEMO["scheme"]}, **model),
        **{f.field: f.default for f in _TRAINING_FLAGS},
    )


def _override(cfg, args: argparse.Namespace, given: list[_Flag]):
    """``cfg`` with the fields of the ``given`` flags replaced; ``--scheme`` replaces the scheme,
    ``--scheme-arg`` alone updates the file's."""
    names = [f.dest for f in given]
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    if "scheme" in names or "scheme_arg" in names:
        if "scheme" in names:
            scheme = _scheme_from_args(args.scheme, args.scheme_arg or [])
        else:
            base = dict(cfg.model.scheme)
            extra = _scheme_from_args(base.pop("name"), args.scheme_arg)
            scheme = {**base, **extra}
        model["scheme"] = scheme
    for f in given:
        if "scheme" in f.dest:
            continue
        value = _flag_value(args, f)
        if f.dest == "data":
            check_data("--data", value)
            value = str(value)
        if f.field.startswith("model."):
            model[f.field.split(".")[1]] = value
        else:
            train[f.field] = value
    try:
        new_model = dataclasses.replace(cfg.model, **model) if model else cfg.model
        return dataclasses.replace(cfg, model=new_model, **train)
    except (ValueError, TypeError) as e:
        flag = _flag_of(str(e))
        raise CLIError(f"{flag}: {e}" if flag else str(e)) from None


def _check_fits(cfg, device, *, training: bool, source: str) -> None:
    """Refuse a run whose estimated peak memory exceeds what ``device`` has free.

    Args:
        source: where the config came from, for the message (``""`` for the flags).
    """
    from .limits import available_memory, estimate_memory, format_bytes

    scheme = cfg.model.scheme
    if scheme.get("name") == "learned" and cfg.context > scheme["max_len"]:
        raise CLIError(
            f"--context {cfg.context}{source} exceeds the learned position table "
            f"(max_len={scheme['max_len']}): lower --context or raise --scheme-arg max_len="
        )
    have = available_memory(device)
    if have is None:
        return
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) if device.type == "cpu" else 1
    est = estimate_memory(cfg, training=training, world=world)
    need = est.total * local
    if need <= have:
        return
    what = "a training step" if training else "evaluation"
    m = cfg.model
    shape = (
        f"batch {est.batch} × {cfg.context:,} tokens, d_model {m.d_model}, {m.num_layers} "
        f"layer(s), {m.num_heads} heads, backend {m.backend}"
    )
    if local > 1:
        shape += f", {local} processes"
    where = f"{format_bytes(have)} available on {device}"
    if est.state > est.activations:
        raise CLIError(
            f"--d-model {m.d_model} / --num-layers {m.num_layers}{source}: {what} needs about "
            f"{format_bytes(need)} ({format_bytes(est.state * local)} for the model and optimiser "
            f"state; {shape}), more than the {where}; choose a smaller model"
        )
    hint = "lower --context or --batch-size"
    if m.backend in ("eager", "sdpa"):
        hint += f" (or use --backend auto: {m.backend} builds (context × context) tensors)"
    raise CLIError(
        f"--context {cfg.context}{source}: {what} needs about {format_bytes(need)} ({shape}), "
        f"more than the {where}; {hint}"
    )


# ----------------------------------------------------------------------------- subcommands


def _checkpoint_config(path: Path):
    """The config a checkpoint holds (what ``--resume`` continues), or a one-line error."""
    from ..training import TrainConfig, load_checkpoint

    try:
        return TrainConfig.from_dict(load_checkpoint(path, mmap=True)["config"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CLIError(f"--resume: {path}: {e}") from None


def _chorale_data(cfg, flag: str, no_progress: bool):
    """The chorales ``cfg.data`` names, parsed once and encoded for training, before the run
    starts: a file the loader refuses is one line naming ``flag``. One progress bar: rank 0's."""
    from ..music import load_token_data

    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        return load_token_data(
            cfg.data, max_shift=cfg.max_shift, progress=not no_progress and main_rank
        )
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(f"{flag}: {e}") from None


def cmd_train(args: argparse.Namespace) -> int:
    from ..training import RUN_FILES, TrainConfig, train
    from .limits import device_flag

    device = device_flag(args.device)
    run_dir = output_folder("--run-dir", args.run_dir)
    writable_run_files("--run-dir", run_dir, RUN_FILES)  # not at the first checkpoint
    if args.resume:
        if args.config:
            raise CLIError(
                "--config and --resume: --resume continues the run with its own config; "
                "drop --config (or start a new run in another --run-dir)"
            )
        if given := _given_flags(args):
            names = ", ".join(f.name for f in given)
            raise CLIError(
                f"{names} with --resume: --resume continues the run with its own config; drop "
                "them (or start a new run in another --run-dir)"
            )
        if not (run_dir / "last.pt").is_file():
            raise CLIError(
                f"--resume: {run_dir / 'last.pt'} does not exist: nothing to resume (start the "
                "run without --resume)"
            )
        cfg, source, flag = None, " (of the run)", "the run's data"
        try:
            fits_cfg = TrainConfig.load(run_dir / "config.json")
        except (OSError, ValueError, TypeError):
            fits_cfg = None  # train() reads the checkpoint's own config and reports its errors
    else:
        cfg = _train_config(args)
        fits_cfg, source = cfg, f" (in --config {args.config})" if args.config else ""
        flag = "--data" if args.data or not args.config else f"data in --config {args.config}"
        if flag != "--data":  # --data, given or default, was checked with the other flags
            check_data(flag, cfg.data)
    if fits_cfg is not None:
        if fits_cfg.seed > MAX_SEED:
            raise CLIError(f"--seed: expected an integer in 0..{MAX_SEED}, got {fits_cfg.seed}")
        _check_fits(fits_cfg, device, training=True, source=source)
    data = _chorale_data(cfg or _checkpoint_config(run_dir / "last.pt"), flag, args.no_progress)
    summary = train(
        cfg,
        run_dir,
        resume=args.resume,
        progress=not args.no_progress,
        device=str(device),
        data=data,
    )
    if summary["interrupted"]:
        print(
            f"stopped at step {summary['step']}/{summary['steps']}; checkpoint in "
            f"{run_dir}/last.pt — continue with: relpos train --run-dir {run_dir} --resume",
            file=sys.stderr,
        )
        return int(summary.get("exit_status") or 130)
    print(
        f"trained {summary['step']} steps; best valid NLL {summary['best_valid_nll']:.4f} "
        f"nats/token; run folder: {run_dir}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:

    from ..atomic import atomic_path
    from ..music import load_token_data
    from ..training import evaluate_nll
    from .limits import device_flag

    device = device_flag(args.device)
    run_dir = run_folder("--run-dir", args.run_dir)
    splits = parse_splits(args.splits)
    model, cfg, state, path = load_model(run_dir, args.checkpoint)
    trained_context = cfg.context
    if args.context is not None:  # the checks below (memory, a learned table's size) read it
        try:
            cfg = dataclasses.replace(cfg, context=args.context)
        except ValueError as e:
            raise CLIError(f"--context: {e}") from None
    if args.data:
        check_data("--data", args.data)
        source, flag = args.data, "--data"
    else:
        source, flag = cfg.data, f"the run's data ({cfg.data}; pass --data to use other data)"
        check_data(flag, source)
    _check_fits(cfg, device, training=False, source=f" (of {path})")
    model.to(device)
    try:
        data = load_token_data(source, max_shift=0, progress=not args.no_progress)
    except ValueError as e:
        raise CLIError(f"{flag}: {e}") from None
    if args.stride is not None and not data.grid.step <= args.stride <= cfg.context:
        raise CLIError(
            f"--stride {args.stride}: expected {data.grid.step} (one time step of {source}) to "
            f"the context ({cfg.context})"
        )
    result: dict[str, Any] = {
        "checkpoint": str(path),
        "step": state["step"],
        "data": source,
        "scheme": cfg.model.scheme,
        "layer_schemes": cfg.model.layer_schemes,  # None: every layer's attention is `scheme`'s
        "parameters": model.num_parameters(),
        "context": cfg.context,
        "stride": args.stride or cfg.context,
    }
    for split in splits:
        seqs = data.split(split)
        if not any(len(s) >= 2 for s in seqs):
            raise CLIError(f"--splits: the {split} split of {source} is empty: nothing to evaluate")
        nll = evaluate_nll(
            model, seqs, context=cfg.context, grid=data.grid, device=device, stride=args.stride
        )
        if not math.isfinite(nll):
            raise CLIError(
                f"--checkpoint: the {split} NLL of {path} is {nll}: the model's outputs are not "
                "finite (its weights overflow); use an earlier checkpoint"
            )
        result[f"{split}_nll"] = nll
        print(f"{split:>5}: {nll:.4f} nats/token")
    # Other windows than the training ones are another measurement: they keep their own file.
    name = "eval"
    if cfg.context != trained_context:
        name += f"-context{cfg.context}"
    if args.stride is not None:
        name += f"-stride{args.stride}"
    out = run_dir / f"{name}.json"
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's main job: train a small Music Transformer, evaluate it, write a chorale."""
    run_dir = output_folder("--run-dir", args.run_dir)
    if args.data:
        check_data("--data", args.data)
    train_args = ["train", "--run-dir", str(run_dir), "--steps", str(args.steps)]
    if (run_dir / "last.pt").exists():
        train_args = ["train", "--run-dir", str(run_dir), "--resume"]
        print(f"{run_dir} holds a run: resuming it (delete the folder to start over)")
    elif args.data:
        train_args += ["--data", args.data]
    quiet = ["--no-progress"] if args.no_progress else []
    train_args += quiet
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
        *quiet,
    ]
    for argv in (train_args, eval_args, generate_args):
        status = main(argv, prog="relpos demo")
        if status:
            return status
    print(
        f"\nrun folder: {run_dir.resolve()}\n"
        f"  learning curve: {run_dir / 'learning_curve.png'}\n"
        f"  metrics:        {run_dir / 'metrics.jsonl'}\n"
        f"  evaluation:     {run_dir / 'eval.json'}\n"
        f"  chorale:        {run_dir / 'samples' / 'sample-seed0.mid'} (+ .musicxml, .png)"
    )
    return 0


def _bench(argv: list[str]) -> int:
    """``relpos bench`` (also ``python -m relpos.cli.bench``): :func:`.bench.main`, which checks
    its options before anything runs (a :class:`CLIError` naming the flag) and makes both process
    settings itself (``--keep-denormals``, ``--default-malloc``)."""
    from . import bench

    return bench.main(argv)


def cmd_tour(args: argparse.Namespace) -> int:
    from .tour import main as tour_main

    return tour_main()


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="relpos",
        description="relpos: train, evaluate and sample chorale models; benchmark attention; "
        "compare schemes on length generalisation.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a transformer on chorales")
    p.add_argument("--run-dir", default="runs/music", help="run folder (checkpoints, metrics)")
    p.add_argument(
        "--config", help="a TrainConfig JSON file (flags given beside it override its fields)"
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="note-wise NLL (nats per token) of a run's checkpoint")
    p.add_argument("--run-dir", default="runs/music")
    p.add_argument("--checkpoint", default="best", help="best, last, or a checkpoint path")
    p.add_argument("--data", default=None, help="evaluate on other data (default: the run's)")
    p.add_argument("--splits", default="valid,test", help="comma-separated: train, valid, test")
    p.add_argument(
        "--context",
        type=int_type(1),
        default=None,
        help="tokens per window, each token scored once (default: the run's training context; "
        "a longer one gives later tokens more of their past; results go to "
        "eval-context<N>.json)",
    )
    p.add_argument(
        "--stride",
        type=int_type(1),
        default=None,
        help="tokens between window starts (default: --context, no overlap); a shorter stride "
        "scores each token once, with at least context - stride tokens of its past (a "
        "sliding-window evaluation; results go to eval[-context<N>]-stride<S>.json)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval)

    add_generate(sub)

    p = sub.add_parser("demo", help="the main job: train, evaluate, generate (a few minutes)")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--steps", type=int_type(1), default=DEMO["steps"])
    p.add_argument("--data", default=None, help="'music21' (default), 'jsb' or a JSB JSON file")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "bench", help="attention speed and memory per scheme and backend", add_help=False
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: _bench(args.bench_args))

    p = sub.add_parser("tour", help="every scheme: parameters and batch-parity checks")
    p.set_defaults(func=cmd_tour)

    from .compare import add_parser as add_compare

    add_compare(sub)
    return parser


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    """Run ``relpos`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    0: done; 2: a user error, reported in one line on stderr; 1: an error of relpos itself (a
    traceback, and a request to report it); 130/143: stopped by Ctrl-C/SIGTERM. ``prog``: the
    name messages start with (default ``relpos COMMAND``; ``relpos demo`` runs ``train``,
    ``eval`` and ``generate`` under its own name).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    name = prog or f"relpos {command}".strip()
    debug = bool(os.environ.get("RELPOS_DEBUG"))
    try:
        if argv[:1] == ["bench"]:  # forward every option, leading ones included, to bench
            return _bench(argv[1:])
        args = build_parser().parse_args(argv)
        # Before any parallel op: the intra-op threads inherit it (relpos.runtime explains why).
        flush_denormals()
        retain_freed_memory()
        return args.func(args)
    except UsageError as e:
        prog = e.prog
        if prog == "relpos" and command in _COMMANDS:  # unrecognized arguments of a subcommand
            prog = name
        print(f"{prog}: error: {_one_line(str(e))} (see {prog} --help)", file=sys.stderr)
        return 2
    except CLIError as e:
        print(f"{name}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError) as e:
        if debug:
            raise
        print(
            f"{name}: error: {_one_line(str(e) or type(e).__name__)}  (RELPOS_DEBUG=1 for a "
            "traceback)",
            file=sys.stderr,
        )
        return 2
    except Exception as e:
        if _out_of_memory(e) and not debug:
            print(
                f"{name}: error: out of memory ({_one_line(str(e))[:200]}); lower --context or "
                "--batch-size, or choose a smaller model  (RELPOS_DEBUG=1 for a traceback)",
                file=sys.stderr,
            )
            return 2
        traceback.print_exc()
        print(
            f"{name}: internal error: {type(e).__name__}: {_one_line(str(e))[:300]}\nThis is a bug "
            "in relpos, not a mistake in the command: please report it, with the command line "
            "and the traceback above.",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
