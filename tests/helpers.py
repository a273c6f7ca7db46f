"""Shared test helpers of the PyTorch suite: the scheme specs (``tests/specs.py``, which imports
no torch) and the subsets the suites run, random positions and layouts, reference layers."""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

import relpos
from relpos import MultiheadAttention, Positions
from relpos.attention import contract
from tests import oracles
from tests.specs import SCHEME_SPECS as SCHEME_SPECS
from tests.specs import causal_only as causal_only
from tests.specs import length_dependent as length_dependent

#: Devices the device-parametrised suites run on: the CPU, and CUDA where a GPU is present.
DEVICES: list[str] = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


#: The tensor methods that wait for the device to hand the host a value.
SYNCS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
}  # fmt: skip


class SyncCalls(TorchFunctionMode):
    """The names of the :data:`SYNCS` methods called within it (a device sync each on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def nonfinite_gpu_path(out, q, k, scheme, q_positions, k_positions, causal):
    """``contract.propagate_nonfinite`` as a GPU runs it, for tests that count syncs on a CPU
    (where it takes a cheaper path with one)."""
    bad = contract.nonfinite_rows(q, k, scheme, q_positions, k_positions, causal)
    return torch.where(bad.unsqueeze(-1), torch.nan, out)


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` loaded as a module (the scripts are not a package): its ``main``
    and helpers, for the tests of the scripts themselves."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fused_device() -> str:
    """Where ``tests/fused`` runs the Triton kernels: the CPU in Triton's interpreter
    (``TRITON_INTERPRET=1``), else CUDA; a module without either is skipped."""
    from relpos.kernels import interpreted

    if interpreted():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1", allow_module_level=True)


def contextual(spec: dict) -> bool:
    """Whether a spec's scheme computes positions from the layer's input (``contextualize``)."""
    return "contextualize" in relpos.SCHEMES[spec["name"]].hooks


def absolute(spec: dict) -> bool:
    """Whether a spec's scheme acts at the input (``embed``: sinusoidal, learned positions); an
    attention layer refuses it."""
    return "embed" in relpos.SCHEMES[spec["name"]].hooks


def has_value_term(spec: dict) -> bool:
    """Whether the spec adds a value term (Shaw's values): ``sdpa`` and ``flex`` decline it."""
    return spec["name"] == "shaw" and spec.get("values", True)


def tiles_refuse(spec: dict) -> bool:
    """Whether ``chunked`` and ``flex`` refuse the scheme: a ``key_bias`` with no relative form
    (CoPE's gates read every key at once); ``eager`` and ``sdpa`` run it (``auto``: ``sdpa``)."""
    scheme = relpos.SCHEMES[spec["name"]]
    return "key_bias" in scheme.hooks and not issubclass(scheme, relpos.RelativeScheme)


def _same_backend_path(spec: dict) -> bool:
    """A spec whose attention reaches every backend exactly as another spec's does: an absolute
    scheme (attention sees NoPE), a RoPE variant that differs from plain RoPE only in its angles or
    scales, or a distance-function bias other than KERPLE's (every
    :class:`~relpos.schemes.DistanceBiasScheme` hands the backends a table of distances the same
    way)."""
    keys = {"scaling", "learned_freq", "sections", "axial", "xpos_scale_base"}
    if spec["name"] == "rope":
        return bool(keys & set(spec)) and not length_dependent(spec)
    scheme = relpos.SCHEMES[spec["name"]]
    if scheme.hooks == {"embed"}:
        return True
    return issubclass(scheme, relpos.DistanceBiasScheme) and spec != {"name": "kerple"}


#: The specs the backend suites run: one per distinct path through the backends. A backend
#: receives q and k already rotated, so plain RoPE, the interleaved partial layout and the
#: length-dependent scalings (whose keys rotate after the cache) stand for the RoPE family, NoPE
#: for the absolute schemes and KERPLE for the distance-function biases; the conformance and
#: oracle suites run every spec. A causal-only scheme that only ``eager`` and ``sdpa`` run (CoPE)
#: has its backend parity in its own test file; so has a contextual scheme (the forget gate),
#: whose positions come from the layer input, which the suites' direct backend calls lack.
BACKEND_SPECS: list[dict] = [
    s
    for s in SCHEME_SPECS
    if not _same_backend_path(s) and not (causal_only(s) and tiles_refuse(s)) and not contextual(s)
]


#: The specs an attention layer takes: every spec but the absolute ones.
ATTENTION_SPECS: list[dict] = [s for s in SCHEME_SPECS if not absolute(s)]


def spec_id(spec: dict) -> str:
    rest = ",".join(f"{k}={v}" for k, v in spec.items() if k != "name")
    return spec["name"] + (f"[{rest}]" if rest else "")


def randomize_parameters(module: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter non-trivial values (tables start small or zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def random_segments(
    rng: random.Random, n: int, *, max_docs: int = 3, pad: bool = True
) -> list[int]:
    """Segment ids for n tokens: a few contiguous documents, maybe padding at either end."""
    left = rng.randint(0, n // 3) if pad and rng.random() < 0.5 else 0
    right = rng.randint(0, n // 3) if pad and rng.random() < 0.5 else 0
    body = n - left - right
    docs = min(rng.randint(1, max_docs), body)
    cuts = sorted(rng.sample(range(1, body), docs - 1)) if body > 1 else []
    ids: list[int] = []
    for s, (a, b) in enumerate(zip([0, *cuts], [*cuts, body], strict=True)):
        ids += [s] * (b - a)
    return [-1] * left + ids + [-1] * right


def gqa_and_repeated(
    spec, kvh: int, causal: bool, backend: str, *, d_model: int, num_heads: int
) -> tuple[relpos.MultiheadAttention, relpos.MultiheadAttention]:
    """A grouped-query layer (``num_kv_heads=kvh``, random parameters) and the equal plain
    multi-head ``eager`` layer whose key/value weights repeat each group's, both in eval mode."""
    torch.manual_seed(0)
    gqa = relpos.MultiheadAttention(
        d_model, num_heads, spec, causal=causal, backend=backend, num_kv_heads=kvh
    )
    randomize_parameters(gqa)
    full = relpos.MultiheadAttention(d_model, num_heads, spec, causal=causal, backend="eager")
    h, d, g = num_heads, d_model // num_heads, num_heads // kvh
    with torch.no_grad():
        q, k, v = gqa.qkv.weight.split([h * d, kvh * d, kvh * d])
        qb, kb, vb = gqa.qkv.bias.split([h * d, kvh * d, kvh * d])

        def rep(t):
            return t.view(kvh, d, *t.shape[1:]).repeat_interleave(g, 0).reshape(h * d, *t.shape[1:])

        full.qkv.weight.copy_(torch.cat([q, rep(k), rep(v)]))
        full.qkv.bias.copy_(torch.cat([qb, rep(kb), rep(vb)]))
        full.out.load_state_dict(gqa.out.state_dict())
        full.scheme.load_state_dict(gqa.scheme.state_dict())
    return gqa.eval(), full.eval()


def make_layout(layout: str, rng: random.Random, b: int, n: int) -> tuple[Positions, Positions]:
    """``(q_positions, k_positions)`` for ``n`` keys."""
    if layout == "plain":
        p = Positions.from_length(n)
        return p, p
    if layout == "offset":
        p = Positions.from_length(n, offset=rng.randint(1, 7))
        return p, p
    if layout in ("left-pad", "right-pad"):
        mask = torch.ones(b, n, dtype=torch.bool)
        for r in range(b):
            pad = rng.randint(0, n // 2) if r else rng.randint(1, n // 2)  # row 0 always padded
            if layout == "left-pad":
                mask[r, :pad] = False
            else:
                mask[r, n - pad :] = False
        p = Positions.from_padding_mask(mask)
        return p, p
    if layout == "packed":
        p = Positions.from_segments(torch.tensor([random_segments(rng, n) for _ in range(b)]))
        return p, p
    # KV cache: a prefix of n - m keys (padded rows, or plain), then m new tokens that continue it.
    m = rng.randint(1, max(1, n // 3))
    if layout == "cached":
        mask = torch.ones(b, n - m, dtype=torch.bool)
        mask[0, : rng.randint(1, (n - m) // 2)] = False  # left padding in the prompt
        prefix = Positions.from_padding_mask(mask)
    else:
        prefix = Positions.from_length(n - m)
    new = prefix.continued(m)
    return new, prefix.cat(new)


def skip_if_refused_deterministic(error: RuntimeError, what: str) -> None:
    """Skip, naming it, where one of PyTorch's own kernels refused deterministic mode; re-raise
    any other error."""
    if "determinis" not in str(error):
        raise error
    pytest.skip(f"{what}: {' '.join(str(error).split())[:200]}")


def oracle_attention_layer(attn: MultiheadAttention, x: torch.Tensor, p: Positions):
    """``attn``'s projections around the loop oracle (``tests/oracles.attention``)."""
    b, n, _ = x.shape
    h, d = attn.num_heads, attn.head_dim
    q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in attn.qkv(x).split(h * d, dim=-1))
    p = p.expand(b)
    pos, seg = p.pos.tolist(), p.seg.tolist()
    coords = None if p.coords is None else p.coords.tolist()
    y = oracles.attention(
        attn.scheme,
        q,
        k,
        v,
        pos,
        seg,
        pos,
        seg,
        causal=attn.causal,
        q_coords=coords,
        k_coords=coords,
    )
    y = attn.out(y.transpose(1, 2).reshape(b, n, h * d))
    return torch.where(p.valid.unsqueeze(-1), y, 0.0)
