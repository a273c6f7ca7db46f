"""One conformance suite, run over every registered scheme (and its variants).

For each scheme, a tiny reference transformer must give every sequence the same numbers however it
is batched: (a) padded on the left or right, (b) packed with other documents in one row, (c) decoded
token by token or in chunks with a KV cache. Plus shapes, dtypes, config and state_dict round
trips, and a torch.compile smoke test.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import relpos
from relpos import Positions, Transformer, TransformerConfig, checks
from tests.helpers import (
    ATTENTION_SPECS,
    DEVICES,
    SCHEME_SPECS,
    SyncCalls,
    absolute,
    causal_only,
    has_value_term,
    length_dependent,
    nonfinite_gpu_path,
    randomize_parameters,
    spec_id,
)

VOCAB = 13
ATOL = 1e-5


def tiny_model(
    spec: dict,
    causal: bool,
    seed: int = 0,
    backend: str = "auto",
    num_layers: int = 2,
    device: str = "cpu",
) -> Transformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        backend=backend,
        vocab_size=VOCAB,
        d_model=16,
        num_heads=2,
        num_layers=num_layers,
        dropout=0.0,
        causal=causal,
        scheme=spec,
    )
    model = Transformer(cfg).eval()
    randomize_parameters(model, seed)
    return model.to(device)


def random_docs(rng: random.Random, count: int, lo: int = 1, hi: int = 9) -> list[torch.Tensor]:
    return [
        torch.tensor([rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))])
        for _ in range(count)
    ]


causal_ids = ["causal", "bidirectional"]


#: The reference and the default: both must keep padded, packed and cached runs exact.
parity_backends = pytest.mark.parametrize("backend", ["eager", "auto"])
#: The CPU, and CUDA where a GPU is present.
on_devices = pytest.mark.parametrize("device", DEVICES)


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
@pytest.mark.parametrize("causal", [True, False], ids=causal_ids)
@pytest.mark.parametrize("side", ["left", "right"])
@parity_backends
@on_devices
@pytest.mark.matrix
def test_padded_batch_equals_each_sample_alone(spec, causal, side, backend, device):
    if not causal and causal_only(spec):
        pytest.skip("causal only (its own test file checks the refusal)")
    docs = random_docs(random.Random(1), 4)
    assert (
        checks.padded_gap(tiny_model(spec, causal, backend=backend, device=device), docs, side=side)
        < ATOL
    )


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
@pytest.mark.parametrize("causal", [True, False], ids=causal_ids)
@parity_backends
@on_devices
@pytest.mark.matrix
def test_packed_row_equals_each_document_alone(spec, causal, backend, device):
    if not causal and causal_only(spec):
        pytest.skip("causal only (its own test file checks the refusal)")
    rng = random.Random(2)
    rows = [random_docs(rng, 3), random_docs(rng, 2)]
    assert checks.packed_gap(tiny_model(spec, causal, backend=backend, device=device), rows) < ATOL


def decoding_layers(spec: dict) -> int:
    """Layers of the model the decoding checks run: one for a length-dependent scaling. Its
    deeper layers' cached keys come from hidden states computed when the row was shorter (as in
    any KV cache), so only one layer can equal a fresh forward of the longer prefix exactly."""
    return 1 if length_dependent(spec) else 2


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
@pytest.mark.parametrize("chunk", [1, 3])
@parity_backends
@on_devices
@pytest.mark.matrix
def test_cached_decoding_equals_full_forward(spec, chunk, backend, device):
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    model = tiny_model(
        spec, causal=True, backend=backend, num_layers=decoding_layers(spec), device=device
    )
    assert checks.cached_gap(model, tokens, chunk=chunk) < ATOL


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
@parity_backends
@on_devices
@pytest.mark.matrix
def test_left_padded_prompts_decode_like_each_alone(spec, backend, device):
    """Batched generation: left-padded prompts, then one token per step for every row."""
    rng = random.Random(4)
    prompts = random_docs(rng, 3, lo=2, hi=6)
    cont = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(4))
    model = tiny_model(
        spec, causal=True, backend=backend, num_layers=decoding_layers(spec), device=device
    )
    assert checks.left_padded_decoding_gap(model, prompts, cont) < ATOL


@pytest.mark.parametrize("spec", [s for s in ATTENTION_SPECS if not has_value_term(s)], ids=spec_id)
def test_a_decoding_step_issues_no_device_sync(spec, monkeypatch):
    """A step of one token after a cached prompt, through ``sdpa`` (what ``auto`` takes for it
    on a GPU), reads nothing from the device on the host: a sync per layer and token would stall
    the host until the GPU drains. The queries and keys are two ``Positions``, which promise no
    range of distances. The CPU's own shortcuts are set to the GPU's paths: the non-finite
    check's, and FIRE's C kernel (it reads the positions on the CPU; a GPU evaluates per pair)."""
    monkeypatch.setattr(relpos.attention.sdpa, "propagate_nonfinite", nonfinite_gpu_path)
    monkeypatch.setattr(relpos.functional.fire, "fire_pairs", lambda *args: None)
    torch.manual_seed(0)
    attn = relpos.MultiheadAttention(16, 2, scheme=spec, causal=True, backend="sdpa")
    randomize_parameters(attn, 1)
    cache = relpos.KVCache()
    prompt = Positions.from_padding_mask(torch.tensor([[False] * 2 + [True] * 6, [True] * 8]))
    with torch.no_grad():
        attn(torch.randn(2, 8, 16), positions=prompt, cache=cache)
        with SyncCalls() as syncs:
            attn(torch.randn(2, 1, 16), cache=cache)
    assert syncs.calls == []


class IndexSinusoid(relpos.Sinusoidal):
    """A deliberately wrong scheme: encodes array indices, not positions."""

    def embed(self, positions):
        return super().embed(Positions.from_length(len(positions)))


def test_the_checks_catch_a_scheme_that_reads_array_indices():
    """Relative terms computed from index differences survive padding and packing (masked pairs
    aside, index and position differences agree); absolute ones do not, and caches break both."""
    model = tiny_model({"name": "sinusoidal"}, causal=True)
    model.embed.scheme = IndexSinusoid(d_model=16, num_heads=1, causal=False)
    rng = random.Random(5)
    docs = random_docs(rng, 3, lo=3)
    assert checks.padded_gap(model, docs, side="left") > 1e-3
    assert checks.packed_gap(model, [docs]) > 1e-3
    assert checks.cached_gap(model, torch.randint(0, VOCAB, (2, 8))) > 1e-3


class NaNAfterFirst(Transformer):
    """A broken model: NaN in every row of a batch but the first, and in every step a cache has
    seen tokens before (the first row and the first step stay right)."""

    def forward(self, tokens, *args, cache=None, **kwargs):
        seen = cache is not None and len(cache[0]) > 0  # a list of KVCache, one per layer
        out = super().forward(tokens, *args, cache=cache, **kwargs).clone()
        out[1:] = math.nan
        return out.fill_(math.nan) if seen else out


def test_the_checks_report_nan():
    """A gap that is NaN anywhere is NaN (so ``gap < tol`` fails), not dropped by ``max``."""
    model = NaNAfterFirst(tiny_model({"name": "alibi"}, causal=True).cfg).eval()
    docs = random_docs(random.Random(2), 3, lo=3)
    assert math.isnan(checks.padded_gap(model, docs, side="left"))
    assert math.isnan(checks.packed_gap(model, [docs[:1], docs[1:]]))
    assert math.isnan(checks.cached_gap(model, torch.randint(0, VOCAB, (1, 6))))
    prompts, more = docs, torch.randint(0, VOCAB, (3, 2))
    assert math.isnan(checks.left_padded_decoding_gap(model, prompts, more))


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
def test_config_round_trip(spec):
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=True)
    data = json.loads(json.dumps(scheme.get_config()))
    again = relpos.make_scheme(data, d_model=16, num_heads=2, causal=True)
    assert again.config == scheme.config
    assert relpos.config_from_dict(data) == scheme.config
    cfg = tiny_model(spec, True).cfg
    assert TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
def test_state_dict_round_trip(spec):
    a, b = tiny_model(spec, True, seed=0), tiny_model(spec, True, seed=1)
    tokens = torch.randint(0, VOCAB, (2, 7))
    assert not torch.allclose(a(tokens), b(tokens))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(tokens), a(tokens))
    # Caches (ALiBi's fixed slopes, fixed RoPE frequencies) are rebuilt, never saved; learned
    # frequencies and slopes are weights.
    saved_freq = any(".inv_freq" in k for k in a.state_dict())
    assert saved_freq == bool(spec.get("learned_freq"))
    saved_slopes = any(".slopes" in k for k in a.state_dict())
    assert saved_slopes == (spec["name"] == "learned_alibi")


@pytest.mark.parametrize("spec", [s for s in SCHEME_SPECS if absolute(s)], ids=spec_id)
def test_attention_refuses_an_absolute_scheme(spec):
    """Issue 45 item 3: an absolute scheme in an attention layer did nothing (the output equalled
    NoPE's, the table was a dead parameter and ``max_len`` was never checked): refused, naming
    where it acts, as the Keras layer does."""
    with pytest.raises(ValueError, match=rf"'{spec['name']}' is absolute.*TokenPositionEmbedding"):
        relpos.MultiheadAttention(16, 2, spec, causal=True)
    built = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=False)
    with pytest.raises(ValueError, match="absolute"):
        relpos.MultiheadAttention(16, 2, built)


@pytest.mark.parametrize("spec", ATTENTION_SPECS, ids=spec_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.matrix
def test_attention_dtypes_and_shapes(spec, dtype):
    attn = relpos.MultiheadAttention(16, 2, spec, causal=True).to(dtype)
    x = torch.randn(3, 5, 16, dtype=dtype)
    y = attn(
        x, padding_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]]).bool()
    )
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert torch.all(y[1, :2] == 0) and torch.all(y[2, 2:] == 0)


@pytest.mark.parametrize("spec", ATTENTION_SPECS, ids=spec_id)
def test_fully_masked_rows_give_zeros_and_finite_gradients(spec):
    attn = relpos.MultiheadAttention(16, 2, spec, causal=causal_only(spec))
    randomize_parameters(attn)
    x = torch.randn(2, 4, 16, requires_grad=True)
    mask = torch.tensor([[False] * 4, [True, True, False, False]])
    y = attn(x, padding_mask=mask)
    assert torch.all(y[0] == 0) and torch.all(y[1, 2:] == 0)
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters() if p.grad is not None)


def test_bf16_bias_does_not_overflow():
    """Long distances make large ALiBi/T5 biases: computed in float32, they stay finite in bf16."""
    attn = relpos.MultiheadAttention(16, 2, "alibi", causal=True).to(torch.bfloat16)
    pos = Positions.from_length(4, offset=60000)  # distances stay small, positions are huge
    y = attn(torch.randn(1, 4, 16, dtype=torch.bfloat16), pos)
    assert torch.isfinite(y).all()


#: torch.compile is slow to run (seconds a spec): by default one spec per kind of graph (a
#: relative table with a value term, a distance function, a per-pair MLP, rotation after the
#: cache, positions from the layer input); the others under ``make test-all``.
COMPILE_DEFAULT = [
    {"name": "shaw", "max_distance": 2},  # a relative table: logits and the value term
    {"name": "alibi"},  # a distance function
    {"name": "fire", "hidden": 8, "init_threshold": 4.5},  # a per-pair MLP: custom autograd
    next(s for s in SCHEME_SPECS if length_dependent(s)),  # RoPE: rotation after the cache
    {"name": "forgetting"},  # positions from the layer input
]
COMPILE_SPECS = [
    s if s in COMPILE_DEFAULT else pytest.param(s, marks=pytest.mark.slow) for s in SCHEME_SPECS
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("spec", COMPILE_SPECS, ids=spec_id)
def test_torch_compile_smoke(spec):
    model = tiny_model(spec, True)
    tokens = torch.randint(0, VOCAB, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]).bool()
    compiled = torch.compile(model, dynamic=False)
    torch.testing.assert_close(
        compiled(tokens, padding_mask=mask), model(tokens, padding_mask=mask)
    )


@pytest.mark.parametrize(
    "spec",
    [
        s
        for s in SCHEME_SPECS
        if s["name"]
        in (
            "shaw",
            "music",
            "t5",
            "learned",
            "kerple",
            "learned_alibi",
            "dpb",
            "transformer_xl",
            "deberta",
            "forgetting",
            "cope",
            "fire",
        )
        or s.get("learned_freq")
    ],
    ids=spec_id,
)
def test_gradcheck_learned_tables(spec):
    """float64 finite differences agree with autograd for every learned table."""
    causal = True
    scheme = relpos.make_scheme(spec, d_model=4, num_heads=2, causal=causal).double()
    randomize_parameters(scheme)
    pos = Positions.from_segments(torch.tensor([[-1, 0, 0, 0, 1, 1]]))
    q, k, v = (torch.randn(1, 2, 6, 2, dtype=torch.float64) for _ in range(3))
    names = [n for n, _ in scheme.named_parameters()]
    assert names

    probe = _Probe(scheme, causal)

    def f(*tables):
        params = {f"scheme.{n}": t for n, t in zip(names, tables, strict=True)}
        return torch.func.functional_call(probe, params, (q, k, v, pos))

    tables = tuple(p.detach().clone().requires_grad_(True) for p in scheme.parameters())
    assert torch.autograd.gradcheck(f, tables, eps=1e-6, atol=1e-5)


class _Probe(torch.nn.Module):
    """What a learned table feeds: the embedding, or attention through the scheme's hooks."""

    def __init__(self, scheme: relpos.Scheme, causal: bool) -> None:
        super().__init__()
        self.scheme, self.causal = scheme, causal

    def forward(self, q, k, v, pos):
        if "embed" in self.scheme.hooks:
            return self.scheme.embed(pos)
        if "contextualize" in self.scheme.hooks:  # the gates read a fixed layer input
            x = torch.linspace(-2, 2, len(pos) * self.scheme.d_model, dtype=q.dtype)
            pos = self.scheme.contextualize(x.view(1, len(pos), -1), pos)
        q, k = self.scheme.rotate(q, k, pos, pos)
        return relpos.eager_attention(q, k, v, self.scheme, pos, pos, causal=self.causal)


def test_fixed_encodings_get_unit_scale_token_embeddings():
    """A sinusoid has unit amplitude: token embeddings must match it (Vaswani et al. §3.4), or
    positions swamp tokens at the start of training. Learned tables keep the small init."""
    fixed = relpos.TokenPositionEmbedding(50, 64, "sinusoidal")
    learned = relpos.TokenPositionEmbedding(50, 64, "learned")
    tokens = torch.arange(50).unsqueeze(0)
    pos = Positions.from_length(50)
    token_part = fixed(tokens, pos) - fixed.scheme.embed(pos)
    assert 0.8 < token_part.std().item() < 1.2
    assert learned.scale == 1.0 and learned.tokens.weight.std().item() < 0.05
