"""The declared contracts: what a scheme class says about itself is true, a new scheme that only
follows the contract gets the fast paths, the one bounded cache, and the shape of the import graph
(no cycles, no private names across files)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import relpos
from relpos import Positions, RelativeScheme
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import chunked_path
from relpos.attention.memo import BoundedCache
from relpos.functional import gather_relative, scatter_relative
from relpos.schemes.base import SchemeConfig
from tests.helpers import SCHEME_SPECS, randomize_parameters, spec_id
from tests.test_backends import assert_same

SRC = Path(relpos.__file__).parent


RELATIVE_SPECS = [s for s in SCHEME_SPECS if issubclass(relpos.SCHEMES[s["name"]], RelativeScheme)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", RELATIVE_SPECS, ids=spec_id)
def test_relative_schemes_keep_their_declared_contract(spec, causal):
    """``query_independent`` matches the term's shape; the default hooks are the gather of the
    relative rows (and their mass), which is what the fast backends compute instead."""
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=causal).double()
    randomize_parameters(scheme)
    q = torch.randn(2, 2, 7, 4, dtype=torch.float64)
    qp = Positions.from_segments(torch.tensor([[0, 0, 0, 1, 1, -1, 1], [0, 0, 0, 0, 0, 0, 0]]))
    index = scheme.relative_index(qp, qp)
    assert index.dtype == torch.int64 and int(index.min()) >= 0
    assert int(index.max()) < scheme.num_relative
    rel = scheme.relative_logits(q)
    if "score_bias" in scheme.hooks:
        assert (rel.shape[2] == 1) == scheme.query_independent
        assert scheme.has_relative_keys == (scheme.relative_keys() is not None)
        bias = scheme.score_bias(q, qp, qp)
        assert torch.allclose(bias, gather_relative(rel, index).expand_as(bias), atol=1e-12)
    if "key_bias" in scheme.hooks:  # read from each key at the pair's row: the transposed gather
        k = torch.randn(2, 2, 7, 4, dtype=torch.float64)
        rel_k = scheme.relative_key_logits(k)
        assert rel_k.shape == (2, 2, 7, scheme.num_relative)
        expected = gather_relative(rel_k, index.transpose(-1, -2)).transpose(-1, -2)
        assert torch.allclose(scheme.key_bias(q, k, qp, qp), expected, atol=1e-12)
    else:
        assert scheme.relative_key_logits(torch.randn(2, 2, 7, 4)) is None
    if "value_term" in scheme.hooks:
        probs = torch.rand(2, 2, 7, 7, dtype=torch.float64)
        mass = scatter_relative(probs.new_zeros(2, 2, 7, scheme.num_relative), index, probs)
        assert torch.allclose(
            scheme.value_term(probs, qp, qp), scheme.relative_value(mass), atol=1e-12
        )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", RELATIVE_SPECS, ids=spec_id)
def test_distance_clip_is_where_the_rows_stop_changing(spec, causal):
    """Past a declared ``distance_clip`` every distance reads the nearer end's row (far past it:
    the kernels clamp to the cut table), and ``shifted`` rows are the clipped distance itself,
    the table's every row. Every relative scheme has a clipped or saturating table (DeBERTa's
    log buckets end at its edges) and declares where (a clip too tight fails here; one too loose
    only costs the kernels a longer table)."""
    scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=causal)
    clip = scheme.distance_clip
    assert clip is not None and clip.lo <= 0 <= clip.hi
    far = 3 * max(-clip.lo, clip.hi, 1) + 5
    rows = scheme.rows_by_distance(-far, far)
    cut = scheme.rows_by_distance(clip.lo, clip.hi)
    at = (torch.arange(-far, far + 1).clamp(clip.lo, clip.hi) - clip.lo).long()
    assert torch.equal(rows, cut[at])
    if clip.shifted:
        assert torch.equal(cut, torch.arange(clip.hi - clip.lo + 1))
        assert scheme.num_relative == clip.hi - clip.lo + 1


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_new_scheme_that_follows_the_contract_gets_the_fast_paths(causal):
    """A scheme written only against :class:`RelativeScheme` (num_relative, relative_index,
    relative_keys, relative_value) runs on the region path and equals eager, gradients too."""
    from dataclasses import dataclass

    from relpos.functional.relative import clipped_relative_index

    @dataclass(frozen=True)
    class ClipConfig(SchemeConfig):
        name = "test-clip"
        k: int = 3

    class Clip(RelativeScheme):
        config_class = ClipConfig
        hooks = frozenset({"score_bias", "value_term"})

        def __init__(self, config=None, **dims):
            super().__init__(config, **dims)
            rows = 2 * self.config.k + 1
            self.keys = torch.nn.Parameter(torch.randn(self.num_heads, rows, self.head_dim))
            self.values = torch.nn.Parameter(torch.randn(rows, self.head_dim))

        @property
        def num_relative(self):
            return 2 * self.config.k + 1

        def relative_index(self, q_positions, k_positions):
            return clipped_relative_index(q_positions.distance(k_positions), self.config.k)

        def relative_keys(self, dtype=torch.float32):
            return self.keys.to(dtype) * 0.3

        def relative_value(self, mass):
            return mass.to(self.values.dtype) @ self.values

    scheme = Clip(d_model=8, num_heads=2, causal=causal).double()
    n = 96
    pos = Positions.from_length(n)
    q, k, v = (torch.randn(2, 2, n, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert chunked_path(scheme, q, pos, pos) == "region"
    grad_out = torch.randn(2, 2, n, 4, dtype=torch.float64)
    results = []
    for name in ("eager", "chunked"):
        out = BACKENDS[name](q, k, v, scheme, pos, pos, causal=causal)
        inputs = [q, k, v, scheme.keys, scheme.values]
        results.append((out, torch.autograd.grad(out, inputs, grad_out)))
    assert_same(results, atol=1e-9, rtol=1e-9)

    class Incomplete(RelativeScheme):  # the contract is enforced, not probed at call time
        config_class = ClipConfig

    with pytest.raises(TypeError, match=r"\['num_relative', 'relative_index'\]"):
        Incomplete(d_model=8, num_heads=2, causal=causal)


def test_bounded_cache_evicts_least_recently_used_past_its_budget():
    cache = BoundedCache(10, cost=len)
    cache.put("a", "xxxx")
    cache.put("b", "xxxx")
    assert cache.get("a") == "xxxx"  # a is now the most recent
    cache.put("c", "xxxx")  # 12 > 10: b goes
    assert [k for k, _ in cache.items()] == ["a", "c"] and cache.total == 8
    cache.put("big", "x" * 11)  # costs more than the whole budget: not kept, nothing evicted
    assert [k for k, _ in cache.items()] == ["a", "c"]
    assert cache.get_or_build("d", lambda: "yy") == "yy" and cache.total == 10
    cache.put("a", "x")  # replacing an item updates the total
    assert cache.total == 7
    cache.clear()
    assert len(cache) == 0 and cache.total == 0


def _imports() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports at run time."""
    names = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in names.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []  # annotations only
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in names else target)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("relpos"):
                deps.add(node.module)
        graph[module] = {d for d in deps if d in names and d != module}
    return graph


def test_no_import_cycles_between_modules():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            # A package's __init__ re-exports its children; importing the package from a
            # child is the package, not a cycle through the child.
            if module.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path, module, dep]))
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_no_private_names_imported_across_files():
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    offenders.append(f"{path.relative_to(SRC)}: {node.module} {private}")
    assert offenders == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_rows_flag_what_isfinite_flags(dtype):
    """The non-finite check's one reduction per tensor (the largest magnitude, not below
    infinity) flags exactly the rows ``isfinite`` does: NaN, +inf and -inf anywhere in a query,
    in a key a query may attend to, or in a parameter (an empty one has nothing to flag)."""
    from relpos.attention.contract import nonfinite_rows

    torch.manual_seed(0)
    scheme = relpos.make_scheme("t5", d_model=16, num_heads=2, causal=True)
    scheme.register_parameter("unused", torch.nn.Parameter(torch.empty(0)))
    q, k = torch.randn(2, 2, 9, 8, dtype=dtype), torch.randn(2, 2, 9, 8, dtype=dtype)
    q[0, 1, 3, 5], q[1, 0, 7, 0], k[1, 1, 4, 2] = float("nan"), float("-inf"), float("inf")
    p = Positions.from_length(9)
    got = nonfinite_rows(q, k, scheme, p, p, causal=True)
    bad_q, bad_k = ~torch.isfinite(q).all(-1), ~torch.isfinite(k).all(-1)
    assert torch.equal(got, bad_q | (bad_k.cumsum(-1) > 0))
    assert got.sum() == 2 + 5  # two queries, and every query from the bad key's on
    with torch.no_grad():
        next(scheme.parameters()).view(-1)[0] = float("inf")
    assert nonfinite_rows(q, k, scheme, p, p, causal=True).all()
