"""The fused kernels compile for real GPUs, and every launch fits its shared-memory budget.

Triton's interpreter (the rest of this folder on a CPU) runs the kernels' Python, which accepts
programs the compiler refuses; the compiler alone knows the shared memory a launch asks for,
which decides whether it runs at all on a GPU with less (an RTX 4090 has about 100 KiB, an H100
228). ``python -m relpos.kernels.aot`` compiles every kind of launch the ``fused`` backend makes
(:data:`~relpos.kernels.aot.VARIANTS`) for the GPUs each tile size is chosen for, with the
``ptxas`` Triton ships: no GPU needed, in a process of its own without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton

from relpos.functional.distance_form import DistanceForm
from relpos.kernels import interpreted
from relpos.kernels.aot import (
    DEFAULT_VARIANTS,
    VARIANTS,
    KernelReport,
    main,
    over_budget,
    variant_launches,
)
from relpos.kernels.relative_attention import (
    KEYED_CANDIDATES,
    LAUNCH_CANDIDATES,
    SHARED_BUDGET,
    KernelTiles,
    Tiles,
    launch_config,
    parse_launches,
    recorded_launches,
    relative_flash_attention,
    shared_budget,
    tile_size,
    warp_count,
)

#: The kernels in launch order: the queries' backward computes what the keys' backward reads.
KERNELS = ("_forward_kernel", "_backward_q_kernel", "_backward_kv_kernel")
#: Each kernel's launch in :class:`KernelTiles`.
LAUNCHED_BY = {"forward": "_forward_kernel", "keys": "_backward_kv_kernel",
               "queries": "_backward_q_kernel"}  # fmt: skip
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _compile(tmp_path: Path, *flags: str, check: bool = True) -> list[dict]:
    """``python -m relpos.kernels.aot`` with ``flags`` (and ``--check`` where ``check``): its
    rows."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "relpos.kernels.aot", "--json", str(out), *flags]
    command += ["--check"] if check else []
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


#: By default the small tiles compile the two variants with the most registers and shared memory
#: (a query-dependent table with a value term and dropout; the Music Transformer's wide table),
#: launch_config's untimed options (compiled together) the first of them; every variant under
#: ``-m slow``.
UNTIMED = ("--one-row", "--unmasked")
HEAVIEST = "shaw-values-dropout,music"
#: The large tiles' default share of the variants (each compile takes seconds, a cold cache's
#: minutes): each kind of table once (shared over general positions, per query with the mass,
#: wide with its own rows, a key term, summed by entry), a linear form with dropout and KERPLE's
#: power form (a log and an exponential per pair); every variant under ``-m slow``.
COVER = "t5-positions,shaw-values,music,deberta,alibi-dropout,kerple-power,distance-bias"


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its NVIDIA backend")
@pytest.mark.parametrize(
    ("arches", "tiles", "dtypes", "extra", "variants"),
    [
        # The large tiles: H100 (and A100); a cover of the variants, all of them under -m slow.
        pytest.param("90", "64", "bfloat16", (), COVER, id="90-64-bfloat16-cover"),
        pytest.param("90", "64", "bfloat16", (), None, marks=pytest.mark.slow),
        ("89", "32", "bfloat16", (), HEAVIEST),  # the small ones: RTX 4090, L4, L40 (and sm_86)
        ("90", "64", "bfloat16", UNTIMED, HEAVIEST.split(",")[0]),
        pytest.param("89", "32", "bfloat16", (), None, marks=pytest.mark.slow),
        pytest.param("90", "64", "bfloat16", UNTIMED, None, marks=pytest.mark.slow),
        pytest.param("80,90", "32", "float32", (), None, marks=pytest.mark.slow),
        pytest.param("80", "64,32", "float16", (), None, marks=pytest.mark.slow),
        # Past head dim 64 an H100 takes 32×32 tiles (tile_size), within a budget grown with it.
        ("90", "32", "bfloat16", ("--head-dim", "256"), HEAVIEST.split(",")[1]),
        pytest.param("90", "32", "bfloat16", ("--head-dim", "128"), None, marks=pytest.mark.slow),
        pytest.param("90", "32", "bfloat16", ("--head-dim", "256"), None, marks=pytest.mark.slow),
    ],
)
def test_every_launch_compiles_within_its_budget(tmp_path, arches, tiles, dtypes, extra, variants):
    """Each kind of launch compiles for the architecture (the interpreter would not tell) and asks
    for no more shared memory than :data:`SHARED_BUDGET` grants its tile, so
    :func:`tile_size`'s choice launches on the GPUs it is made for."""
    flags = ["--arch", arches, "--tile", tiles, "--dtype", dtypes, *extra]
    rows = _compile(tmp_path, *flags, *(("--variants", variants) if variants else ()))
    sizes = [len(flag.split(",")) for flag in (arches, tiles, dtypes)]
    kinds = len(variants.split(",")) if variants else len(DEFAULT_VARIANTS)
    assert len(rows) == kinds * len(KERNELS) * sizes[0] * sizes[1] * sizes[2]
    assert {r["kernel"] for r in rows} == set(KERNELS)
    for r in rows:
        kind = "float32" if r["dtype"] == "float32" else "half"
        assert 0 < r["shared"] <= shared_budget(r["tile"], kind, r["head_dim"]), r
        assert r["warps"] == warp_count(getattr(torch, r["dtype"])), r
        if r["dtype"] == "float32" and r["spilled"] is not None:
            # At 4 warps the keys' backward kernel spilled 4.8-5.9 KB per thread (warp_count).
            assert r["spilled"] < 4096, r


#: The most shared memory an H100 grants a block (``shared_memory_per_block_optin``).
H100_SHARED = 227 * 1024


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its NVIDIA backend")
@pytest.mark.slow  # candidates for a GPU session, which reports one that fails and goes on
@pytest.mark.parametrize("variants", ["shaw-values", ",".join(DEFAULT_VARIANTS)])
def test_the_launch_candidates_compile_for_an_h100(tmp_path, variants):
    """Every per-kernel launch a GPU session is to time (:data:`LAUNCH_CANDIDATES`) compiles
    for sm_90 and fits an H100's shared memory, so none of its minutes goes to a launch that
    cannot run (by default Shaw's keys and values: the most shared memory of the variants)."""
    launches = ",".join(LAUNCH_CANDIDATES)
    rows = _compile(tmp_path, "--arch", "90", "--launches", launches, "--variants", variants)
    assert len(rows) == len(variants.split(",")) * len(LAUNCH_CANDIDATES) * len(KERNELS)
    sides = {(r["kernel"], r["bm"], r["bn"], r["warps"], r["stages"]) for r in rows}
    for text in LAUNCH_CANDIDATES:
        for field, tiles in parse_launches(text)._asdict().items():
            assert (LAUNCHED_BY[field], *tiles) in sides
    assert all(0 < r["shared"] <= H100_SHARED for r in rows), rows


KEYED = [name for name in VARIANTS if name.endswith("-keyed")]


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its NVIDIA backend")
@pytest.mark.slow  # off by default: a launch option for a GPU session to time
@pytest.mark.parametrize("variants", ["shaw-values-keyed", ",".join(KEYED)])
def test_the_keyed_kernels_compile_for_an_h100(tmp_path, variants):
    """The kernels that compute each tile's ``q·Eᵀ`` (``keyed_logits``, off by default, so not
    held to the default tiles' budget), with the launches a GPU session is to time them with
    (:data:`KEYED_CANDIDATES`) and the square default, compile for sm_90 and fit an H100's shared
    memory (by default Shaw's keys and values: the most of them)."""
    assert KEYED and not set(KEYED) & set(DEFAULT_VARIANTS)
    launches = ",".join(["64x64w4/64x64w4/64x64w4", *KEYED_CANDIDATES])
    flags = ("--arch", "90", "--launches", launches, "--variants", variants)
    rows = _compile(tmp_path, *flags, check=False)
    assert len(rows) == len(variants.split(",")) * (1 + len(KEYED_CANDIDATES)) * len(KERNELS)
    assert all(0 < r["shared"] <= H100_SHARED for r in rows), rows


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its NVIDIA backend")
def test_the_smallest_tiles_fit_a_small_gpu_at_head_dim_256(tmp_path):
    """Where even 32×32 tiles would not fit (:func:`tile_size`: bf16 at d=256 on a GPU of about
    100 KiB a block), the 16×16 launch does: for sm_89 (an RTX 4090: 99 KiB)."""
    rows = _compile(
        tmp_path, "--arch", "89", "--launches", "16x16w4/16x16w4/16x16w4", "--head-dim", "256",
        "--variants", "music",
    )  # fmt: skip
    assert len(rows) == len(KERNELS)
    assert all(r["head_dim"] == 256 and 0 < r["shared"] <= 99 * 1024 for r in rows), rows


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--launches", "64x64w4"], "--launches: launches are FORWARD/KEYS/QUERIES"),
        (["--head-dim", "0"], "--head-dim must be positive, got 0"),
        (["--arch", "sm_90"], "--arch: 'sm_90' is not a whole number"),
        (["--tile", "48"], "--tile: 48 has no shared-memory budget"),
        (["--dtype", "float64"], "--dtype: 'float64' is none of"),
        (["--variants", "bogus"], "--variants: unknown 'bogus'"),
    ],
)
def test_bad_flags_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        main(flags)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not interpreted(), reason="Triton's interpreter is off")
def test_the_interpreter_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2
    assert "TRITON_INTERPRET is set" in capsys.readouterr().err


def test_the_budget_check_can_fail():
    """A kernel over its budget is reported (so ``--check`` above could fail)."""
    budget = SHARED_BUDGET[(64, "half")]
    row = KernelReport("t5", "bfloat16", 64, 4, 90, "_forward_kernel", budget, 255, 0)
    assert over_budget([row]) == []
    assert over_budget([row._replace(shared=budget + 1)]) == [row._replace(shared=budget + 1)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_variant_records_one_launch_per_kernel_and_runs_none(variant):
    """On ``meta`` tensors, with the tiles and warps asked for: nothing is computed."""
    launches = variant_launches(variant, torch.bfloat16, 64, 8)
    assert [launch.kernel.__name__ for launch in launches] == list(KERNELS)
    for launch in launches:
        assert launch.constexprs["BM"] == launch.constexprs["BN"] == 64
        assert launch.options == {"num_warps": 8, "enable_fp_fusion": True}


@pytest.mark.parametrize(("dtype", "warps"), [(torch.bfloat16, 4), (torch.float32, 8)])
def test_each_dtype_launches_with_its_own_warps(dtype, warps):
    """Without :func:`launch_config`, float32 takes 8 warps (its products spill at 4) and half
    precision 4; the backward kernels keep the forward's."""
    assert warp_count(dtype) == warps
    launches = variant_launches("shaw-values-dropout", dtype, 32)
    assert [launch.options["num_warps"] for launch in launches] == [warps] * len(KERNELS)


def test_launch_config_and_recording_refuse_bad_use():
    with recorded_launches(), pytest.raises(RuntimeError, match="does not nest"):
        with recorded_launches():
            pass
    with pytest.raises(ValueError, match="tile must be 16, 32, 64 or 128, got 48"):
        with launch_config(tile=48):
            pass
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16, got 3"):
        with launch_config(num_warps=3):
            pass
    with pytest.raises(ValueError, match="keys: tiles must be 16, 32, 64 or 128 a side, got 64x8"):
        with launch_config(keys=(64, 8, 4)):
            pass
    with pytest.raises(ValueError, match="queries: stages must be 1 to 8 or None, got 0"):
        with launch_config(queries=Tiles(64, 64, 4, 0)):
            pass


def test_each_kernel_launches_as_configured():
    """``launch_config``'s per-kernel launches reach each kernel whole (tiles, warps, stages);
    a kernel not named keeps the square ``tile`` and ``num_warps``."""
    launches = parse_launches("128x64w8s3/32x128w4/64x64w4")
    assert launches == KernelTiles(Tiles(128, 64, 8, 3), Tiles(32, 128, 4), Tiles(64, 64, 4))
    got = variant_launches("music-positions", torch.bfloat16, 64, launches=launches)
    assert [g.kernel.__name__ for g in got] == list(KERNELS)
    assert [(g.constexprs["BM"], g.constexprs["BN"], g.options) for g in got] == [
        (128, 64, {"num_warps": 8, "enable_fp_fusion": True, "num_stages": 3}),
        (64, 64, {"num_warps": 4, "enable_fp_fusion": True}),
        (32, 128, {"num_warps": 4, "enable_fp_fusion": True}),
    ]
    # General positions: each kernel's block ranges are cut for its own tiles.
    ranges = [launch.args[-2] for launch in got]
    assert [tuple(r.shape) for r in ranges] == [(2, 2, 2), (2, 4, 2), (2, 2, 2)]
    with launch_config(tile=32, num_warps=2, keys=(16, 64, 8)), recorded_launches() as runs:
        _attend_once()
    assert [(r.constexprs["BM"], r.constexprs["BN"], r.options["num_warps"]) for r in runs] == [
        (32, 32, 2), (32, 32, 2), (16, 64, 8)
    ]  # fmt: skip


def _attend_once() -> None:
    """One forward and backward pass of ALiBi through the kernels on small CPU tensors (to be
    recorded: nothing runs; on ``meta`` the kernels' operators would run their shape functions
    only)."""
    q, k, v = (torch.empty(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    pos = torch.arange(64, dtype=torch.int32)[None]
    lut = torch.zeros(1, dtype=torch.int32)
    form = DistanceForm("linear", torch.ones(2, 1))
    out, _ = relative_flash_attention(
        q, k, v, None, lut, 0, pos, pos, pos, pos, rows=1, causal=True, plain=True,
        distance_form=form,
    )  # fmt: skip
    out.sum().backward()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("64x4", "launches are FORWARD/KEYS/QUERIES"),
        ("64x64w4/64x64w4", "launches are FORWARD/KEYS/QUERIES"),
        ("64x64w4/64x48w4/64x64w4", "keys: tiles must be 16, 32, 64 or 128 a side, got 64x48"),
    ],
)
def test_launches_are_parsed_or_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_launches(text)


def test_tile_size_fits_the_device():
    big, small = 228 * 1024, 99 * 1024  # H100, RTX 4090
    assert tile_size(torch.bfloat16, big) == tile_size(torch.float16, big) == 64
    assert tile_size(torch.bfloat16, small) == 32
    assert tile_size(torch.float32, big) == 32  # exact products: 64 spills registers
    assert tile_size(torch.float32, None) == tile_size(torch.bfloat16, None) == 32  # interpreter
    assert SHARED_BUDGET[(64, "half")] <= 160 * 1024  # an A100 (164 KiB) takes the large tiles
    # Past head dim 64 the need grows (273 KiB at d=256 on sm_90): an H100 takes 32×32 tiles.
    assert tile_size(torch.bfloat16, big, 48) == tile_size(torch.bfloat16, big, 64) == 64
    assert shared_budget(32, "half", 128) == 2 * shared_budget(32, "half") == 2 * 48 * 1024
    # Where even 32×32 would not fit (about 100 KiB at d=256: up to 101 KiB there), 16×16.
    assert tile_size(torch.bfloat16, small, 128) == 32
    assert tile_size(torch.bfloat16, small, 256) == tile_size(torch.float32, big, 256) == 16
    assert shared_budget(16, "half") is None
    assert tile_size(torch.bfloat16, big, 128) == tile_size(torch.bfloat16, big, 256) == 32
    assert tile_size(torch.bfloat16, 512 * 1024, 256) == 64
    assert max(SHARED_BUDGET[(32, kind)] for kind in ("half", "float32")) <= 99 * 1024
