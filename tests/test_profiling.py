"""The bench's split of a GPU pass's time into device and host time (``relpos.cli.profiling``):
what can be checked without a GPU (the sums, the reports, a profiler that fails)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from relpos.cli import bench, profiling

CUDA = torch.autograd.DeviceType.CUDA
CPU = torch.autograd.DeviceType.CPU


def _event(name, device_type, us, annotation=False):
    return SimpleNamespace(
        name=name, device_type=device_type, device_time_total=us, is_user_annotation=annotation
    )


def test_device_events_are_summed_per_name_without_the_cpu_ops_or_annotations():
    events = [
        _event("aten::mm", CPU, 500),  # a CPU op: its kernels are counted as their own events
        _event("gemm_kernel", CUDA, 40),
        _event("gemm_kernel", CUDA, 60),
        _event("Memset (Device)", CUDA, 3),
        _event("ProfilerStep#1", CUDA, 1000, annotation=True),  # spans the kernels: not added
    ]
    total = profiling.sum_device_events(events)
    assert total == {"gemm_kernel": 100, "Memset (Device)": 3}
    assert total.most_common(1) == [("gemm_kernel", 100)]


def test_device_times_refuses_a_cpu_and_host_times_times_each_call():
    with pytest.raises(ValueError, match="device_times needs a CUDA device, got device='cpu'"):
        profiling.device_times(lambda: None, repeats=2, device="cpu")
    calls = []
    times = profiling.host_times(lambda: calls.append(1), repeats=3, device="cpu")
    assert len(times) == 3 and len(calls) == 4 and all(t >= 0 for t in times)  # one warm-up


def _result(impl, device_ms=None, ratio=None, kernels=None):
    r = bench.Result(bench.Config("alibi", impl, 4096, 4, True), fwd_ms=0.25, fwdbwd_ms=2.7)
    r.fwd_ratio = r.fwdbwd_ratio = 3.0
    if device_ms is not None:
        r.fwdbwd_device_ms, r.fwdbwd_device_ratio, r.fwdbwd_host_ms = device_ms, ratio, 1.9
        r.kernels = kernels or {}
    return r


def test_the_tables_show_device_and_host_times_only_where_profiled(tmp_path):
    plain = bench.render_markdown([_result("fused")], "header")
    assert "device ms" not in plain and "| 0.250 | 3.00 | 2.70 | 3.00 |" in plain
    kernels = {f"k{n}": 1.0 / (n + 1) for n in range(bench.TOP_KERNELS + 2)}
    rows = [_result("fused", 1.2, 1.4, kernels), _result("flex")]
    table = bench.render_markdown(rows, "header")
    header, rule, *body = table.splitlines()[2:]
    assert header.count("|") == rule.count("|") == body[0].count("|") == body[1].count("|")
    assert "| 1.20 | 1.40 | 1.90 |" in body[0] and "| – | – | – |" in body[1]
    listed = bench.render_kernels(rows, "header")
    assert "`k0` 1.00" in listed and "`k5` 0.167" in listed and "2 others 0.268" in listed
    assert "flex" not in listed  # not profiled
    bench.write_outputs(rows, tmp_path, "header", plot=False)
    assert (tmp_path / "kernels.md").read_text() == listed
    bench.write_outputs([_result("fused")], tmp_path, "header", plot=False)
    assert not (tmp_path / "kernels.md").exists()  # it was of the earlier results


def test_a_profiler_that_fails_is_logged_and_the_wall_clock_figures_stand(monkeypatch):
    def broken(fn, *, repeats, device):
        raise RuntimeError("CUPTI could not be\ninitialised")

    monkeypatch.setattr(profiling, "device_times", broken)
    res, logged = _result("fused"), []
    args = argparse.Namespace(repeats=5, device="cuda")
    bench._profile(res, lambda s: s, None, lambda s: s, None, args, logged.append)
    assert res.fwdbwd_device_ms is None and res.fwdbwd_ms == 2.7 and not res.kernels
    assert logged == ["  (device profile failed: RuntimeError: CUPTI could not be initialised)"]


def test_the_profile_fills_device_host_and_kernels(monkeypatch):
    seconds = {"fused": (0.003, {"_forward_kernel": 0.002, "copy": 0.001}), "plain": (0.002, {})}
    monkeypatch.setattr(
        profiling, "device_times", lambda fn, *, repeats, device: seconds[fn.args[0].__name__]
    )
    host = [0.004, 0.001, 0.002]
    monkeypatch.setattr(profiling, "host_times", lambda fn, *, repeats, device: host)

    def fused(s):
        return s

    def plain(s):
        return s

    res = _result("fused")
    bench._profile(res, fused, None, plain, None, argparse.Namespace(repeats=5, device="cuda"), [])
    assert res.fwdbwd_device_ms == pytest.approx(3.0) and res.fwdbwd_device_ratio == 1.5
    assert res.fwdbwd_host_ms == pytest.approx(2.0)  # the median
    assert res.kernels == pytest.approx({"_forward_kernel": 2.0, "copy": 1.0})


def test_device_events_are_read_from_a_real_profile():
    """The attributes read of each event exist on the profiler's own events (here a CPU-only
    profile: no device event, nothing summed)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(8, 8) @ torch.randn(8, 8)
    events = prof.events()
    assert any(e.name == "aten::mm" for e in events)
    assert profiling.sum_device_events(events) == {}
