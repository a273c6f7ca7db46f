"""The ``fused`` backend under ``torch.compile``: the kernels are two PyTorch operators
(``relpos::relative_flash_forward`` and ``…_backward``, with their shapes and autograd
registered), so a compiled model takes them whole, in one graph with no break, over plain, padded
and packed positions, and gets the numbers and gradients of the uncompiled call. Run with
AOTAutograd's graphs executed eagerly (``backend="aot_eager"``: Inductor's CPU code is not what
is checked here)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import relpos
from relpos.attention.fused import fused_attention
from relpos.kernels import relative_attention as ra
from relpos.positions import Positions
from tests.helpers import benchmark_script, fused_device

DEVICE = fused_device()

SCHEMES = [
    "alibi", "learned_alibi", "kerple", "t5", {"name": "shaw", "max_distance": 4},
    {"name": "music", "max_distance": 20}, "transformer_xl", "deberta",
]  # fmt: skip


def _positions(kind: str, n: int) -> Positions:
    if kind == "plain":
        return Positions.from_length(n, device=DEVICE)
    if kind == "padded":  # three tokens of left padding, then a full row
        mask = torch.arange(n).expand(2, n) >= torch.tensor([[3], [0]])
        return Positions.from_padding_mask(mask.to(DEVICE))
    documents = [[0] * 5 + [1] * (n - 5), [0] * (n - 2) + [-1] * 2]  # two, then one and padding
    return Positions.from_segments(torch.tensor(documents, device=DEVICE))


def _grads(scheme, *tensors) -> list:
    out = [t.grad for t in tensors] + [p.grad for p in scheme.parameters()]
    for t in (*tensors, *scheme.parameters()):
        t.grad = None
    return out


KINDS = ["plain", "padded", "packed"]
#: Each scheme with one layout in turn by default, every other pair in the slow run.
CASES = [
    pytest.param(spec, kind, marks=() if n % 3 == KINDS.index(kind) else pytest.mark.slow)
    for n, spec in enumerate(SCHEMES)
    for kind in KINDS
]


@pytest.mark.parametrize(("spec", "kind"), CASES, ids=str)
def test_compiled_fullgraph_equals_the_call(spec, kind):
    """``torch.compile(fullgraph=True)`` over a forward+backward pass: no graph break, and the
    output and every gradient (inputs and the scheme's parameters) of the uncompiled call."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=2, causal=True).to(DEVICE)
    q, k, v = (torch.randn(2, 2, 12, 16, device=DEVICE, requires_grad=True) for _ in "qkv")
    p = _positions(kind, 12)

    def attend(q, k, v):
        return fused_attention(q, k, v, scheme, p, p, causal=True)

    want = attend(q, k, v)
    want.backward(torch.ones_like(want))
    want_grads = _grads(scheme, q, k, v)
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    got.backward(torch.ones_like(got))
    torch.testing.assert_close(got, want)
    for g, w in zip(_grads(scheme, q, k, v), want_grads, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "spec", ["learned_alibi", "t5", {"name": "shaw", "max_distance": 4}, "deberta"], ids=str
)
def test_the_operators_pass_opcheck(spec, monkeypatch):
    """``torch.library.opcheck`` on both operators as a padded call hands them their arguments:
    the schema (no input mutated or aliased), the shapes of the fake tensors, the autograd
    registration and AOTAutograd's graphs with dynamic shapes."""
    calls = {}

    def recording(name):
        op = getattr(ra, name)

        def call(*args, **kwargs):
            calls[name] = (args, kwargs)
            return op(*args, **kwargs)

        monkeypatch.setattr(ra, name, call)

    recording("_forward_op")
    recording("_backward_op")
    torch.manual_seed(0)
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=2, causal=True).to(DEVICE)
    q, k, v = (torch.randn(2, 2, 12, 16, device=DEVICE, requires_grad=True) for _ in "qkv")
    p = _positions("padded", 12)
    out = fused_attention(q, k, v, scheme, p, p, causal=True)
    out.backward(torch.ones_like(out))
    for name, op in [
        ("_forward_op", torch.ops.relpos.relative_flash_forward.default),
        ("_backward_op", torch.ops.relpos.relative_flash_backward.default),
    ]:
        args, kwargs = calls[name]
        args = [_leaf(a) for a in args]  # rel, relk: off their graph (opcheck runs backward)
        torch.library.opcheck(op, args, kwargs)


def _leaf(t):
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().requires_grad_(t.requires_grad and t.dtype.is_floating_point)


def test_a_compiled_call_draws_a_new_dropout_mask_each_time():
    """The dropout seed is a tensor drawn inside the graph, not a number fixed into it: two
    compiled calls drop different entries, and each draws what the uncompiled call draws from
    the same generator state."""
    torch._dynamo.reset()
    scheme = relpos.make_scheme("alibi", d_model=32, num_heads=2, causal=True).to(DEVICE)
    q, k, v = (torch.randn(1, 2, 12, 16, device=DEVICE) for _ in "qkv")
    p = Positions.from_length(12, device=DEVICE)

    def attend(q, k, v):
        return fused_attention(q, k, v, scheme, p, p, causal=True, dropout_p=0.5, training=True)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    first, second = compiled(q, k, v), compiled(q, k, v)
    assert not torch.equal(first, second)
    torch.manual_seed(1)
    torch.testing.assert_close(first, attend(q, k, v))
    torch.testing.assert_close(second, attend(q, k, v))


def test_compiled_step_checks_each_mode_then_times_it(tmp_path, capsys):
    """``benchmarks/compiled_step.py``: a row per scheme and mode, each compiled step checked
    against the uncompiled one before it is timed; the table written whole to ``--out``."""
    script = benchmark_script("compiled_step")
    out = tmp_path / "compiled.md"
    argv = [
        "--device", DEVICE, "--dtype", "float32", "--schemes", "alibi", "--modes",
        "eager,aot_eager", "--length", "12", "--tokens", "24", "--heads", "2", "--head-dim", "16",
        "--steps", "1", "--repeats", "1", "--warmup", "1", "--out", str(out),
    ]  # fmt: skip
    assert script.main(argv) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| alibi")]
    assert [r.split("|")[3].strip() for r in rows] == ["eager", "aot_eager"]
    assert all(float(r.split("|")[6]) > 0 for r in rows)  # × SDPA, timed
    # The check it times after: a difference, and a NaN, are reported.
    t = torch.ones(3)
    assert script.mismatch([t], [t], 1e-4) is None
    assert "tensor 0" in script.mismatch([t + 1], [t], 1e-4)
    assert "tensor 0" in script.mismatch([t * torch.nan], [t], 1e-4)
