"""``relpos compare``: which scheme generalises past its training length (:mod:`relpos.studies`).

Its arguments are checked before anything is written: an unknown task or scheme, test lengths
shorter than the training length, a warm-up longer than the steps, a flag the task does not read,
a scheme that cannot be built at this width or that the backend cannot train, or a run folder
holding another comparison end with one line naming the flag, and status 2.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from .checks import CLIError, check_data, output_folder

__all__ = ["add_parser", "cmd_compare"]

# Spec fields and the flags that set them; an error that starts with a field's name names its flag.
_FLAGS = {
    "train_length": "--train-length",
    "test_lengths": "--test-lengths",
    "d_model": "--d-model",
    "num_heads": "--num-heads",
    "num_layers": "--num-layers",
    "dropout": "--dropout",
    "steps": "--steps",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "warmup": "--warmup",
    "eval_every": "--eval-every",
    "test_examples": "--test-examples",
    "data": "--data",
    "max_shift": "--max-shift",
    "backend": "--backend",
}
# Every field an error may start with (``field: ...``), and its flag.
_FIELD_FLAGS = {
    **_FLAGS,
    "schemes": "--schemes",
    "seeds": "--seeds",
    "d_model/num_heads": "--d-model/--num-heads",
}
# Flags that only one kind of task reads.
_CHORALES_ONLY = ("data", "max_shift", "eval_every")
_SYNTHETIC_ONLY = ("test_examples",)


def _flag_of(message: str) -> str:
    if message.startswith("d_model (") and "divisible" in message:
        return "--d-model/--num-heads"
    if message.startswith("d_model/num_heads:"):
        return "--d-model/--num-heads"
    if message.startswith("warmup (") and "steps (" in message:
        return "--warmup/--steps"
    if message.startswith("unknown task"):
        return "--task"
    if message.startswith(("unknown scheme", "schemes")) or "scheme" in message.split(":")[0]:
        return "--schemes"
    if message.startswith("seeds"):
        return "--seeds"
    if message.startswith("unknown backend"):
        return "--backend"
    first = re.match(r"\w+", message)
    return _FLAGS.get(first.group(), "--schemes") if first else "--schemes"


def _refused(e: Exception) -> CLIError:
    """The error as one line, ``FLAG: message``, without a leading ``field:`` that repeats it."""
    message = str(e)
    flag = _flag_of(message)
    field, sep, rest = message.partition(": ")
    if sep and _FIELD_FLAGS.get(field) == flag:
        message = rest
    return CLIError(f"{flag}: {message}")


def _int_list(flag: str, text: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise CLIError(f"{flag}: expected a comma-separated list of integers, got {text!r}")
    out = []
    for item in items:
        try:
            out.append(int(item))
        except ValueError:
            raise CLIError(f"{flag}: expected integers, got {item!r} in {text!r}") from None
    return out


def _spec(args: argparse.Namespace):
    from ..studies.spec import CHORALES, TASK_NAMES, default_spec

    if args.task not in TASK_NAMES:
        raise CLIError(
            f"--task: unknown task {args.task!r}; expected one of {', '.join(TASK_NAMES)}"
        )
    fields = {name: getattr(args, name) for name in _FLAGS}
    unread = _SYNTHETIC_ONLY if args.task == CHORALES else _CHORALES_ONLY
    for name in unread:
        if fields[name] is not None:
            raise CLIError(f"{_FLAGS[name]}: the {args.task} task does not read it")
    if fields["test_lengths"] is not None:
        fields["test_lengths"] = _int_list("--test-lengths", fields["test_lengths"])
    if args.task == CHORALES:
        check_data("--data", fields["data"] or "music21")
    try:
        return default_spec(args.task, **fields)
    except (ValueError, TypeError) as e:
        raise _refused(e) from None


def _command_line(spec, labels: list[str], seeds: list[int], run_dir: Path) -> str:
    """The shortest ``relpos compare`` command that runs ``labels`` × ``seeds`` of this
    comparison (all of a folder's: the command that gives its whole table)."""
    from ..studies.spec import DEFAULT_SCHEMES, default_spec

    base = default_spec(spec.task).to_dict()
    base["warmup"] = default_spec(spec.task, steps=spec.steps).warmup  # capped at the steps
    words = ["relpos", "compare", "--task", spec.task]
    if tuple(labels) != DEFAULT_SCHEMES:
        words += ["--schemes", ",".join(labels)]
    if seeds != [0]:
        words += ["--seeds", ",".join(map(str, seeds))]
    for name, value in spec.to_dict().items():
        if name in ("task", "test_lengths") or value == base[name]:
            continue
        words += [_FLAGS[name], str(value)]
    if spec.test_lengths != default_spec(spec.task, train_length=spec.train_length).test_lengths:
        words += ["--test-lengths", ",".join(map(str, spec.test_lengths))]
    words += ["--run-dir", str(run_dir)]
    return shlex.join(words)


def cmd_compare(args: argparse.Namespace) -> int:
    from ..studies.compare import ComparisonMismatch, prepare, run_compare
    from ..studies.spec import DEFAULT_SCHEMES, split_outside_brackets

    spec = _spec(args)
    # Only an absent flag means the default: an empty value (an unset shell variable) is refused.
    given = ",".join(DEFAULT_SCHEMES) if args.schemes is None else args.schemes
    schemes = [s for s in (s.strip() for s in split_outside_brackets(given, ",")) if s]
    if not schemes:
        raise CLIError(
            f"--schemes: expected at least one scheme (NAME or NAME:KEY=VALUE, comma-separated), "
            f"got {args.schemes!r}"
        )
    seeds = _int_list("--seeds", args.seeds)
    run_dir = output_folder("--run-dir", args.run_dir)
    try:
        grid, _ = prepare(run_dir, spec, schemes, seeds)  # every check, before anything is written
    except ComparisonMismatch as e:
        raise CLIError(f"--run-dir: {e}") from None
    except (ValueError, TypeError) as e:
        raise _refused(e) from None
    # The table's command gives the whole folder's table (its schemes and seeds, a rerun's
    # included); an interrupted run continues with this request's.
    command = _command_line(spec, grid.labels, grid.seeds, run_dir)
    again = _command_line(spec, schemes, seeds, run_dir)
    data = None
    if not spec.synthetic:
        from ..music import load_token_data

        try:
            data = load_token_data(
                spec.data, max_shift=spec.max_shift, progress=not args.no_progress
            )
        except ValueError as e:
            raise CLIError(f"--data: {e}") from None
    print(
        f"relpos compare: {spec.task}, {len(schemes)} scheme(s) × {len(seeds)} seed(s) in {run_dir}"
    )
    summary = run_compare(
        spec,
        schemes,
        seeds,
        run_dir,
        progress=not args.no_progress,
        log=lambda line: print(line, flush=True),
        data=data,
        command=command,
    )
    paths: dict[str, Any] = summary["paths"]
    print()
    print(paths["table"].read_text(), end="")
    print(f"\nwrote {paths['table']}, {paths['results']} and {paths['plot']}")
    if summary["interrupted"]:
        print(
            f"stopped before the end; continue with: {again}",
            file=sys.stderr,
        )
        return int(summary["exit_status"])
    return 0


def add_parser(sub: Any) -> None:
    """Add ``compare`` to the ``relpos`` subcommands."""
    from ..studies.spec import CHORALES, DEFAULT_SCHEMES, TASK_NAMES

    p = sub.add_parser(
        "compare",
        help="train and test schemes on a length-generalisation task; a table and a plot",
        description=(
            "Train each scheme on short sequences and test it on longer ones; resumable (a rerun "
            "skips finished cells). Tasks: "
            f"{CHORALES} (NLL on longer windows of held-out chorales), copy, reverse, sort, "
            "count, add (exact match on longer strings, greedy decoding)."
        ),
    )
    p.add_argument("--task", required=True, help=f"one of {', '.join(TASK_NAMES)}")
    p.add_argument(
        "--schemes",
        default=None,
        help=f"comma-separated; NAME or NAME:KEY=VALUE (default: {','.join(DEFAULT_SCHEMES)})",
    )
    p.add_argument("--seeds", default="0", help="comma-separated training seeds (default 0)")
    p.add_argument("--run-dir", default=None, help="the comparison's folder (runs/compare-TASK)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("task (defaults per task: docs/compare.md)")
    g.add_argument(
        "--train-length",
        type=int,
        help="N: training window in tokens (chorales) or longest training string (digits)",
    )
    g.add_argument(
        "--test-lengths", help="comma-separated, each >= N (default N,2N,4N,8N or N..4N)"
    )
    g.add_argument("--test-examples", type=int, help="held-out strings per length (synthetic)")
    g.add_argument("--data", help="chorales: 'music21', 'jsb' or a JSB JSON file")
    g.add_argument("--max-shift", type=int, help="chorales: transposition augmentation")
    m = p.add_argument_group("model and training")
    m.add_argument("--d-model", type=int)
    m.add_argument("--num-heads", type=int)
    m.add_argument("--num-layers", type=int)
    m.add_argument("--dropout", type=float)
    m.add_argument("--backend", help="attention backend (default auto)")
    m.add_argument("--steps", type=int)
    m.add_argument("--batch-size", type=int)
    m.add_argument("--lr", type=float)
    m.add_argument("--warmup", type=int)
    m.add_argument("--eval-every", type=int, help="chorales: validation interval")

    def run(args: argparse.Namespace) -> int:
        if args.run_dir is None:
            args.run_dir = f"runs/compare-{args.task}"
        return cmd_compare(args)

    p.set_defaults(func=run)
