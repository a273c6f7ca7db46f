"""Where a GPU step's time goes: the device's busy time per kernel and the host's time to issue
the step, apart from the wall clock (``relpos bench``, ``benchmarks/fused_tiles.py``).

A step timed by the wall clock with a synchronisation after it (:func:`.bench.wall_times`) costs
the host's time to issue it plus whatever the device does after the host is done. Where the host
is the slower of the two (many small launches, Python between them), that hides how fast the
kernels are; in a training loop, where steps are issued back to back, it is the host that bounds
the step. So on CUDA the bench also reports:

* **device time**: what the profiler's device events (kernels, copies, memsets) add up to per
  step, whatever the host costs: the kernels' own speed, the figure the arithmetic floor is
  about;
* **host time**: the host's time to issue one step with the device idle at its start (the median
  over runs): a step issued back to back with others takes at least this long.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

__all__ = ["PROFILED_RUNS", "Split", "device_split", "device_times", "host_times",
           "sum_device_events", "wait_for_device"]  # fmt: skip

#: The most runs :func:`device_split` profiles (the device time of a kernel varies little).
PROFILED_RUNS = 5


def wait_for_device(device: str) -> None:
    """Wait until ``device`` has run what was issued to it (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def host_times(fn: Callable[[], object], *, repeats: int, device: str) -> list[float]:
    """Seconds the host takes to return from each of ``repeats`` calls of ``fn``, each started with
    the device idle (after one warm-up call): the time to issue the call's work, not to finish it
    (on a CPU the two are the same)."""
    fn()
    times = []
    for _ in range(repeats):
        wait_for_device(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    wait_for_device(device)
    return times


def sum_device_events(events: Iterable[Any]) -> Counter:
    """Microseconds per name of the device events among a profiler's ``events()`` (kernels,
    copies, memsets: those whose ``device_type`` is not the CPU's; ranges a user annotated are
    left out, as they span the kernels they name)."""
    cpu = torch.autograd.DeviceType.CPU
    total: Counter = Counter()
    for e in events:
        if e.device_type != cpu and not getattr(e, "is_user_annotation", False):
            total[e.name] += e.device_time_total
    return total


def device_times(
    fn: Callable[[], object], *, repeats: int, device: str
) -> tuple[float, dict[str, float]]:
    """``(seconds, {name: seconds})`` per call of ``fn``: the device's busy time over ``repeats``
    calls (after one warm-up call) from the profiler's device events, in all and per kernel (or
    copy) name, largest first.

    Raises:
        ValueError: ``device`` is not a CUDA device (a CPU's busy time is the wall clock).
    """
    if not device.startswith("cuda"):
        raise ValueError(f"device_times needs a CUDA device, got device={device!r}")
    from torch.profiler import ProfilerActivity, profile

    fn()
    wait_for_device(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        wait_for_device(device)
    per_name = sum_device_events(prof.events())
    kernels = {name: us / repeats / 1e6 for name, us in per_name.most_common()}
    return sum(kernels.values()), kernels


class Split(NamedTuple):
    """Seconds per call: the device's busy time (and per kernel), the baseline's, and the host's
    time to issue one call (the median)."""

    device: float
    base: float
    host: float
    kernels: dict[str, float]


def device_split(
    fn: Callable[[], object], base: Callable[[], object], *, repeats: int, device: str
) -> Split:
    """:func:`device_times` of ``fn`` and of the baseline ``base``, and :func:`host_times` of
    ``fn``, each over ``min(repeats, PROFILED_RUNS)`` calls."""
    runs = min(repeats, PROFILED_RUNS)
    seconds, kernels = device_times(fn, repeats=runs, device=device)
    base_seconds, _ = device_times(base, repeats=runs, device=device)
    host = statistics.median(host_times(fn, repeats=runs, device=device))
    return Split(seconds, base_seconds, host, kernels)
