"""Process switches for fast CPU attention: flush-to-zero, and a C heap that keeps freed memory.

Both are process-wide state, so importing ``relpos`` sets neither: the ``relpos`` command line
calls them first thing, and a program of your own may do the same at start-up.

* :func:`flush_denormals` — attention's backward pass recomputes ``P = exp(S - lse)``; where a
  logit sits 87–104 below its row's log-sum-exp, ``P`` is a float32 *denormal*, and on many x86
  CPUs every op that touches one takes a slow microcode assist. ALiBi produces such gaps on every
  row, and so does any trained model with peaked attention. Flush-to-zero changes no result beyond
  float32 rounding. It is per-thread state that threads inherit when they are created, so it must
  be set before PyTorch's intra-op thread pool starts.
* :func:`retain_freed_memory` — glibc serves large requests with fresh ``mmap``\\ s and returns
  freed memory at the heap's top to the kernel, so the next tensor of that size faults its pages in
  again. The ``chunked`` backend's many mid-sized temporaries would keep re-faulting the same
  memory; raising glibc's mmap and trim thresholds keeps it in the heap (the peak is unchanged; the
  high-water mark stays mapped). The environment (``MALLOC_MMAP_THRESHOLD_``, …) or another
  allocator (jemalloc, tcmalloc) does the same.

``docs/performance.md`` has the measurements (``benchmarks/denormals.py``,
``benchmarks/page_faults.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

import torch

__all__ = [
    "MMAP_THRESHOLD",
    "TOP_PAD",
    "TRIM_THRESHOLD",
    "bf16_instructions",
    "cpu_flags",
    "cpu_name",
    "denormals_flushed",
    "flush_denormals",
    "native_bf16",
    "retain_freed_memory",
]

# ----------------------------------------------------------------------------- flush-to-zero
# Large enough that an elementwise op is split over every intra-op thread (PyTorch's grain size
# is 32768 elements), and a product that is denormal in float32: 1e-30 * 1e-10 = 1e-40.
_PROBE_ELEMENTS = 1 << 18


def _denormal_product() -> torch.Tensor:
    """``1e-30 * 1e-10`` computed by every intra-op thread: 0 where a thread flushes."""
    return torch.full((_PROBE_ELEMENTS,), 1e-30, dtype=torch.float32) * 1e-10


def denormals_flushed() -> bool:
    """Whether float32 denormals are flushed to zero on the calling and every intra-op thread."""
    return bool(_denormal_product().eq(0).all())


def flush_denormals(enable: bool = True) -> bool:
    """Turn flush-to-zero and denormals-are-zero on (or off), on every thread or none.

    Call it first thing, before any parallel tensor op. If flushing cannot reach every thread
    (the pool already started), the calling thread is set back to keeping denormals, so that all
    threads compute alike.

    Returns:
        True if denormals are now flushed (``enable``) or kept (``not enable``) on every intra-op
        thread; False if the CPU has no such mode or the thread pool had already started.
    """
    if not torch.set_flush_denormal(enable):
        return False
    product = _denormal_product()
    if not enable:
        return bool(product.ne(0).all())
    if not bool(product.eq(0).all()):
        torch.set_flush_denormal(False)
        return False
    return True


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """``field``'s value in ``/proc/cpuinfo`` (its first line), or None (no such file or field)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` on Linux), for benchmark headers."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> list[str]:
    """The CPU's instruction-set flags from ``/proc/cpuinfo`` (empty where it has none)."""
    return (_cpuinfo("flags") or "").split()


#: x86 instruction sets that compute in bfloat16 natively (without them it is emulated, and
#: autocast to bfloat16 makes CPU training several times slower).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_instructions() -> list[str]:
    """The bfloat16 instruction sets ``/proc/cpuinfo`` lists (empty where there is none)."""
    flags = cpu_flags()
    return [name for name in BF16_FLAGS if name in flags]


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bfloat16 natively: a CUDA GPU that supports it, or a CPU with
    one of :data:`BF16_FLAGS`. The ``"auto"`` setting of training's ``autocast`` follows this."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(bf16_instructions())


# ----------------------------------------------------------------------------- the C heap
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
