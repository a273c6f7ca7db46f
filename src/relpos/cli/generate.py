"""``relpos generate``: sample chorales from a run, write MIDI, MusicXML and a piano roll, and
compare the sampled steps with a split's real chorales (``--stats``)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from .argtypes import MAX_SEED, SEED, SPLIT_NAMES, int_type, positive_float, split_type
from .checks import CLIError, output_folder
from .limits import device_flag
from .runs import load_model, run_chorales, run_folder

__all__ = ["MAX_LENGTH", "add_parser", "cmd_generate"]

#: The most sixteenth-note steps ``relpos generate --length`` samples: 40,000 tokens, about 31
#: minutes of music at 80 bpm (a chorale is one to three minutes). Sampling time grows with the
#: square of the length (every token attends to all before it).
MAX_LENGTH = 10_000


def _prime(args: argparse.Namespace, cfg) -> Any:
    """The first ``--prime-steps`` steps of the ``--prime-from`` chorale, or None."""
    split, sep, index = args.prime_from.partition(":")
    if split not in SPLIT_NAMES or not re.fullmatch(r"\d*", index) or (sep and not index):
        raise CLIError(
            f"--prime-from: expected SPLIT:INDEX with SPLIT train, valid or test and INDEX an "
            f"integer >= 0 (e.g. test:0), got {args.prime_from!r}"
        )
    if not args.prime_steps:
        return None
    chorales = run_chorales(cfg, "--prime-from").split(split)
    i = int(index or 0)
    if not 0 <= i < len(chorales):
        raise CLIError(
            f"--prime-from: index {i} is out of range: {split} has {len(chorales)} chorales"
        )
    if args.prime_steps > len(chorales[i]):
        raise CLIError(
            f"--prime-steps {args.prime_steps}: chorale {split}:{i} has only {len(chorales[i])} "
            "steps"
        )
    return chorales[i][: args.prime_steps]


def _midi_out(args: argparse.Namespace, run_dir: Path, seed: int) -> Path:
    if not args.out:
        return run_dir / "samples" / f"sample-seed{seed}.mid"
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise CLIError(f"--out: {out} is a folder; expected a MIDI file path ending in .mid")
    if out.suffix.lower() not in (".mid", ".midi"):
        raise CLIError(
            f"--out: expected a MIDI file path ending in .mid (the MusicXML goes beside it), "
            f"got {out}"
        )
    for beside in (".musicxml", ".png"):
        if out.with_suffix(beside).is_dir():
            raise CLIError(f"--out: {out.with_suffix(beside)} is a folder; choose another name")
    output_folder("--out", out.parent)
    return out


def _sample_outs(args: argparse.Namespace, run_dir: Path) -> dict[int, Path]:
    """The MIDI path of each seed ``--seed``, …, ``--seed + --samples - 1``."""
    last = args.seed + args.samples - 1
    if last > MAX_SEED:
        raise CLIError(
            f"--samples {args.samples}: with --seed {args.seed} the last seed would be {last}, "
            f"beyond the largest seed {MAX_SEED}"
        )
    if args.out and args.samples > 1:
        raise CLIError(
            f"--out names one MIDI file, but --samples {args.samples} asks for several chorales: "
            "drop --out (they go to RUN/samples/sample-seedS.mid, one per seed) or --samples"
        )
    return {seed: _midi_out(args, run_dir, seed) for seed in range(args.seed, last + 1)}


def _stats_out(args: argparse.Namespace, first: Path) -> Path | None:
    """Where ``--stats`` writes its JSON: ``RUN/samples/stats.json``, or ``NAME.stats.json``
    beside ``--out NAME.mid``; None without ``--stats``."""
    if args.stats is None:
        return None
    path = first.with_name(f"{first.stem}.stats.json") if args.out else first.parent / "stats.json"
    if path.is_dir():
        raise CLIError(f"--stats: {path} is a folder; it is where the statistics would be written")
    return path


def _real_chorales(args: argparse.Namespace, cfg) -> list | None:
    """The real chorales of the ``--stats`` split of the run's data; None without ``--stats``."""
    if args.stats is None:
        return None
    real = list(run_chorales(cfg, f"--stats {args.stats}").split(args.stats))
    if not real:
        raise CLIError(
            f"--stats {args.stats}: the {args.stats} split of the run's data ({cfg.data}) has no "
            f"chorales to compare with; choose another of {', '.join(SPLIT_NAMES)}"
        )
    return real


_RATES = {
    "out_of_range": "out of range",
    "voice_crossings": "voice crossings",
    "parallel_fifths": "parallel fifths",
    "parallel_octaves": "parallel octaves",
}


def _write_stats(
    path: Path, split: str, real: list, samples: dict[int, Any], *, prime_steps: int, info: dict
) -> dict[str, Any]:
    """Compare the sampled steps of ``samples`` (seed → chorale, the ``prime_steps`` prefix
    excluded) with ``real`` (:func:`relpos.music.compare_chorales`); print a table and write it
    to ``path`` as JSON (atomically). Returns what it wrote."""
    from ..atomic import atomic_path
    from ..music import chorale_statistics, compare_chorales

    result: dict[str, Any] = {
        "split": split,
        **info,
        "prime_steps": prime_steps,
        "prime_excluded": True,
        "note": "rates per 100 sixteenth-note steps; the generated side counts only the sampled "
        "steps (a --prime-steps prefix is excluded; a parallel motion from its last step into "
        "the first sampled one counts)",
        "real_chorales": len(real),
        **compare_chorales(list(samples.values()), real, skip=prime_steps),
        "samples": [
            {"seed": seed, **chorale_statistics(c, skip=prime_steps)} for seed, c in samples.items()
        ],
    }
    gen, ref = result["generated"], result["real"]
    primed = f"; the {prime_steps} primed steps of each excluded" if prime_steps else ""
    print(
        f"{len(samples)} generated chorale(s) ({gen['steps']:.0f} sampled steps{primed}) "
        f"against the {len(real)} {split} chorales ({ref['steps']:.0f} steps), per 100 steps:\n"
        f"  {'':<22}{'generated':>10}{'real':>10}"
    )
    for key, label in _RATES.items():
        print(f"  {label:<22}{gen[key]:>10.2f}{ref[key]:>10.2f}")
    distance = result["pitch_class_distance"]
    print(f"  {'pitch-class distance':<22}{distance:>10.3f}  (total variation: 0 same, 1 disjoint)")
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return result


def cmd_generate(args: argparse.Namespace) -> int:
    from ..music import sample_chorale, write_midi, write_musicxml, write_piano_roll

    device = device_flag(args.device)
    run_dir = run_folder("--run-dir", args.run_dir)
    outs = _sample_outs(args, run_dir)
    stats_path = _stats_out(args, outs[args.seed])
    model, cfg, _, checkpoint = load_model(run_dir, args.checkpoint)
    model.to(device)
    prime = _prime(args, cfg)
    real = _real_chorales(args, cfg)  # before sampling: a bad --stats writes nothing
    samples = {}
    for seed, out in outs.items():
        try:
            chorale = sample_chorale(
                model,
                args.length,
                temperature=args.temperature,
                top_k=args.top_k,
                seed=seed,
                prime=prime,
                progress=not args.no_progress,
                device=device,
            )
        except ValueError as e:
            flag = "--length/--prime-steps" if "position table" in str(e) else "--checkpoint"
            raise CLIError(f"{flag}: {e}") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        write_midi(chorale, out, tempo_bpm=80)
        xml = write_musicxml(chorale, out.with_suffix(".musicxml"))
        png = write_piano_roll(
            chorale,
            out.with_suffix(".png"),
            title=out.stem,
            prime_steps=0 if prime is None else len(prime),
        )
        print(
            f"wrote {out}, {xml} and {png} ({len(chorale)} sixteenth-note steps, "
            f"{'primed with ' + str(len(prime)) + ' steps, ' if prime is not None else ''}"
            f"temperature {args.temperature}, top-k {args.top_k or 'off'}, seed {seed})"
        )
        samples[seed] = chorale
    if stats_path is not None:
        info = {
            "data": cfg.data,
            "checkpoint": str(checkpoint),
            "length": args.length,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "midi": [str(out) for out in outs.values()],
        }
        prime_steps = 0 if prime is None else len(prime)
        _write_stats(stats_path, args.stats, real, samples, prime_steps=prime_steps, info=info)
    return 0


def add_parser(sub: Any) -> None:
    """The ``generate`` subcommand of ``relpos``'s parser."""
    p = sub.add_parser("generate", help="sample a chorale; write MIDI and MusicXML")
    p.add_argument("--run-dir", default="runs/music")
    p.add_argument("--checkpoint", default="best", help="best, last, or a checkpoint path")
    p.add_argument(
        "--length",
        type=int_type(1, MAX_LENGTH, " (sixteenth-note steps; time grows with its square)"),
        default=64,
        help=f"sixteenth-note steps to sample (1..{MAX_LENGTH})",
    )
    p.add_argument("--temperature", type=positive_float, default=1.0, help="> 0 (default 1)")
    p.add_argument(
        "--top-k", type=int_type(0), default=0, help="sample among the k likeliest (0: off)"
    )
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument(
        "--prime-steps",
        type=int_type(0),
        default=0,
        help="continue the first N steps of a held-out chorale",
    )
    p.add_argument("--prime-from", default="test:0", help="SPLIT:INDEX of the priming chorale")
    p.add_argument("--out", default=None, help="MIDI path, .mid (default: RUN/samples/…)")
    p.add_argument(
        "--samples",
        type=int_type(1),
        default=1,
        help="chorales to sample, seeds SEED, SEED+1, … (default 1; more than one: not with --out)",
    )
    p.add_argument(
        "--stats",
        type=split_type,
        default=None,
        metavar="SPLIT",
        help="compare the sampled steps with the real chorales of SPLIT (train, valid, test) of "
        "the run's data; print a table and write RUN/samples/stats.json (or NAME.stats.json "
        "beside --out NAME.mid)",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)
