"""Flush float32 denormals to zero on every intra-op thread: the application's switch.

Attention's backward pass recomputes ``P = exp(S - lse)``. Wherever a logit sits 87 to 104 below
its row's log-sum-exp, ``P`` is a *denormal* float32 (``1.4e-45 <= P < 1.2e-38``), and on many
x86 CPUs every arithmetic op that touches a denormal takes a microcode assist costing around a
hundred cycles. Random ``q, k`` never produce such gaps; ALiBi's ``-slope·|i - j|`` produces them
on every row (a slope of 1/2 crosses the window 174–208 tokens back), and so does any trained
model with peaked attention. PyTorch's fused CPU attention backward then runs many times slower:
on the project's Intel Xeon box, a ``(1, 8, 256, 64)`` × 2048-key backward with half its
probabilities denormal took 540 ms instead of 17 ms, and ALiBi's forward+backward pass through
the ``chunked`` backend ran at 4.9× plain attention instead of 1.3× (``python
benchmarks/denormals.py``; ``docs/performance.md``, round 4). The forward kernel is not
affected, and the CPU of the project's earlier benchmark rounds showed no such penalty.

The cure is the CPU's flush-to-zero / denormals-are-zero mode, which TensorFlow turns on by
default and PyTorch leaves off: ``torch.set_flush_denormal(True)``. It changes no result beyond
float32 rounding (a probability below 1.2e-38 becomes exactly 0). Two catches:

* it is per-thread state, and ``torch.set_flush_denormal`` sets the calling thread only; threads
  inherit it when they are created, so it must run **before PyTorch's intra-op thread pool
  starts** (the first parallel op), or the pool's workers keep computing with denormals;
* it is process-wide floating-point state, so a library must not flip it behind its user's back.

So ``relpos`` never sets it on import; the ``relpos`` command line calls :func:`flush_denormals`
first thing (``relpos bench --keep-denormals`` measures without it), and a program of your own can
do the same at start-up. :func:`denormals_flushed` checks what every thread actually does.
"""

from __future__ import annotations

import platform

import torch

__all__ = ["cpu_name", "denormals_flushed", "flush_denormals"]

# Large enough that an elementwise op is split over every intra-op thread (PyTorch's grain size
# is 32768 elements), and a product that is denormal in float32: 1e-30 * 1e-10 = 1e-40.
_PROBE_ELEMENTS = 1 << 18


def _denormal_product() -> torch.Tensor:
    """``1e-30 * 1e-10`` computed by every intra-op thread: 0 where a thread flushes."""
    return torch.full((_PROBE_ELEMENTS,), 1e-30, dtype=torch.float32) * 1e-10


def denormals_flushed() -> bool:
    """Whether float32 denormals are flushed to zero on the calling thread and on every intra-op
    thread: computes a denormal product over all threads and checks that every element is 0."""
    return bool(_denormal_product().eq(0).all())


def flush_denormals(enable: bool = True) -> bool:
    """Turn flush-to-zero and denormals-are-zero on (or off) and report whether every thread now
    follows it.

    Call it first thing in a program, before any parallel tensor op, so that the intra-op threads
    are created with the mode (they inherit it; a pool that already exists keeps the old mode).

    All or nothing: if flushing cannot reach every thread, the calling thread is set back to
    keeping denormals (PyTorch's default), so that all threads compute alike.

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


def cpu_name() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` on Linux), for benchmark headers."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
