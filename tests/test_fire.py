"""FIRE (Li et al., ICLR 2024): the bias against a loop over (i, j) straight from the paper's
formula (values and every parameter's gradient), the MLP's piecewise-linear form against the
direct MLP (values and gradients, at and between kinks), the threshold's progressive
interpolation, the backends and the refusals. The shared suites (``SCHEME_SPECS``) run it
through the attention oracle, padded / packed / cached parity, every backend against eager,
compile and gradcheck."""

from __future__ import annotations

import os
import random
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import Positions
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import chunked_attention
from relpos.attention.flex import flex_available, flex_supports
from relpos.functional import fire as fire_mod
from tests.helpers import random_segments, randomize_parameters

SPEC = {"name": "fire", "hidden": 8, "init_threshold": 4.5}


def make(h: int = 2, spec: dict = SPEC, seed: int = 0, dtype=torch.float64) -> relpos.Fire:
    scheme = relpos.make_scheme(spec, d_model=4 * h, num_heads=h, causal=True).to(dtype)
    randomize_parameters(scheme, seed)
    return scheme


def loop_bias(scheme: relpos.Fire, qp: Positions, kp: Positions) -> torch.Tensor:
    """``f_θ(ψ(p_i - p_j) / ψ(max(L, p_i)))`` pair by pair, ``ψ(x) = log(|c|·x + 1)``. A pair
    with a padding key (masked in attention) reads distance 0, as relpos defines it."""
    c = scheme.c.abs()
    big_l = (scheme.threshold_scale * scheme.config.init_threshold).abs()
    w1, b1 = scheme.mlp[0].weight[:, 0], scheme.mlp[0].bias
    w2, b2 = scheme.mlp[2].weight, scheme.mlp[2].bias
    b = max(qp.batch, kp.batch)
    qpos, kpos, kseg = qp.expand(b).pos.tolist(), kp.expand(b).pos.tolist(), kp.expand(b).seg
    rows = []
    for r in range(b):
        pairs = []
        for pi in qpos[r]:
            for pj, sj in zip(kpos[r], kseg[r].tolist(), strict=True):
                reach = big_l if big_l > pi else torch.tensor(float(pi), dtype=c.dtype)
                delta = max(pi - pj, 0) if sj != -1 else 0
                x = torch.log(c * delta + 1) / (torch.log(c * reach + 1) + 1e-6)
                hidden = torch.relu(w1 * x + b1)
                pairs.append(w2 @ hidden + b2)  # one value per head
        rows.append(torch.stack(pairs).T.reshape(-1, len(qpos[r]), len(kpos[r])))
    return torch.stack(rows)


def random_positions(rng: random.Random, b: int, n: int) -> Positions:
    seg = torch.tensor([random_segments(rng, n) for _ in range(b)])
    return Positions.from_segments(seg, offset=torch.tensor([rng.randint(0, 9) for _ in range(b)]))


@settings(max_examples=6)
@given(seed=st.integers(0, 2**16))
def test_bias_and_parameter_gradients_match_the_loop(seed):
    rng = random.Random(seed)
    h, b, n = rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 9)
    scheme = make(h, seed=seed)
    kp = random_positions(rng, b, n)
    qp = kp[n - rng.randint(1, n) :]  # the last few tokens: a KV cache's queries
    out = scheme.score_bias(None, qp, kp)
    ref = loop_bias(scheme, qp, kp)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(ref)
    params = list(scheme.parameters())
    g = torch.autograd.grad((out * weights).sum(), params, allow_unused=True)
    g_ref = torch.autograd.grad((ref * weights).sum(), params, allow_unused=True)
    for name, a, r in zip([n for n, _ in scheme.named_parameters()], g, g_ref, strict=True):
        r = torch.zeros_like(a) if r is None else r  # e.g. L below every query: no gradient
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("n", [5, 6], ids=["below-threshold", "one-query-above"])
def test_queries_below_the_threshold_read_one_distance_table(n, monkeypatch):
    """With every query at or below ``L`` (4.5 here) the MLP runs once per distance (5 inputs for
    positions 0..4) and the gathered table equals the loop, values and gradients; one query past
    ``L`` takes the per-pair path (n² inputs)."""
    seen = []
    real = fire_mod._PiecewiseMLP.apply
    monkeypatch.setattr(
        fire_mod._PiecewiseMLP, "apply", lambda x, *w: seen.append(x.numel()) or real(x, *w)
    )
    scheme = make(2, seed=n)
    with torch.no_grad():
        scheme.threshold_scale.fill_(-1.0)  # L = |-1|·4.5
    pos = Positions.from_length(n)
    out = scheme.score_bias(None, pos, pos)
    assert seen == ([n] if n == 5 else [n * n])
    ref = loop_bias(scheme, pos, pos)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(ref)
    params = list(scheme.parameters())
    for a, r in zip(
        torch.autograd.grad((out * weights).sum(), params),
        torch.autograd.grad((ref * weights).sum(), params),
        strict=True,
    ):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_piecewise_form_equals_the_direct_mlp(seed):
    """Values and the gradients of x and every weight, against ``relu(x·w1ᵀ + b1)·w2ᵀ + b2``
    through autograd, on inputs between kinks, exactly on kinks (two units sharing one) and
    beyond the outermost ones; units with ``w1 = 0`` (on or off) included."""
    torch.manual_seed(seed)
    w, h = 9, 3
    w1 = torch.randn(w, 1, dtype=torch.float64)
    b1 = torch.randn(w, dtype=torch.float64)
    w1[0], b1[0], w1[1], b1[1] = 0.0, 0.7, 0.0, -0.3  # constant units: on, off
    w1[3], b1[3] = 2 * w1[2], 2 * b1[2]  # two units with the same kink
    w2, b2 = torch.randn(h, w, dtype=torch.float64), torch.randn(h, dtype=torch.float64)
    kinks, _ = fire_mod.fire_segments(w1, b1)
    assert kinks.numel() == w - 2
    x = torch.cat([torch.linspace(-4, 4, 41, dtype=torch.float64), kinks, kinks + 1e-9])
    x = x.view(1, 1, -1).requires_grad_(True)
    weights = (w1, b1, w2, b2)
    leaves = [t.clone().requires_grad_(True) for t in weights]
    out = fire_mod._PiecewiseMLP.apply(x, *leaves)  # (1, h, 1, n)
    ref_leaves = [t.clone().requires_grad_(True) for t in weights]
    ref = fire_mod.fire_mlp(x.view(-1), *ref_leaves).t().reshape(1, h, 1, -1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(ref)
    # On a kink the two sides' derivatives differ; autograd's relu takes the inactive side.
    off_kink = torch.ones(x.numel(), dtype=torch.bool)
    off_kink[41 : 41 + kinks.numel()] = False
    on_grid = x.detach().view(-1)[off_kink].view(1, 1, -1).requires_grad_(True)
    ref_grads = torch.autograd.grad(
        fire_mod.fire_mlp(on_grid.view(-1), *ref_leaves).t().reshape(1, h, 1, -1),
        [on_grid, *ref_leaves],
        upstream[..., off_kink],
    )
    grads = torch.autograd.grad(
        fire_mod._PiecewiseMLP.apply(on_grid, *leaves), [on_grid, *leaves], upstream[..., off_kink]
    )
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_queries_below_the_threshold_share_one_normaliser():
    """Below ``L`` the bias is a function of the distance alone; beyond it the distance is a
    fraction of the query's position: the first token of a long sequence gets ``f_θ(1)``."""
    scheme = make(2, spec={**SPEC, "init_threshold": 6.0})
    with torch.no_grad():
        scheme.threshold_scale.fill_(1.0)  # L = 6
    pos = Positions.from_length(20)
    bias = scheme.score_bias(None, pos, pos)[0]  # (h, i, j)
    for i in range(1, 6):  # p_i <= L: same as the query at L for every distance
        torch.testing.assert_close(bias[:, i, : i + 1], bias[:, 6, 6 - i : 7])
    first = bias[:, 7:, 0]  # p_i > L, key 0: ψ(p_i) / ψ(p_i) = 1 (up to the 1e-6)
    torch.testing.assert_close(first, first[:, :1].expand_as(first), rtol=1e-5, atol=1e-6)


def test_positions_not_indices():
    """Each sequence's own positions: a packed document gets the bias it gets alone."""
    scheme = make(2)
    packed = Positions.from_segments(torch.tensor([[0, 0, 0, 1, 1, 1, 1]]))
    alone = Positions.from_length(4)
    bias = scheme.score_bias(None, packed, packed)[0, :, 3:, 3:]
    torch.testing.assert_close(bias, scheme.score_bias(None, alone, alone)[0])


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "chunked-tiles", "auto"])
def test_backends_match_eager_with_gradients(backend, layout):
    rng = random.Random(7)
    scheme = make(3, seed=7)
    pos = Positions.from_length(21) if layout == "plain" else random_positions(rng, 2, 21)
    q, k, v = (torch.randn(2, 3, 21, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    inputs = [q, k, v, *scheme.parameters()]
    results = []
    for name in ("eager", backend):
        if name == "chunked-tiles":
            out = chunked_attention(q, k, v, scheme, pos, pos, causal=True, q_block=5, k_block=7)
        else:
            out = BACKENDS[name](q, k, v, scheme, pos, pos, causal=True)
        results.append((out, torch.autograd.grad(out.square().sum(), inputs)))
    (ref, g_ref), (out, g) = results
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, r in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-10)


def test_flex_declines_fire_clearly():
    scheme = make(2, dtype=torch.float32)
    assert not flex_supports(scheme, needs_grad=False)
    if not flex_available():
        return
    pos = Positions.from_length(4)
    q = torch.randn(1, 2, 4, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="does not support scheme Fire"):
        BACKENDS["flex"](q, q, q, scheme, pos, pos, causal=True)


def test_bidirectional_is_refused():
    with pytest.raises(ValueError, match="fire needs causal=True"):
        relpos.make_scheme("fire", d_model=8, num_heads=2, causal=False)
    with pytest.raises(ValueError, match="causal only"):
        relpos.Transformer(
            relpos.TransformerConfig(
                vocab_size=5, d_model=8, num_heads=2, num_layers=1, causal=False, scheme="fire"
            )
        )


def test_paper_defaults_and_float32_in_bf16():
    scheme = relpos.make_scheme("fire", d_model=16, num_heads=4, causal=True)
    assert scheme.mlp[0].out_features == 32 and scheme.mlp[2].out_features == 4
    assert scheme.c.item() == pytest.approx(0.1) and scheme.threshold_scale.item() == 1.0
    assert scheme.config.init_threshold == 512.0
    pos = Positions.from_length(5)
    assert scheme.to(torch.bfloat16).score_bias(None, pos, pos).dtype == torch.float32


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden", 0, "hidden must be >= 1, got 0"),
        ("init_c", -0.5, "init_c must be a finite number > 0, got -0.5"),
        ("init_c", float("inf"), "init_c must be a finite number > 0, got inf"),
        ("init_c", float("nan"), "init_c must be a finite number > 0, got nan"),
        ("init_threshold", 0, "init_threshold must be a finite number > 0, got 0"),
        ("heads", [0, 0], "heads lists a head twice"),
    ],
)
def test_bad_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        relpos.FireConfig(**{field: value})
    with pytest.raises(TypeError, match="init_c must be a number"):
        relpos.FireConfig(init_c="big")


def test_bench_rows_are_causal_only(tmp_path):
    from relpos.cli import bench

    argv = ["--lengths", "32", "--schemes", "fire,sandwich", "--impls", "sdpa,chunked"]
    argv += ["--mask", "both", "--repeats", "5", "--warmup", "1", "--no-memory", "--no-plot"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    table = (tmp_path / "bench.md").read_text()
    assert "| fire | chunked | 32 | 1 | causal |" in table
    assert "| sandwich | sdpa | 32 | 1 | bidir |" in table
    assert "| fire | sdpa | 32 | 1 | bidir |" not in table


# ------------------------------------------------------------------------------ the C kernel
#: The kernel tests need the compiler that builds it (the fallback's test does not).
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler to build the kernel"
)


def random_float32_case(
    rng: random.Random, seed: int, *, heads: int, shortest: int, threshold: tuple[float, float]
) -> tuple[relpos.Fire, Positions]:
    """A float32 FIRE of 1…``heads`` heads and a random hidden width and threshold, and padded /
    packed positions of 1–2 rows of ``shortest``…40 tokens."""
    h, b, n = rng.randint(1, heads), rng.randint(1, 2), rng.randint(shortest, 40)
    spec = {**SPEC, "hidden": rng.choice([1, 8, 32]), "init_threshold": rng.uniform(*threshold)}
    return make(h, spec, seed=seed, dtype=torch.float32), random_positions(rng, b, n)


def fused_calls(monkeypatch) -> list[int]:
    """Counts the C kernel's forward calls."""
    seen: list[int] = []
    real = fire_mod._FusedPairs.apply
    monkeypatch.setattr(fire_mod._FusedPairs, "apply", lambda *a: seen.append(1) or real(*a))
    return seen


@needs_compiler
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_c_kernel_matches_the_loop_and_the_torch_path(seed):
    """float32 on the CPU runs the per-pair bias in C (``native/fire.c``): its values and every
    parameter's gradient equal the float64 loop, and the PyTorch path (``RELPOS_NATIVE=0``), on
    padded, packed and cached positions with queries past the threshold."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        scheme, kp = random_float32_case(rng, seed, heads=4, shortest=2, threshold=(0.5, 12))
        n = kp.pos.shape[1]
        qp = kp[n - rng.randint(1, n) :]
        assume_past = qp.pos.max() > scheme.threshold_scale.abs() * scheme.config.init_threshold
        seen = fused_calls(monkeypatch)
        out = scheme.score_bias(None, qp, kp)
        assert len(seen) == int(bool(assume_past))  # the C kernel ran where the pairs need it
        weights = torch.randn_like(out)
        params = list(scheme.parameters())
        grads = torch.autograd.grad((out * weights).sum(), params, allow_unused=True)
        monkeypatch.setenv("RELPOS_NATIVE", "0")
        torch_out = scheme.score_bias(None, qp, kp)
        torch_grads = torch.autograd.grad((torch_out * weights).sum(), params, allow_unused=True)
        assert len(seen) == int(bool(assume_past))  # not called with RELPOS_NATIVE=0
        torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)
        exact = scheme.double()
        ref = loop_bias(exact, qp, kp)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        ref_grads = torch.autograd.grad(
            (ref * weights.double()).sum(), list(exact.parameters()), allow_unused=True
        )
        names = [name for name, _ in scheme.named_parameters()]
        for name, a, t, r in zip(names, grads, torch_grads, ref_grads, strict=True):
            r = torch.zeros_like(a, dtype=torch.float64) if r is None else r
            scale = r.abs().max().item() + 1.0
            torch.testing.assert_close(a.double() / scale, r / scale, rtol=0, atol=1e-4, msg=name)
            t = torch.zeros_like(a) if t is None else t
            torch.testing.assert_close(a / scale, t / scale, rtol=0, atol=1e-4, msg=name)


def pair_calls(monkeypatch) -> dict[str, int]:
    """Counts :class:`FirePairs` tile calls (forward and backward) and ``score_bias`` calls."""
    seen = {"add_": 0, "backward": 0, "score_bias": 0}
    for owner, name in ((fire_mod.FirePairs, "add_"), (fire_mod.FirePairs, "backward")):
        real = getattr(owner, name)

        def spy(self, *a, _real=real, _name=name):
            seen[_name] += 1
            return _real(self, *a)

        monkeypatch.setattr(owner, name, spy)
    real_bias = relpos.Fire.score_bias

    def bias_spy(self, *a):
        seen["score_bias"] += 1
        return real_bias(self, *a)

    monkeypatch.setattr(relpos.Fire, "score_bias", bias_spy)
    return seen


@needs_compiler
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), cached=st.booleans())
def test_chunked_tiles_run_the_kernel_and_its_gradient_sums(seed, cached):
    """In float32 the tile engine adds FIRE's bias with the kernel and sums its gradient inside
    it (:class:`FirePairs`: no ``score_bias`` and no per-tile ``autograd.grad``); the output and
    the gradients of ``q``, ``k``, ``v`` and every parameter equal ``eager`` with the kernel off,
    on padded and packed batches and a KV-cache step, queries past the threshold."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        scheme, kp = random_float32_case(rng, seed, heads=3, shortest=9, threshold=(1, 9))
        (b, n), h = kp.pos.shape, scheme.num_heads
        qp = kp[n - rng.randint(1, 6) :] if cached else kp
        q = torch.randn(b, h, qp.pos.shape[1], 4, requires_grad=True)
        k, v = (torch.randn(b, h, n, 4, requires_grad=True) for _ in range(2))
        params = [q, k, v, *scheme.parameters()]
        blocks = {"q_block": rng.randint(1, 9), "k_block": rng.randint(1, 13)}

        seen = pair_calls(monkeypatch)
        out = chunked_attention(q, k, v, scheme, qp, kp, causal=True, path="tiles", **blocks)
        grads = torch.autograd.grad(out.square().sum(), params)
        visible = bool(qp.allowed(kp, causal=True).any())  # else the plan skips every tile
        assert (seen["add_"] > 0) == (seen["backward"] > 0) == visible
        assert seen["score_bias"] == 0

        monkeypatch.setenv("RELPOS_NATIVE", "0")  # the reference: the PyTorch path
        ref = BACKENDS["eager"](q, k, v, scheme, qp, kp, causal=True)
        ref_grads = torch.autograd.grad(ref.square().sum(), params)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        names = ["q", "k", "v", *(name for name, _ in scheme.named_parameters())]
        for name, a, r in zip(names, grads, ref_grads, strict=True):
            scale = r.abs().max().item() + 1.0
            torch.testing.assert_close(a / scale, r / scale, rtol=0, atol=1e-4, msg=name)


@needs_compiler
def test_the_distance_table_spans_real_tokens_at_any_offset():
    """Left padding (position 0) beside tokens at 10**7, and rows at far-apart offsets: the C
    kernel's table over distances holds one row's real distances, not ``p_i - 0`` (an 80 MB
    table before); the bias of the real pairs equals the loop."""
    scheme = make(2, dtype=torch.float32)
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    for offset in (10**7, torch.tensor([0, 10**7])):
        kp = Positions.from_padding_mask(mask, offset=offset)
        pairs = scheme.pair_bias(torch.zeros(2, 2, 5, 4), kp, kp)
        assert pairs.psi.numel() == 5  # distances 0 … 4
        real = kp.allowed(kp, causal=True)[:, None]
        got = scheme.score_bias(None, kp, kp).double()
        want = loop_bias(scheme.double(), kp, kp)
        torch.testing.assert_close(got[real.expand_as(got)], want[real.expand_as(want)])
        scheme.float()


@needs_compiler
def test_chunked_tiles_without_the_kernel_take_the_general_path(monkeypatch):
    """float64, or ``RELPOS_NATIVE=0``: ``pair_bias`` declines and the tiles call ``score_bias``
    (the same numbers as the kernel's)."""
    scheme = make(2, {**SPEC, "init_threshold": 2.0}, dtype=torch.float32)
    pos = Positions.from_length(12)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    assert isinstance(scheme.pair_bias(q, pos, pos), fire_mod.FirePairs)
    assert scheme.pair_bias(q.double(), pos, pos) is None
    seen = pair_calls(monkeypatch)
    fast = chunked_attention(q, k, v, scheme, pos, pos, causal=True, q_block=4, k_block=4)
    monkeypatch.setenv("RELPOS_NATIVE", "0")
    assert scheme.pair_bias(q, pos, pos) is None
    slow = chunked_attention(q, k, v, scheme, pos, pos, causal=True, q_block=4, k_block=4)
    assert seen["add_"] > 0 and seen["score_bias"] > 0
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_pair_bias_refuses_a_tile_it_cannot_fill():
    scheme = make(2, {**SPEC, "init_threshold": 2.0}, dtype=torch.float32)
    pos = Positions.from_length(6).expand(2)
    pairs = scheme.pair_bias(torch.zeros(2, 2, 6, 4), pos, pos)
    shape = r"shape \(2, 2, 2, 3\), got torch.float32 \(2, 2, 3, 3\)"
    with pytest.raises(ValueError, match=shape):
        pairs.add_(torch.zeros(2, 2, 3, 3), (0, 2), (0, 3))
    with pytest.raises(ValueError, match=r"got torch\.float64"):
        pairs.add_(torch.zeros(2, 2, 2, 3, dtype=torch.float64), (0, 2), (0, 3))
    with pytest.raises(ValueError, match=r"cols \(4, 7\) must lie inside the 6 queries and 6"):
        pairs.add_(torch.zeros(2, 2, 2, 3), (0, 2), (4, 7))  # past the keys: never read
    batch = r"batch 2 \(queries\) and 2 \(keys\); the tile has batch 3"
    with pytest.raises(ValueError, match=batch):
        pairs.backward(torch.zeros(3, 2, 2, 3), (0, 2), (0, 3))
    assert all(not g.any() for g in pairs.grads())  # nothing summed: zeros


def test_without_a_compiler_the_torch_path_runs_with_one_warning(monkeypatch, tmp_path):
    """A build that fails (here a compiler that always fails) warns once, names the kernel, and
    leaves the PyTorch path: the same bias."""
    from relpos import native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("RELPOS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    scheme = make(2, {**SPEC, "init_threshold": 2.0}, dtype=torch.float32)
    pos = Positions.from_length(9)
    with pytest.warns(native.NativeBuildWarning, match="'fire' is not available.*false failed"):
        out = scheme.score_bias(None, pos, pos)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        again = scheme.score_bias(None, pos, pos)
    monkeypatch.setenv("RELPOS_NATIVE", "0")
    torch.testing.assert_close(out, scheme.score_bias(None, pos, pos), rtol=0, atol=0)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind


@needs_compiler
def test_the_kernel_is_built_once_into_the_cache(monkeypatch, tmp_path):
    from relpos import native

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("RELPOS_CACHE", str(tmp_path))
    assert native.load("fire", fire_mod._SIGNATURES) is not None
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("fire-") and built[0].suffix == ".so"
    monkeypatch.setattr(native, "_loaded", {})
    stamp = built[0].stat().st_mtime_ns
    assert native.load("fire", fire_mod._SIGNATURES) is not None
    assert built[0].stat().st_mtime_ns == stamp  # found, not rebuilt
    monkeypatch.setenv("RELPOS_NATIVE", "0")
    assert native.load("fire", fire_mod._SIGNATURES) is None
