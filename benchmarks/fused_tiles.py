"""Which tiles and warps the ``fused`` kernel should launch with on this GPU: each candidate's
forward+backward time against flash SDPA with no positions, measured in the same run
(docs/performance.md, "fused").

    PYTHONPATH=src python benchmarks/fused_tiles.py --out DIR [--lengths 4096] [--tokens 16384]
        [--schemes alibi,t5,shaw,music,kerple] [--configs 64x4+auto,128x64w8/32x64w4/64x32w4+one]
        [--device cuda]

A candidate is ``TILExWARPS`` (square tiles and the warps of all three kernels) or
``FORWARD/KEYS/QUERIES``, each kernel's own ``BMxBNwWARPS[sSTAGES]``
(``relative_attention.parse_launches``), then its options: ``+one`` for ``one_row``,
``+unmasked`` for ``unmasked``, ``+lut`` for ``lut_only`` (``relative_attention.launch_config``;
``+keyed`` for ``keyed`` (a scheme with no keys to hand the kernels skips such a candidate; an
option not named is off), or ``+auto`` for ``one_row`` and ``unmasked`` as
``relative_attention.tile_options`` takes them by default for each scheme.
For each scheme, length and candidate, causal, ``B·L = tokens``, bf16 on CUDA: the first call (it
compiles), then ``--repeats`` forward+backward passes alternated run by run with SDPA's
(``relpos bench``'s paired timing; the ratio is the median of the run-by-run ratios), as many
forward passes alone against SDPA's forward (so that the forward's launch and the backward's can
be chosen apart), and, on CUDA, the device's busy time of a forward+backward pass against SDPA's
and the host's time to issue one (``relpos.cli.profiling``: with the host's cost, the same for
every candidate, out of the ratio), and the peak memory of one pass beside SDPA's. A candidate
that fails (Triton's "out of resources") is reported, not fatal. Writes ``tiles.md`` and
``tiles.json`` into ``--out``. On a CPU with ``TRITON_INTERPRET=1`` it runs in the interpreter, in
float32: a check of the script, not a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import relpos
from relpos.atomic import atomic_path
from relpos.attention.fused import fused_supports, fused_takes_keys
from relpos.cli import bench
from relpos.cli.profiling import device_split
from relpos.kernels.relative_attention import (
    KEYED_CANDIDATES,
    LAUNCH_CANDIDATES,
    launch_config,
    parse_launches,
)

#: The square default beside the per-kernel candidates, each with the measured options.
DEFAULT_CONFIGS = ",".join(
    [f"{c}+auto" for c in ("64x4", *LAUNCH_CANDIDATES)]
    + [f"{c}+auto+keyed" for c in ("64x4", *KEYED_CANDIDATES)]
)
#: A candidate's options after ``+``, as ``launch_config``'s keywords.
OPTIONS = {"one": "one_row", "lut": "lut_only", "unmasked": "unmasked", "keyed": "keyed"}
#: The option that leaves ``one_row`` and ``unmasked`` to ``tile_options``' defaults.
AUTO = "auto"


def _config(text: str) -> tuple[str, dict]:
    """``(launch, launch_config's keywords)`` of one candidate."""
    shape, *options = text.split("+")
    tile, _, warps = shape.partition("x")
    square = tile.isdigit() and warps.isdigit()
    auto = AUTO in options
    named = set(options) - {AUTO}
    if (
        not (square or "/" in shape)
        or not named <= OPTIONS.keys()
        or (auto and named & {"one", "unmasked"})
    ):
        raise argparse.ArgumentTypeError(
            "a candidate is TILExWARPS or FORWARD/KEYS/QUERIES (each BMxBNwWARPS[sSTAGES]), then "
            f"[+one][+lut][+unmasked][+keyed] or [+auto][+lut][+keyed] (e.g. 64x8, 64x4+one, "
            f"128x64w8/32x128w4/128x32w4+auto), got {text!r}"
        )
    try:
        if square:
            launch = dict(tile=int(tile), num_warps=int(warps))
        else:
            launch = parse_launches(shape)._asdict()
        with launch_config(**launch):  # its checks
            pass
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None
    flags = {key: name in options for name, key in OPTIONS.items()}
    if auto:
        flags |= {"one_row": None, "unmasked": None}
    return shape, launch | flags


def _has_keys(name: str) -> bool:
    """Whether the ``fused`` backend hands the kernels ``name``'s keys under ``keyed``."""
    return fused_takes_keys(relpos.make_scheme(name, d_model=64, num_heads=1, causal=True))


def _peak_mib(fn, setup: bench.Setup) -> float | None:
    """Peak memory of one forward+backward pass above the inputs (CUDA; None elsewhere)."""
    if setup.q.device.type != "cuda":
        return None
    return bench.cuda_peak_bytes(fn, setup) / 2**20


def _device_split(run, setup: bench.Setup, base: bench.Setup, repeats: int) -> dict:
    """A forward+backward pass's device time (ms), its ratio to SDPA's, and the host's time to
    issue it (ms; ``relpos.cli.profiling``)."""
    step = bench.step_of(run, setup, backward=True)
    base_step = bench.step_of(bench.sdpa_plain, base, backward=True)
    split = device_split(step, base_step, repeats=repeats, device="cuda")
    ratio = split.device / split.base
    return {"device_ms": split.device * 1e3, "device_ratio": ratio, "host_ms": split.host * 1e3}


def measure(args: argparse.Namespace, scheme: str, n: int, launch: str, config: dict) -> dict:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shape = dict(causal=True, heads=args.heads, head_dim=args.head_dim, device=args.device)
    batch = max(args.tokens // n, 1)
    setup = bench.make_setup(scheme, n, batch, dtype=dtype, grad=True, **shape)
    base = bench.make_setup("none", n, batch, dtype=dtype, grad=True, **shape)
    run = bench.backend_call("fused")
    row = {"scheme": scheme, "length": n, "batch": batch, "launch": launch}
    row |= {key: config[key] for key in OPTIONS.values()}
    paired = dict(repeats=args.repeats, warmup=args.warmup, device=args.device)
    try:
        with launch_config(**config):
            start = time.perf_counter()
            bench.measure_time(run, setup, backward=True, repeats=1, warmup=0, device=args.device)
            row["first_s"] = time.perf_counter() - start
            times, base_times = bench.measure_paired(
                run, setup, bench.sdpa_plain, base, backward=True, **paired
            )
            fwd, base_fwd = bench.measure_paired(
                run, setup, bench.sdpa_plain, base, backward=False, **paired
            )
            row["peak_mib"] = _peak_mib(run, setup)
            if args.device == "cuda":
                try:
                    row |= _device_split(run, setup, base, args.repeats)
                except Exception as e:  # the profiler is a guest: the wall figures stand
                    row["device_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    except Exception as e:  # a candidate the GPU cannot launch: reported, the others go on
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        return row
    row["ms"] = statistics.median(times) * 1e3
    row["sdpa_ms"] = statistics.median(base_times) * 1e3
    row["ratio"] = bench.paired_ratio(times, base_times)
    row["forward_ms"] = statistics.median(fwd) * 1e3
    row["forward_ratio"] = bench.paired_ratio(fwd, base_fwd)
    row["sdpa_peak_mib"] = _peak_mib(bench.sdpa_plain, base)
    return row


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def render(rows: list[dict], header: str) -> str:
    lines = [header, "", "| scheme | L | B | launch | first call s | fwd+bwd ms | × SDPA "
             "| fwd ms | × SDPA fwd | device ms | device × SDPA | host ms | peak MiB (SDPA) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        config = (
            r["launch"]
            + "".join(f" {key.replace('_', '-')}" for key in OPTIONS.values() if r.get(key))
            + (" auto" if r.get("one_row") is None else "")
        )
        if "error" in r:
            lines.append(f"| {r['scheme']} | {r['length']} | {r['batch']} | {config} | "
                         f"{r['error']} | | | | | | | | |")  # fmt: skip
            continue
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f} ({r['sdpa_peak_mib']:.0f})"
        lines.append(
            f"| {r['scheme']} | {r['length']} | {r['batch']} | {config} | {r['first_s']:.1f} | "
            f"{r['ms']:.2f} | {r['ratio']:.2f} | {r['forward_ms']:.2f} | "
            f"{r['forward_ratio']:.2f} | {_num(r.get('device_ms'))} | "
            f"{_num(r.get('device_ratio'))} | {_num(r.get('host_ms'))} | {peak} |"
        )
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=bench.positive_ints, default=[4096])
    parser.add_argument("--tokens", type=int, default=16384, help="B·L of every configuration")
    parser.add_argument("--schemes", default="alibi,t5,shaw,music,kerple")
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS,
        help="candidates, TILExWARPS or FORWARD/KEYS/QUERIES, each BMxBNwWARPS[sSTAGES]",
    )  # fmt: skip
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        configs = [_config(c) for c in args.configs.split(",") if c]
    except argparse.ArgumentTypeError as e:
        parser.error(f"--configs: {e}")
    schemes = [s for s in args.schemes.split(",") if s]
    for name in schemes:
        try:
            scheme = relpos.make_scheme(name, d_model=64, num_heads=1, causal=True)
        except (KeyError, ValueError) as e:
            parser.error(f"--schemes: {e}")
        if not fused_supports(scheme, device=args.device):
            parser.error(f"--schemes: the fused backend does not run {name} on {args.device}")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter)"
    header = (
        f"`python benchmarks/fused_tiles.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
        f"; {device}, torch {torch.__version__}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for scheme in schemes:
        for n in args.lengths:
            for launch, config in configs:
                if config["keyed"] and not _has_keys(scheme):
                    continue  # the same launch as without +keyed
                rows.append(measure(args, scheme, n, launch, config))
                r = rows[-1]
                shown = r.get("error") or (
                    f"{r['ms']:.2f} ms, {r['ratio']:.2f}× SDPA; forward "
                    f"{r['forward_ratio']:.2f}× SDPA's"
                    + (f"; device {r['device_ratio']:.2f}× SDPA's" if "device_ratio" in r else "")
                )
                name = launch + "".join(f"+{flag}" for flag, key in OPTIONS.items() if config[key])
                name += "+auto" if config["one_row"] is None else ""
                print(f"{scheme} L={n} {name}: {shown}", flush=True)
                # after every row: a run stopped by a time limit keeps what it measured
                _write(args.out / "tiles.json", json.dumps(rows, indent=1))
                _write(args.out / "tiles.md", render(rows, header))
    print(render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
