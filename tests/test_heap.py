"""Keeping freed memory in the C heap (relpos.heap), and that the command line does it.

Allocator settings are process-wide, so each measurement runs in a fresh process.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

import relpos.cli
from relpos.heap import MMAP_THRESHOLD, retain_freed_memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# The chunked backend's T5 band: many mid-sized temporaries per call. Prints the minor page faults
# per call after warm-up.
_FAULTS = """
import json, resource, sys, torch
torch.set_num_threads(2)
from relpos.heap import retain_freed_memory
ok = retain_freed_memory() if sys.argv[1] == "retain" else None
import relpos
from relpos.attention.chunked import chunked_attention
torch.manual_seed(0)
scheme = relpos.make_scheme("t5", d_model=256, num_heads=4, causal=True)
q, k, v = (torch.randn(1, 4, 1024, 64) for _ in range(3))
pos = relpos.Positions.from_length(1024)
def step():
    with torch.no_grad():
        chunked_attention(q, k, v, scheme, pos, pos, causal=True)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
print(json.dumps({"ok": ok, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_retained_heap_serves_repeated_calls_with_few_page_faults():
    kept, default = _faults("retain"), _faults("default")
    assert kept["ok"] is True and default["ok"] is None
    if default["faults"] < 50:
        pytest.skip(f"this glibc already reuses the memory of this workload: {default}")
    # A call touches megabytes of temporaries. Under glibc's defaults they fault their pages in
    # anew on every call (about 600 faults per call on the project's box); retained, they are
    # reused (0 in most runs; up to about 90 when the worker thread's arena regrows).
    assert kept["faults"] < 0.25 * default["faults"], (kept, default)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mmap_threshold": MMAP_THRESHOLD + 1}, "at most"),
        ({"trim_threshold": -1}, "trim_threshold"),
        ({"top_pad": 1.5}, "top_pad"),
        ({"mmap_threshold": True}, "mmap_threshold"),
    ],
)
def test_bad_settings_raise_before_touching_the_allocator(kwargs, match):
    with pytest.raises(ValueError, match=match):
        retain_freed_memory(**kwargs)


def test_other_c_libraries_change_nothing(monkeypatch):
    monkeypatch.setattr(relpos.heap, "_libc", lambda: None)
    assert retain_freed_memory() is False


def test_the_command_line_retains_the_heap_before_running_a_command(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(relpos.cli, "flush_denormals", lambda: calls.append("flush"))
    monkeypatch.setattr(relpos.cli, "retain_freed_memory", lambda: calls.append("heap"))
    assert relpos.cli.main(["eval", "--run-dir", "/nonexistent/run"]) == 2  # fails after them
    assert calls == ["flush", "heap"]
    assert "error" in capsys.readouterr().err
