"""Flush-to-zero for float32 denormals (relpos.runtime), and that the command line sets it.

The mode is per-thread state inherited at thread creation, so each case runs in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import relpos.cli.commands
from relpos.runtime import cpu_name

if not torch.set_flush_denormal(False):  # (False: leave this process as PyTorch's default)
    pytest.skip("this CPU has no flush-to-zero mode", allow_module_level=True)


def run_fresh(body: str) -> dict:
    """Run ``body`` in a new Python process with two intra-op threads; it prints a JSON dict."""
    code = "import json, torch\ntorch.set_num_threads(2)\nfrom relpos.runtime import *\n" + body
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_flushing_before_the_thread_pool_starts_reaches_every_thread():
    got = run_fresh("before = denormals_flushed()\nprint(json.dumps({'before': before}))\n")
    assert got == {"before": False}  # PyTorch's default: denormals kept
    got = run_fresh(
        "ok = flush_denormals()\n"
        "x = bool((torch.full((1 << 18,), 1e-30) * 1e-10).eq(0).all())\n"
        "print(json.dumps({'ok': ok, 'flushed': denormals_flushed(), 'zeros': x}))"
    )
    assert got == {"ok": True, "flushed": True, "zeros": True}


def test_flushing_after_the_pool_started_reports_failure_and_changes_nothing():
    got = run_fresh(
        "denormals_flushed()  # a parallel op: the pool now exists, keeping denormals\n"
        "ok = flush_denormals()\n"
        "main_thread = (torch.tensor([1e-30]) * 1e-10).item()\n"
        "print(json.dumps({'ok': ok, 'main_thread_keeps': main_thread != 0.0}))"
    )
    assert got == {"ok": False, "main_thread_keeps": True}


def test_keeping_denormals_again():
    got = run_fresh(
        "flush_denormals()\n"
        "ok = flush_denormals(False)\n"
        "print(json.dumps({'ok': ok, 'flushed': denormals_flushed()}))"
    )
    # Only the calling thread goes back: the pool's workers were created flushing.
    assert got == {"ok": False, "flushed": False}


def test_the_command_line_flushes_before_running_a_command(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(relpos.cli.commands, "flush_denormals", lambda: calls.append("flush"))
    # fails after it:
    assert relpos.cli.commands.main(["eval", "--run-dir", "/nonexistent/run"]) == 2
    assert calls == ["flush"]
    assert "error" in capsys.readouterr().err


def test_bench_header_names_the_cpu_the_denormal_mode_and_the_allocator_mode(tmp_path):
    from relpos.cli import bench

    argv = ["--lengths", "32", "--schemes", "alibi", "--impls", "chunked", "--repeats", "5"]
    argv += ["--warmup", "1", "--no-memory", "--no-plot", "--keep-denormals", "--default-malloc"]
    argv += ["--out", str(tmp_path)]
    assert bench.main(argv) == 0
    header = (tmp_path / "bench.md").read_text().splitlines()[0]
    assert cpu_name() in header and "denormals kept" in header and "default malloc" in header
