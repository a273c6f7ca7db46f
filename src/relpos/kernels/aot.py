"""Compile the fused kernels ahead of time for a CUDA architecture, on a machine with no GPU.

Triton lowers a kernel to PTX and assembles it with the ``ptxas`` its wheel ships, with no device
needed. What that reports decides, before any GPU is at hand, whether a launch fits a GPU (the
shared memory it asks for) and how its tiles sit in registers (registers and spilled bytes per
thread). The kernels are those the ``fused`` backend launches for each of :data:`VARIANTS`, recorded
on small CPU tensors by :func:`~.relative_attention.recorded_launches`.

.. code-block:: text

    python -m relpos.kernels.aot --arch 80,90 --tile 64 --dtype bfloat16 [--warps 4,8]
        [--launches FORWARD/KEYS/QUERIES,...] [--head-dim 64] [--[no-]one-row] [--lut-only]
        [--[no-]unmasked] [--check] [--json F]

``--launches`` replaces ``--tile`` and ``--warps`` with each kernel's own tiles, warps and
pipeline stages (:func:`~.relative_attention.parse_launches`: ``128x64w8s3/32x128w4/128x32w8``).

``--check`` exits 1 when a kernel needs more shared memory than
:data:`~.relative_attention.SHARED_BUDGET` allows its tile and dtype
(``tests/fused/test_compile.py`` runs it). Needs ``triton`` with its NVIDIA backend, and
``TRITON_INTERPRET`` unset (the interpreter replaces the kernels with Python functions).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..atomic import atomic_path
from ..functional.distance_form import LINEAR_FORMS, DistanceForm
from . import interpreted
from .relative_attention import (
    SHARED_BUDGET,
    KernelTiles,
    Launch,
    launch_config,
    parse_launches,
    recorded_launches,
    relative_flash_attention,
    shared_budget,
)

__all__ = [
    "DEFAULT_VARIANTS",
    "VARIANTS",
    "KernelReport",
    "compile_launch",
    "main",
    "over_budget",
    "report",
    "variant_launches",
]

#: One call of :func:`~.relative_attention.relative_flash_attention` per kind of launch the
#: ``fused`` backend makes: the table shared by every query (T5: read per distance; a distance
#: bias's, past the register rows), per query with
#: the mass (Shaw's keys and values) or past the register rows (the Music Transformer: its rows
#: computed from clipped distances, its row sums stored per query, or atomic over general
#: positions), a key term (DeBERTa: read per entry, or atomic over general positions), a
#: distance function (ALiBi's learned slopes, KERPLE's two
#: kernels: their parameters' gradient), dropout, and general positions (padding, packing, a
#: cache: ``plain=False``).
VARIANTS: dict[str, dict] = {
    "t5": dict(rel="shared", rows=32),
    "t5-positions": dict(rel="shared", rows=32, causal=False, plain=False),
    "shaw-values": dict(rel="query", rows=33, mass=True, row_base=0),
    "shaw-values-dropout": dict(rel="query", rows=33, mass=True, dropout=0.1, row_base=0),
    "music": dict(rel="query", rows=513, row_base=0),
    "music-positions": dict(rel="query", rows=513, plain=False, row_base=0),
    # DeBERTa over plain positions: both tables read per entry of its clip, each query's and
    # key's rows stored (OWN_ROWS); over general positions, summed by atomic adds.
    "deberta": dict(rel="query", rows=513, relk=True, causal=False, row_base=0),
    "deberta-positions": dict(rel="query", rows=256, relk=True, causal=False, plain=False),
    "alibi": dict(rows=1, form="linear"),
    "alibi-bidirectional": dict(rows=1, form="symmetric_linear", causal=False),
    "alibi-dropout": dict(rows=1, form="linear", dropout=0.1),
    "kerple-log": dict(rows=1, form="kerple_log"),
    "kerple-power": dict(rows=1, form="kerple_power", causal=False),
    # A distance bias with no closed form (Sandwich, DPB): a shared table of every distance, its
    # gradient summed by entry (BY_ENTRY); general positions sum per pair where not on diagonals.
    "distance-bias": dict(rel="shared", rows=511),
    "distance-bias-positions": dict(rel="shared", rows=511, plain=False),
    # The keys in place of the logits (keyed_logits, off by default: not in DEFAULT_VARIANTS).
    "music-keyed": dict(keys=True, rows=513, row_base=0),
    "transformer-xl-keyed": dict(keys=True, row_bias=True, rows=513, row_base=0),
    "shaw-values-keyed": dict(keys=True, rows=33, mass=True),
}

#: The variants of the launches made by default (``--variants``' default): all but the keyed.
DEFAULT_VARIANTS = [name for name in VARIANTS if not name.endswith("-keyed")]

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int64: "i64", torch.int8: "i8"}  # fmt: skip


class KernelReport(NamedTuple):
    """What compiling one launch for one architecture reports."""

    variant: str
    dtype: str
    tile: int  # the longer side of the tile
    warps: int
    arch: int
    kernel: str
    shared: int  # bytes of shared memory per block
    registers: int | None  # per thread (None: Triton ships no cuobjdump)
    spilled: int | None  # bytes of local memory per thread
    bm: int = 0  # the tile's queries and keys (0: square, ``tile``)
    bn: int = 0
    stages: int | None = None  # Triton's num_stages (None: its default)
    head_dim: int = 64

    @property
    def budget(self) -> int | None:
        """The shared memory its tile, dtype and head dim may use (:func:`.shared_budget`: a
        square tile's, or its longer side's as an upper bound; None: a size the kernels never
        take by default)."""
        kind = "float32" if self.dtype == "float32" else "half"
        return shared_budget(self.tile, kind, self.head_dim)


def variant_launches(
    variant: str,
    dtype: torch.dtype,
    tile: int,
    warps: int | None = None,
    *,
    d: int = 64,
    n: int = 256,
    one_row: bool | None = None,
    lut_only: bool = False,
    unmasked: bool | None = None,
    launches: KernelTiles | None = None,
) -> list[Launch]:
    """The launches of one forward and backward pass of ``variant`` (a key of :data:`VARIANTS`)
    with ``dtype`` inputs of head dim ``d`` and ``n`` tokens, ``tile``-square tiles and ``warps``
    warps (None: the kernels' default for ``dtype``, :func:`~.relative_attention.warp_count`) or
    each kernel's ``launches``, and ``one_row``, ``lut_only`` and ``unmasked``
    (:func:`~.relative_attention.launch_config`; None: the measured defaults,
    :func:`~.relative_attention.tile_options`)."""
    spec = dict(VARIANTS[variant])
    rows, rel = spec.pop("rows"), spec.pop("rel", None)
    b, h = 2, 4
    # Small CPU tensors (the launches are recorded, not run): on ``meta`` the kernels' operators
    # would run their shape functions only, and launch nothing.
    meta = {"requires_grad": True}
    q, k, v = (torch.empty(b, h, n, d, dtype=dtype, **meta) for _ in range(3))
    table = {
        "query": lambda: torch.empty(b, h, n, rows, **meta),
        "shared": lambda: torch.empty(1, h, 1, rows, **meta),
        None: lambda: None,
    }[rel]()
    pos = torch.zeros(b, n, dtype=torch.int32)
    lut = torch.zeros(rows, dtype=torch.int32)
    form = spec.pop("form", None)
    width = 1 if form in LINEAR_FORMS else 2
    form = None if form is None else DistanceForm(form, torch.ones(h, width, **meta))
    relk = torch.empty(b, h, n, rows, **meta) if spec.pop("relk", False) else None
    keys = torch.empty(h, rows, d, dtype=dtype, **meta) if spec.pop("keys", False) else None
    row_bias = torch.empty(h, rows, **meta) if spec.pop("row_bias", False) else None
    spec.setdefault("causal", True)
    spec.setdefault("plain", True)
    spec["dropout_p"] = spec.pop("dropout", 0.0)
    kernels = launches._asdict() if launches else {}
    options = dict(one_row=one_row, lut_only=lut_only, unmasked=unmasked, **kernels)
    with launch_config(tile, warps, **options), recorded_launches() as recorded:
        out, mass = relative_flash_attention(
            q, k, v, table, lut, rows // 2, pos, pos, pos, pos, rows=rows, seed=1,
            distance_form=form, relk=relk, keys=keys, row_bias=row_bias, **spec,
        )  # fmt: skip
        (out.sum() + mass.sum()).backward()
    return list(recorded)


def _signature(launch: Launch) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` as Triton's launcher specialises them: 16-byte aligned
    pointers and integers divisible by 16 are marked so, an integer 1 is a constant."""
    fn = launch.kernel
    values = dict(zip(fn.arg_names, launch.args, strict=False)) | launch.constexprs
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params, strict=True)):
        value = values[name]
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    return signature, constexprs, attrs


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """Registers and spilled bytes per thread, from the ``cuobjdump`` Triton ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(found[1]), int(found[2])) if found else (None, None)


def compile_launch(launch: Launch, arch: int) -> tuple[int, int | None, int | None]:
    """Compile one launch for ``sm_<arch>``: ``(shared bytes, registers, spilled bytes)``."""
    kernel = triton.compile(
        ASTSource(launch.kernel, *_signature(launch)),
        target=GPUTarget("cuda", arch, 32),
        options=launch.options,
    )
    return kernel.metadata.shared, *_resources(kernel.asm["cubin"])


def report(
    variants: list[str],
    dtypes: list[torch.dtype],
    tiles: list[int],
    arches: list[int],
    warps: tuple[int | None, ...] = (None,),
    one_row: bool | None = None,
    lut_only: bool = False,
    unmasked: bool | None = None,
    launches: list[KernelTiles] | None = None,
    head_dim: int = 64,
) -> list[KernelReport]:
    """Every kernel of every variant × dtype × tile × warps (or each of ``launches``) ×
    architecture, compiled at ``head_dim``."""
    rows = []
    options = dict(one_row=one_row, lut_only=lut_only, unmasked=unmasked, d=head_dim)
    shapes = [(t, w, None) for t, w in itertools.product(tiles, warps)]
    if launches:
        shapes = [(64, None, kernels) for kernels in launches]
    for variant, dtype, (tile, w, kernels) in itertools.product(variants, dtypes, shapes):
        name = str(dtype).removeprefix("torch.")
        recorded = variant_launches(variant, dtype, tile, w, launches=kernels, **options)
        for arch, launch in itertools.product(arches, recorded):
            found = compile_launch(launch, arch)
            bm, bn = launch.constexprs["BM"], launch.constexprs["BN"]
            rows.append(KernelReport(
                variant, name, max(bm, bn), launch.options["num_warps"], arch,
                launch.kernel.__name__, *found, bm, bn, launch.options.get("num_stages"),
                head_dim,
            ))  # fmt: skip
    return rows


def over_budget(rows: list[KernelReport]) -> list[KernelReport]:
    """The rows whose kernel needs more shared memory than its tile and dtype's budget."""
    return [r for r in rows if r.budget is not None and r.shared > r.budget]


def _list(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relpos.kernels.aot", description=__doc__)
    parser.add_argument("--arch", default="80,90", help="CUDA architectures, e.g. 80,90")
    parser.add_argument("--tile", default="64,32", help="square tile sizes")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32")
    parser.add_argument(
        "--warps", default="", help="warps per program, e.g. 4,8 (default: each dtype's own)"
    )
    parser.add_argument(
        "--launches", default="",
        help="each kernel's launch, FORWARD/KEYS/QUERIES with each BMxBNwWARPS[sSTAGES], "
        "comma-separated (e.g. 128x64w8s3/32x128w4/128x32w8); replaces --tile and --warps",
    )  # fmt: skip
    parser.add_argument("--head-dim", type=int, default=64, help="the heads' dimension")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS),
        help="keys of VARIANTS (default: all but the -keyed ones)",
    )  # fmt: skip
    for flag in ("one-row", "unmasked"):  # neither: the measured defaults (tile_options)
        parser.add_argument(
            f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
            help=f"with launch_config({flag.replace('-', '_')}=True), or False with --no-{flag}",
        )  # fmt: skip
    parser.add_argument("--lut-only", action="store_true", help="with launch_config(lut_only=True)")
    parser.add_argument("--check", action="store_true", help="exit 1 past SHARED_BUDGET")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    for name in _list(args.variants):
        if name not in VARIANTS:
            parser.error(f"--variants: unknown {name!r}; choose from {', '.join(VARIANTS)}")
    dtypes = []
    for name in _list(args.dtype):
        if name not in ("bfloat16", "float16", "float32"):
            parser.error(f"--dtype: {name!r} is none of bfloat16, float16, float32")
        dtypes.append(getattr(torch, name))
    for flag in ("arch", "tile", "warps"):
        bad = [t for t in _list(getattr(args, flag)) if not t.isdigit()]
        if bad:
            parser.error(f"--{flag}: {bad[0]!r} is not a whole number (e.g. --arch 80,90)")
    tiles = [int(t) for t in _list(args.tile)]
    for tile in tiles:
        if not any(key[0] == tile for key in SHARED_BUDGET):
            parser.error(f"--tile: {tile} has no shared-memory budget (tiles: 64, 32)")
    try:
        launches = [parse_launches(text) for text in _list(args.launches)]
    except ValueError as e:
        parser.error(f"--launches: {e}")
    if args.head_dim < 1:
        parser.error(f"--head-dim must be positive, got {args.head_dim}")
    if interpreted():
        parser.error("TRITON_INTERPRET is set: the kernels are Python functions, not compilable")
    warps = tuple(int(w) for w in _list(args.warps)) or (None,)
    arches = [int(a) for a in _list(args.arch)]
    rows = report(
        _list(args.variants), dtypes, tiles, arches, warps, one_row=args.one_row,
        lut_only=args.lut_only, unmasked=args.unmasked, launches=launches,
        head_dim=args.head_dim,
    )  # fmt: skip
    over = over_budget(rows)
    print("variant               dtype     tile    warps stages  sm  kernel               shared "
          " regs spill")  # fmt: skip
    for r in rows:
        mark = f"  over the budget of {r.budget} B" if r in over else ""
        regs, spilled = ("-" if x is None else x for x in (r.registers, r.spilled))
        stages = "-" if r.stages is None else r.stages
        print(
            f"{r.variant:21s} {r.dtype:9s} {f'{r.bm}x{r.bn}':7s} {r.warps:5d} {stages:>6} "
            f"{r.arch:3d}  {r.kernel:20s} {r.shared:7d} {regs:>5} {spilled:>5}{mark}"
        )
    if args.json:
        with atomic_path(args.json) as tmp:
            tmp.write_text(json.dumps([r._asdict() for r in rows], indent=1))
    if args.check and over:
        print(f"{len(over)} kernel(s) over their shared-memory budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
