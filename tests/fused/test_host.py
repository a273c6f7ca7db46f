"""What the host does around the ``fused`` kernels: no device sync in self-attention (a sync
stalls the host until the GPU drains, so a training loop can no longer issue work ahead of it),
and the output and gradients handed over in the inputs' dtype. Checked with the kernels recorded,
not run (``relative_attention.recorded_launches``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import relpos
from relpos.attention.fused import fused_attention
from relpos.kernels import interpreted
from relpos.kernels.relative_attention import recorded_launches
from relpos.positions import Positions, distance_range
from relpos.schemes.base import RelativeScheme
from tests.helpers import SyncCalls, benchmark_script, fused_device, nonfinite_gpu_path

DEVICE = fused_device()

SHAW = {"name": "shaw", "max_distance": 4}
SCHEMES = [
    "alibi", "learned_alibi", "kerple", "sandwich", "dpb", "t5", SHAW,
    {"name": "music", "max_distance": 20}, "transformer_xl", "deberta",
]  # fmt: skip


def _self_attention_positions() -> dict[str, Positions]:
    """Self-attention's positions in training, by kind: one sequence per row, padded rows (left
    and right), packed documents."""
    left = torch.tensor([[False] * 3 + [True] * 37, [True] * 40])
    packed = torch.tensor([[0] * 15 + [1] * 25, [0] * 38 + [-1] * 2])
    return {
        "plain": Positions.from_length(40, device=DEVICE),
        "padded": Positions.from_padding_mask(left.to(DEVICE)),
        "packed": Positions.from_segments(packed.to(DEVICE)),
    }


@pytest.mark.parametrize("spec", SCHEMES, ids=str)
def test_self_attention_issues_no_device_sync(spec, monkeypatch):
    """One forward+backward pass per scheme over plain, padded and packed positions (training's
    cases) calls none of the methods that read a device value on the host (``item``,
    ``tolist``, ``bool``, ...). The non-finite check runs its GPU path (on a CPU it takes a
    cheaper one with a sync)."""
    monkeypatch.setattr(relpos.attention.fused, "propagate_nonfinite", nonfinite_gpu_path)
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=2, causal=True).to(DEVICE)
    q, k, v = (torch.randn(2, 2, 40, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    for kind, p in _self_attention_positions().items():
        with recorded_launches(), SyncCalls() as syncs:
            out = fused_attention(q, k, v, scheme, p, p, causal=True)
            out.backward(torch.ones_like(out))
        assert syncs.calls == [], kind
    # Queries and keys of two positions (a KV cache's) promise no range: a clipped table takes
    # its clip's whole, and a table of every distance (Sandwich's, DPB's, DeBERTa's) reads the
    # range from the values, the one sync due (a closed form, ALiBi's or KERPLE's, reads no
    # table).
    keys = Positions.from_padding_mask(torch.tensor([[False] * 3 + [True] * 37] * 2, device=DEVICE))
    queries = keys[30:]
    with recorded_launches(), SyncCalls() as syncs:
        fused_attention(q[:, :, 30:].detach(), k.detach(), v.detach(), scheme, queries, keys,
                        causal=True)  # fmt: skip
    clipped = isinstance(scheme, RelativeScheme) and scheme.distance_clip is not None
    closed = spec in ("alibi", "learned_alibi", "kerple")
    assert syncs.calls == ([] if clipped or closed else ["tolist"])


def test_distance_range_of_self_attention_reads_no_value():
    """Self-attention's range comes from the positions' promises (the span, contiguity) with
    nothing read from the device, and holds the range the values give."""
    cases = [Positions.from_length(n, offset=offset) for n, offset in [(1, 0), (7, 0), (7, 5)]]
    cases += _self_attention_positions().values()
    for p in cases:
        with SyncCalls() as syncs:
            lo, hi = distance_range(p, p)
        assert (lo, hi) == (-p.span, p.span) and syncs.calls == []
        copy = Positions(p.pos.clone(), p.seg.clone())  # the same values, no promise
        with SyncCalls() as syncs:
            got = distance_range(copy, copy)
        assert syncs.calls == ["tolist"]
        assert lo <= got[0] and got[1] <= hi
        contiguous = Positions(p.pos, p.seg, contiguous=p.contiguous)  # no span: from the length
        if p.contiguous:
            assert distance_range(contiguous, contiguous) == (lo, hi)


@pytest.mark.parametrize(("spec", "mass"), [("alibi", False), (SHAW, True)])
def test_output_and_gradients_come_in_the_inputs_dtype(spec, mass):
    """bf16 inputs: the kernels write ``out`` in bf16 (float32 where a value term is added to it)
    and ``d q``, ``d k``, ``d v`` in bf16: no float32 copy to convert after them."""
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=2, causal=True).to(DEVICE)
    q, k, v = (
        torch.randn(1, 2, 16, 16, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
        for _ in "qkv"
    )
    p = Positions.from_length(16, device=DEVICE)
    with recorded_launches() as runs:
        out = fused_attention(q, k, v, scheme, p, p, causal=True)
        out.backward(torch.ones_like(out))
    forward, queries, keys = runs
    assert forward.args[forward.kernel.arg_names.index("OUT")].dtype == (
        torch.float32 if mass else torch.bfloat16
    )
    assert queries.args[queries.kernel.arg_names.index("DQ")].dtype == torch.bfloat16
    for name in ("DK", "DV"):
        assert keys.args[keys.kernel.arg_names.index(name)].dtype == torch.bfloat16


@pytest.mark.skipif(not interpreted(), reason="the script counts on a CPU, in the interpreter")
def test_host_ops_counts_each_scheme_s_ops_and_launches(capsys):
    """``benchmarks/host_ops.py``: a row per scheme, its ops (the non-finite check's GPU path
    included) in a step's first layer and in each later one (fewer over padding: what the
    positions derive is kept), and the pass's three kernel launches."""
    module = benchmark_script("host_ops")
    argv = ["--schemes", "alibi,kerple", "--layout", "padded", "--by-site", "--repeats", "2"]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith("plain SDPA's pass") and lines[1].endswith(" ms")
    rows = {line.split("|")[1].strip(): line.split("|")[2:6] for line in lines[4:6]}
    assert set(rows) == {"alibi", "kerple"}
    for first, later, launches, host in rows.values():
        assert int(first) > int(later) > 0 and int(launches) == 3
        assert float(host.split()[0]) > 0 and host.strip().endswith(")")
    assert "linalg_vector_norm contract.py" in out  # the check's GPU path, by site


def test_an_eager_call_enters_the_op_below_autograd(monkeypatch):
    """Outside ``torch.compile`` the forward op runs below autograd (``_FlashCall``), where
    PyTorch does not fill in its arguments' defaults, a cost quadratic in their number (most of
    the op's host time); the op's own registered autograd is what ``torch.compile`` takes
    (``test_torch_compile.py``)."""
    from torch._library import autograd as library_autograd

    filled = []

    def fill_defaults(schema, args, kwargs):
        filled.append(schema.name)
        return fill(schema, args, kwargs)

    fill = library_autograd.utils.fill_defaults
    monkeypatch.setattr(library_autograd.utils, "fill_defaults", fill_defaults)
    scheme = relpos.make_scheme("learned_alibi", d_model=32, num_heads=2, causal=True).to(DEVICE)
    q, k, v = (torch.randn(1, 2, 16, 16, device=DEVICE, requires_grad=True) for _ in "qkv")
    p = Positions.from_length(16, device=DEVICE)
    with recorded_launches() as runs:
        out = fused_attention(q, k, v, scheme, p, p, causal=True)
        out.backward(torch.ones_like(out))
    assert len(runs) == 3 and filled == []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the op with its autograd
    with recorded_launches():
        fused_attention(q, k, v, scheme, p, p, causal=True)
    assert filled == ["relpos::relative_flash_forward"]
