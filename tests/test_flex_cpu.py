"""Compiled FlexAttention on CPU: a canary for an upstream out-of-bounds bug, and the ``flex``
backend against ``eager`` at exactly the shapes where that bug bites.

The bug (torch 2.13, Inductor's C++ FlexAttention kernel, AVX2): for head dim ``d`` 8 or 16 the
kernel computes ``q·kᵀ`` with a micro-GEMM path that, for a key block of length ``j <= 128`` with
``j % 16 == 8`` (8, 24, 40, ..., 120), reads the 8 keys after the block and writes their scores
over the running row maxima (with fewer than 8 queries, also the sums) of the query block. Rows 0-7
of the block come out 0, NaN or wrong whenever the memory after the keys holds large values:
intermittently for fresh tensors (the last ``(batch, head)`` reads whatever the allocator left
after the key tensor). :mod:`relpos.attention.flex` zero-pads ``q`` and ``k`` to ``d = 24`` on CPU,
which takes the kernel's exact path.

Inputs here are *poisoned views*: ``x[:, :, :n]`` of a buffer whose rows past ``n`` are NaN, so any
read past a head's keys that reaches the output shows, on every run, in every ``(batch, head)``.
"""

from __future__ import annotations

import math

import pytest
import torch

import relpos
from relpos import Positions
from relpos.attention import flex as flex_mod
from relpos.attention.eager import eager_attention
from relpos.attention.flex import _compiled_flex, flex_attention_backend, flex_available
from tests.helpers import randomize_parameters, spec_id

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    # emitted from inside Inductor while it compiles FlexAttention
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

SEEDS = range(8)
B, H, N = 2, 2, 40  # the reported shape; N % 16 == 8


@pytest.fixture(autouse=True)
def compiled_for_real():
    """One thread (tiny shapes); and every call here must run the *compiled* kernel: past
    Dynamo's recompile limit (8 shapes by default) FlexAttention would silently run unfused, and
    these tests would pass without testing anything."""
    if not flex_available():
        pytest.skip("FlexAttention is not available in this torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch._dynamo.config.patch(
        recompile_limit=64, accumulated_recompile_limit=1024, fail_on_recompile_limit_hit=True
    ):
        yield
    torch.set_num_threads(threads)


def compiled_or_skip(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, skipping the test where FlexAttention does not compile (no C++
    compiler, no AVX2); a recompile-limit hit is not caught."""
    try:
        return fn(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        pytest.skip(f"FlexAttention does not compile here: {e}")


def poisoned(b: int, h: int, n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """``(b, h, n, d)`` standard normal: a view of a buffer whose 16 rows past ``n`` are NaN."""
    buf = torch.full((b, h, n + 16, d), math.nan)
    buf[:, :, :n] = torch.randn(b, h, n, d, generator=gen)
    return buf[:, :, :n]


def test_upstream_flex_still_reads_past_the_keys_on_cpu():
    """Canary: raw compiled ``flex_attention`` (no relpos code) at b=2, h=2, n=40, d=8.

    Passes while the known bug is there (so the padding in ``relpos.attention.flex`` is needed),
    skips with a message when upstream agrees with the float64 reference, fails if upstream goes
    wrong in some *other* way (then the workaround's premise is stale).

    Why poisoned views rather than a count over random seeds: on fresh tensors the failure depends
    on what the allocator left after the key tensor (3 of 5 trials in the report, 12 of 12 in a
    loop here, 0 of 12 at other shapes), so a seed count could say "fixed" on a lucky run and flip
    between runs. With NaN after every head's keys the out-of-bounds read is visible every time,
    in every ``(batch, head)``: the canary is deterministic, and it needs one compile.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    d = 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (poisoned(B, H, N, d, gen) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: j <= i, B, None, N, N, device="cpu")
    out = compiled_or_skip(_compiled_flex(), q, k, v, block_mask=mask)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    logits = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(d)).masked_fill(
        ~causal, -math.inf
    )
    ref = torch.softmax(logits, -1) @ v.double()
    wrong = ((out.double() - ref).abs().amax(-1).nan_to_num(math.inf) > 1e-4).any((0, 1))  # (i,)
    rows = wrong.nonzero().flatten().tolist()
    isa = torch.backends.cpu.get_cpu_capability()
    if not rows:
        pytest.skip(
            f"upstream FlexAttention on CPU ({isa}, torch {torch.__version__}) now agrees at "
            f"b={B}, h={H}, n={N}, d={d}; the bug is known on AVX2 up to torch 2.13: if this CPU "
            "has AVX2 only, consider lifting the head-dim padding in relpos.attention.flex"
        )
    assert rows == list(range(8)), (
        f"upstream FlexAttention on CPU ({isa}) is wrong in rows {rows}, not the known rows 0-7 "
        "of each query block: re-check the workaround in relpos.attention.flex"
    )


SCHEMES = [
    {"name": "nope"},
    {"name": "alibi"},
    {"name": "t5", "num_buckets": 8, "max_distance": 12},
]


def layout_positions(layout: str) -> Positions:
    """Fixed positions for ``B`` rows of ``N`` tokens: fixed, so that each case compiles once, and
    positions 0-34 in both ``padded`` and ``packed``, so that T5's distance table has one length
    and the two layouts share a compile."""
    if layout == "plain":
        return Positions.from_length(N)
    if layout == "padded":
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[0, :5] = False  # left padding
        mask[1, N - 9 :] = False  # right padding
        return Positions.from_padding_mask(mask)
    ids = [[0] * 35 + [1] * 5, [-1] * 4 + [0] * 12 + [1] * 18 + [2] * 6]
    return Positions.from_segments(torch.tensor(ids))


def check_against_eager(spec, qp: Positions, kp: Positions, d: int, causal: bool) -> None:
    for seed in SEEDS:
        scheme = relpos.make_scheme(spec, d_model=H * d, num_heads=H, causal=causal)
        randomize_parameters(scheme, seed)
        gen = torch.Generator().manual_seed(seed)
        q = poisoned(B, H, len(qp), d, gen)
        k, v = (poisoned(B, H, len(kp), d, gen) for _ in range(2))
        with torch.no_grad():
            ref = eager_attention(q, k, v, scheme, qp, kp, causal=causal)
            out = compiled_or_skip(flex_attention_backend, q, k, v, scheme, qp, kp, causal=causal)
        torch.testing.assert_close(
            out, ref, atol=1e-5, rtol=1e-5, msg=lambda m, seed=seed: f"seed {seed}: {m}"
        )


#: Causal, except NoPE on plain positions: no mask at all, FlexAttention's full-blocks path (the
#: canary covers the causal one).
CASES = [
    (spec, layout, spec["name"] != "nope" or layout != "plain")
    for spec in SCHEMES
    for layout in ("plain", "padded", "packed")
]


@pytest.mark.parametrize(
    ("spec", "layout", "causal"), CASES, ids=lambda x: spec_id(x) if isinstance(x, dict) else str(x)
)
def test_flex_matches_eager_at_the_reported_shape(spec, layout, causal):
    """b=2, h=2, n=40, d=8: upstream writes over rows 0-7 of every head here."""
    pos = layout_positions(layout)
    check_against_eager(spec, pos, pos, d=8, causal=causal)


def test_flex_matches_eager_for_few_queries_over_120_keys():
    """d=16, 3 new queries over a 120-key cache (120 % 16 == 8): with fewer than 8 queries
    upstream also overwrites the row sums."""
    prefix = Positions.from_length(117)
    new = prefix.continued(3)
    check_against_eager(SCHEMES[2], new, prefix.cat(new), d=16, causal=True)


@pytest.mark.parametrize("scheme", ["nope", "alibi", "t5"])
def test_flex_at_length_zero_returns_an_empty_result(scheme):
    """Issue 21 item 8: no kernel call (FlexAttention's block mask cannot be built for 0 tokens)."""
    with torch.no_grad():
        out = relpos.MultiheadAttention(16, 2, scheme, causal=True, backend="flex")(
            torch.randn(2, 0, 16)
        )
    assert out.shape == (2, 0, 16)


# ----------------------------------------------------------------------------- shared memory
class FakeKernel:
    """Stands in for the compiled FlexAttention: fails like a kernel that needs more shared
    memory than the GPU has unless it is given ``SMALL_BLOCKS`` (a deterministic trigger)."""

    def __init__(self, error: str = "out of resource: shared memory, Required: 278528"):
        self.calls: list[dict | None] = []
        self.error = error

    def __call__(self, q, k, v, *, score_mod, block_mask, scale, kernel_options):
        self.calls.append(kernel_options)
        if kernel_options != flex_mod.SMALL_BLOCKS:
            raise RuntimeError(f"No valid triton configs. OutOfMemoryError: {self.error}")
        return torch.zeros_like(v)


def test_out_of_shared_memory_retries_with_small_blocks_and_remembers(monkeypatch):
    fake = FakeKernel()
    monkeypatch.setattr(flex_mod, "_compiled_flex", lambda: fake)
    monkeypatch.setattr(flex_mod, "_NEEDS_SMALL_BLOCKS", set())
    scheme = relpos.make_scheme("t5", d_model=8, num_heads=2, causal=True)
    pos = Positions.from_length(5)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    with torch.no_grad():  # CPU FlexAttention: inference only
        out = flex_attention_backend(q, k, v, scheme, pos, pos, causal=True)
        assert out.shape == v.shape
        assert fake.calls == [None, flex_mod.SMALL_BLOCKS]
        flex_attention_backend(q, k, v, scheme, pos, pos, causal=True)  # small blocks at once
    assert fake.calls[2:] == [flex_mod.SMALL_BLOCKS]


def test_other_compile_errors_and_a_second_overflow_propagate(monkeypatch):
    scheme = relpos.make_scheme("alibi", d_model=8, num_heads=2, causal=True)
    pos = Positions.from_length(5)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    monkeypatch.setattr(flex_mod, "_NEEDS_SMALL_BLOCKS", set())
    fake = FakeKernel(error="something else entirely")
    monkeypatch.setattr(flex_mod, "_compiled_flex", lambda: fake)
    with pytest.raises(RuntimeError, match="something else"):
        flex_attention_backend(q, k, v, scheme, pos, pos, causal=True)
    assert fake.calls == [None]

    def always_short(q, k, v, **kw):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(flex_mod, "_compiled_flex", lambda: always_short)
    with pytest.raises(RuntimeError, match="out of resource"):
        flex_attention_backend(q, k, v, scheme, pos, pos, causal=True)
