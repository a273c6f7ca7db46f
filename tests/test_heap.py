"""Keeping freed memory in the C heap (relpos.runtime), and that the command line does it.

Allocator settings are process-wide, so each measurement runs in a fresh process.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

import relpos.cli.commands
import relpos.runtime
from relpos.runtime import MMAP_THRESHOLD, retain_freed_memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Run in a fresh process: `mode` "retain" calls retain_freed_memory() first, "default" leaves
# glibc as it starts. The script after it reports the heap through glibc's own counters, which
# depend only on the sizes requested and the settings in force, never on timing or load:
# mallinfo's `arena` (heap bytes got from the kernel) and `hblks` (blocks given their own mmap),
# and malloc_stats's "max mmap regions" (the most such blocks ever alive at once).
_PRELUDE = r"""
import ctypes, json, os, re, sys, tempfile
from relpos.runtime import _libc, retain_freed_memory
ok = retain_freed_memory() if sys.argv[1] == "retain" else None
libc = _libc()
new = hasattr(libc, "mallinfo2")  # glibc >= 2.33; older ones have the int-sized mallinfo
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t if new else ctypes.c_int) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]
mallinfo = libc.mallinfo2 if new else libc.mallinfo
mallinfo.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def max_mmaps():
    with tempfile.TemporaryFile() as f:  # malloc_stats prints to the C stderr
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            libc.malloc_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return int(re.search(rb"max mmap regions\s*=\s*(\d+)", f.read()).group(1))
"""

# Eight 25 MiB blocks: above glibc's default mmap threshold (128 KiB), and freed together more
# than any trim threshold glibc sets by itself (at most 64 MiB).
_BLOCKS = """
blocks, size = 8, 25 << 20
before = mallinfo()
held = [libc.malloc(size) for _ in range(blocks)]
during = mallinfo()
for p in reversed(held):
    libc.free(p)
after = mallinfo()
print(json.dumps({"ok": ok, "arena": [before.arena, during.arena, after.arena],
                  "hblks": [before.hblks, during.hblks, after.hblks]}))
"""

# The chunked backend's T5 band: many mid-sized temporaries per call. One intra-op thread, so
# that every allocation comes from the main heap in the same order on every run.
_ATTENTION = """
import torch
torch.set_num_threads(1)
import relpos
from relpos.attention.chunked import chunked_attention
torch.manual_seed(0)
scheme = relpos.make_scheme("t5", d_model=256, num_heads=4, causal=True)
q, k, v = (torch.randn(1, 4, 1024, 64) for _ in range(3))
pos = relpos.Positions.from_length(1024)
start, arena = max_mmaps(), [mallinfo().arena]
for _ in range(6):
    with torch.no_grad():
        chunked_attention(q, k, v, scheme, pos, pos, causal=True)
    arena.append(mallinfo().arena)
print(json.dumps({"ok": ok, "max_mmaps": [start, max_mmaps()], "arena": arena}))
"""


def _probe(script: str, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + script, mode],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_retained_heap_serves_large_blocks_and_keeps_them_when_freed():
    kept = _probe(_BLOCKS, "retain")
    assert kept["ok"] is True
    (_, a1, a2), (h0, h1, _) = kept["arena"], kept["hblks"]
    assert h1 == h0, f"blocks under 32 MiB were given their own mmap, not heap: {kept}"
    assert a2 >= a1, f"freeing them gave heap memory back to the kernel: {kept}"


@glibc
def test_glibc_defaults_map_or_return_the_same_blocks():
    # The contrast that makes the test above mean something: untouched, glibc either gives each
    # block its own mmap, or (had it raised its thresholds on its own) trims the heap on free.
    default = _probe(_BLOCKS, "default")
    assert default["ok"] is None
    (_, a1, a2), (h0, h1, _) = default["arena"], default["hblks"]
    assert h1 > h0 or a2 < a1, default


@glibc
def test_repeated_attention_calls_reuse_the_retained_heap():
    kept = _probe(_ATTENTION, "retain")
    assert kept["ok"] is True
    # No temporary was given its own mmap (glibc's defaults map the first call's): every one
    # came from the heap...
    assert kept["max_mmaps"][0] == kept["max_mmaps"][1], kept
    # ...which holds what the first call needed for the later calls: it never shrinks, and
    # later calls grow it by at most 5% (not at all in practice).
    _, first, *later = kept["arena"]
    assert min(later) >= first, f"the heap shrank between calls: {kept}"
    assert max(later) <= 1.05 * first, f"later calls kept growing the heap: {kept}"


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
    monkeypatch.setattr(relpos.runtime, "_libc", lambda: None)
    assert retain_freed_memory() is False


def test_the_command_line_retains_the_heap_before_running_a_command(monkeypatch, capsys):
    cli = relpos.cli.commands
    calls = []
    monkeypatch.setattr(cli, "flush_denormals", lambda: calls.append("flush"))
    monkeypatch.setattr(cli, "retain_freed_memory", lambda: calls.append("heap"))
    assert cli.main(["eval", "--run-dir", "/nonexistent/run"]) == 2  # fails after them
    assert calls == ["flush", "heap"]
    assert "error" in capsys.readouterr().err
