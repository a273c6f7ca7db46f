"""``benchmarks/fused_tiles.py``, the GPU session's comparison of the fused kernel's tiles and
warps: here in Triton's interpreter (or on CUDA), tiny, as a check that it runs and writes its
table, not a timing."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from relpos.kernels import interpreted
from tests.helpers import benchmark_script

if not (interpreted() or torch.cuda.is_available()):
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)


def test_every_candidate_is_timed_against_sdpa(tmp_path):
    argv = ["--out", str(tmp_path), "--lengths", "24", "--tokens", "48", "--schemes", "t5,shaw"]
    # +keyed runs for Shaw's keys, not for T5's table.
    argv += ["--configs", "32x4,16x2+one+lut,32x16w2/16x32w4s2/16x16w4+unmasked,16x4+auto+keyed"]
    argv += ["--heads", "2", "--head-dim", "16"]
    argv += ["--repeats", "1"]
    argv += ["--warmup", "0"]
    assert benchmark_script("fused_tiles").main(argv) == 0
    rows = json.loads((tmp_path / "tiles.json").read_text())
    got = [(r["scheme"], r["launch"], r["one_row"], r["lut_only"], r["unmasked"]) for r in rows]
    per_kernel = "32x16w2/16x32w4s2/16x16w4"
    assert got == [
        ("t5", "32x4", False, False, False),
        ("t5", "16x2", True, True, False),
        ("t5", per_kernel, False, False, True),
        ("shaw", "32x4", False, False, False),
        ("shaw", "16x2", True, True, False),
        ("shaw", per_kernel, False, False, True),
        ("shaw", "16x4", None, False, None),
    ]
    assert [r["keyed"] for r in rows] == [False] * 6 + [True]
    assert {r["batch"] for r in rows} == {2}
    assert all("error" not in r for r in rows), rows
    assert all(r[key] > 0 for r in rows for key in ("ratio", "ms", "forward_ratio", "forward_ms"))
    table = (tmp_path / "tiles.md").read_text()
    assert "benchmarks/fused_tiles.py --out" in table
    assert "| shaw | 24 | 2 | 16x2 one-row lut-only |" in table
    assert f"| t5 | 24 | 2 | {per_kernel} unmasked |" in table
    assert "| shaw | 24 | 2 | 16x4 keyed auto |" in table


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--configs", "48x4"], "tile must be 16, 32, 64 or 128"),
        (["--configs", "64"], "TILExWARPS or FORWARD/KEYS/QUERIES"),
        (["--configs", "64x4+two"], "[+one][+lut][+unmasked]"),
        (["--configs", "64x4+auto+one"], "or [+auto][+lut]"),
        (["--configs", "64x64w4/64x64w4"], "launches are FORWARD/KEYS/QUERIES"),
        (["--configs", "64x64w4/64x64w3/64x64w4"], "keys: warps must be 1, 2, 4, 8 or 16"),
        (["--schemes", "fire"], "does not run fire"),
        (["--schemes", "bogus"], "unknown scheme"),
    ],
)
def test_bad_candidates_and_schemes_are_refused(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        benchmark_script("fused_tiles").main(["--out", str(tmp_path / "out"), *flags])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
