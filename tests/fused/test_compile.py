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

from relpos.kernels import interpreted
from relpos.kernels.aot import VARIANTS, KernelReport, main, over_budget, variant_launches
from relpos.kernels.relative_attention import (
    SHARED_BUDGET,
    launch_config,
    recorded_launches,
    tile_size,
    warp_count,
)

KERNELS = ("_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _compile(tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "relpos.kernels.aot", "--check", "--json", str(out), *flags]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


#: By default the small tiles compile the two variants with the most registers and shared memory
#: (a query-dependent table with a value term and dropout; the Music Transformer's wide table),
#: launch_config's untimed options (compiled together) the first of them; every variant under
#: ``-m slow``.
UNTIMED = ("--one-row", "--unmasked")
HEAVIEST = "shaw-values-dropout,music"


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton without its NVIDIA backend")
@pytest.mark.parametrize(
    ("arches", "tiles", "dtypes", "extra", "variants"),
    [
        ("90", "64", "bfloat16", (), None),  # the large tiles: H100 (and A100)
        ("89", "32", "bfloat16", (), HEAVIEST),  # the small ones: RTX 4090, L4, L40 (and sm_86)
        ("90", "64", "bfloat16", UNTIMED, HEAVIEST.split(",")[0]),
        pytest.param("89", "32", "bfloat16", (), None, marks=pytest.mark.slow),
        pytest.param("90", "64", "bfloat16", UNTIMED, None, marks=pytest.mark.slow),
        pytest.param("80,90", "32", "float32", (), None, marks=pytest.mark.slow),
        pytest.param("80", "64,32", "float16", (), None, marks=pytest.mark.slow),
    ],
)
def test_every_launch_compiles_within_its_budget(tmp_path, arches, tiles, dtypes, extra, variants):
    """Each kind of launch compiles for the architecture (the interpreter would not tell) and asks
    for no more shared memory than :data:`SHARED_BUDGET` grants its tile, so
    :func:`tile_size`'s choice launches on the GPUs it is made for."""
    flags = ["--arch", arches, "--tile", tiles, "--dtype", dtypes, *extra]
    rows = _compile(tmp_path, *flags, *(("--variants", variants) if variants else ()))
    sizes = [len(flag.split(",")) for flag in (arches, tiles, dtypes)]
    kinds = len(variants.split(",")) if variants else len(VARIANTS)
    assert len(rows) == kinds * len(KERNELS) * sizes[0] * sizes[1] * sizes[2]
    assert {r["kernel"] for r in rows} == set(KERNELS)
    for r in rows:
        kind = "float32" if r["dtype"] == "float32" else "half"
        assert 0 < r["shared"] <= SHARED_BUDGET[(r["tile"], kind)], r
        assert r["warps"] == warp_count(getattr(torch, r["dtype"])), r
        if r["dtype"] == "float32" and r["spilled"] is not None:
            # At 4 warps the keys' backward kernel spilled 4.8-5.9 KB per thread (warp_count).
            assert r["spilled"] < 4096, r


@pytest.mark.parametrize(
    ("flags", "message"),
    [
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


def test_tile_size_fits_the_device():
    big, small = 228 * 1024, 99 * 1024  # H100, RTX 4090
    assert tile_size(torch.bfloat16, big) == tile_size(torch.float16, big) == 64
    assert tile_size(torch.bfloat16, small) == 32
    assert tile_size(torch.float32, big) == 32  # exact products: 64 spills registers
    assert tile_size(torch.float32, None) == tile_size(torch.bfloat16, None) == 32  # interpreter
    assert SHARED_BUDGET[(64, "half")] <= 160 * 1024  # an A100 (164 KiB) takes the large tiles
    # Past head dim 64 the need grows (273 KiB at d=256 on sm_90): an H100 takes 32×32 tiles.
    assert tile_size(torch.bfloat16, big, 48) == tile_size(torch.bfloat16, big, 64) == 64
    assert tile_size(torch.bfloat16, big, 128) == tile_size(torch.bfloat16, big, 256) == 32
    assert tile_size(torch.bfloat16, 512 * 1024, 256) == 64
    assert max(SHARED_BUDGET[(32, kind)] for kind in ("half", "float32")) <= 99 * 1024
