"""Keep freed memory in the C heap: the application's switch against page faults (glibc only).

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a request of more than
its *mmap threshold* (128 KiB at start, raised towards 32 MiB as large blocks are freed) with a
fresh ``mmap``, and hands freed memory at the top of the heap back to the kernel once more than
its *trim threshold* is free. Either way the next tensor of that size starts on pages the kernel
must map and zero on first touch: a *minor page fault* per 4 KiB page. An attention pass that
allocates many mid-sized temporaries in a loop (the ``chunked`` backend's tiles, masks and
partial outputs) keeps re-faulting the same memory. On the project's Intel Xeon box (a virtual
machine, where a fault costs a few microseconds), T5's ``chunked`` forward+backward pass at
L=2048 took about 8,500 faults per call, against 900 for plain SDPA and 70 for T5 with the heap
retained (``python benchmarks/page_faults.py``; ``docs/performance.md``, round 6, has the table and
the timings).

:func:`retain_freed_memory` raises both thresholds (``mallopt``), so that freed memory stays in
the heap and is reused without faults. The cost: the process keeps its high-water mark of heap
memory mapped instead of returning it (its peak is unchanged). It is process-wide allocator
state, so — like flush-to-zero (:mod:`relpos.denormals`) — ``relpos`` never sets it on import; the
``relpos`` command line calls it first thing (``relpos bench --default-malloc`` measures without
it), and a program of your own can call it at start-up, or set the same thresholds in the
environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``) or
preload another allocator (jemalloc, tcmalloc), as PyTorch's CPU tuning guides suggest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "retain_freed_memory"]

#: Largest request served from the heap rather than a fresh ``mmap`` (glibc's ceiling on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap kept before any is returned to the kernel.
TRIM_THRESHOLD = 1 << 30
#: Extra memory requested from the kernel whenever the heap grows.
TOP_PAD = 64 << 20

# mallopt parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def retain_freed_memory(
    *,
    mmap_threshold: int = MMAP_THRESHOLD,
    trim_threshold: int = TRIM_THRESHOLD,
    top_pad: int = TOP_PAD,
) -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse instead of unmapping it.

    Call it once, early (any time works: it changes how later requests are served).

    Args:
        mmap_threshold: requests up to this many bytes come from the heap (at most 32 MiB, glibc's
            ceiling on 64-bit systems).
        trim_threshold: bytes of free memory at the heap's top kept before returning any.
        top_pad: bytes added to every request for more heap.

    Returns:
        True if glibc accepted all three settings; False on another C library (macOS, musl,
        Windows), where nothing changes.

    Raises:
        ValueError: a negative size, or an ``mmap_threshold`` above 32 MiB.
    """
    for name, value in (
        ("mmap_threshold", mmap_threshold),
        ("trim_threshold", trim_threshold),
        ("top_pad", top_pad),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int of bytes, got {value!r}")
    if mmap_threshold > MMAP_THRESHOLD:
        raise ValueError(
            f"mmap_threshold must be at most {MMAP_THRESHOLD} bytes (glibc's ceiling), "
            f"got {mmap_threshold}"
        )
    libc = _libc()
    if libc is None:
        return False
    settings = (
        (_M_MMAP_THRESHOLD, mmap_threshold),
        (_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)),  # mallopt takes a C int
        (_M_TOP_PAD, min(top_pad, 2**31 - 1)),
    )
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
