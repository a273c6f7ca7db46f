"""DeBERTa's disentangled attention (He et al., 2021): the loop oracle on random configs and shapes,
every backend equal to ``eager``, the log buckets and the self-attention layer equal to HF's
``DebertaV2`` (where ``transformers`` is installed), the key-term hook's contract and routing, and
config errors. The shared suites (``SCHEME_SPECS``) run three variants through the oracle,
conformance (padded, packed, cached, compile, gradcheck) and backend parity."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import Positions
from relpos.attention.auto import choose_backend
from relpos.attention.backends import BACKENDS
from relpos.attention.chunked import chunked_attention, chunked_path, chunked_supports
from relpos.attention.flex import flex_supports
from relpos.attention.sdpa import sdpa_supports
from relpos.functional import deberta_buckets, deberta_index, gather_relative
from relpos.schemes.base import SchemeConfig
from tests.test_backends import MaxNumel, assert_same, run_case
from tests.test_oracle import check_against_oracle

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.usefixtures("one_thread"),
]


@st.composite
def configs(draw) -> dict:
    """A random DeBERTa config whose buckets and clipping short sequences reach."""
    terms = draw(st.sampled_from([["c2p", "p2c"], ["c2p"], ["p2c"]]))
    buckets = draw(st.sampled_from([0, 2, 4, 6]))
    return {
        "name": "deberta",
        "pos_att_type": terms,
        "position_buckets": buckets,
        "max_relative_positions": draw(st.integers(buckets // 2 + 2, 12)),
        "share_att_key": draw(st.booleans()),
        "norm_rel_ebd": draw(st.sampled_from(["none", "layer_norm"])),
    }


FEW = settings(max_examples=6, deadline=None, derandomize=True, database=None)
#: A backend case takes ~40 ms: more of them cover the configs × backends × layouts.
MANY = settings(max_examples=30, deadline=None, derandomize=True, database=None)


# ------------------------------------------------------------------------------ the paper's formula
@FEW
@given(spec=configs(), seed=st.integers(0, 2**16), causal=st.booleans(), cached=st.booleans())
def test_matches_the_loop_oracle(spec, seed, causal, cached):
    """``eager`` equals the loop over (i, j) of ``(q·k + q·K_r[δ] + k·Q_r[δ]) / √(s·d)``, outputs
    and gradients (q, k, v, the table, its LayerNorm and the projections)."""
    check_against_oracle(spec, causal or cached, seed, cached=cached)


@MANY
@given(
    spec=configs(),
    backend=st.sampled_from(["sdpa", "chunked", "chunked-tiles", "auto"]),
    layout=st.sampled_from(["plain", "left-pad", "packed", "cached"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_backend_matches_eager(spec, backend, layout, causal, seed):
    results, _ = run_case(backend, spec, causal or layout == "cached", layout, seed=seed)
    assert_same(results, atol=1e-9, rtol=1e-9)


def test_the_content_term_is_scaled_by_the_number_of_terms():
    """Only the queries change in ``rotate``: by ``1/√s``, ``s = 3`` with both terms, 2 with one."""
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    pos = Positions.from_length(3)
    for terms, s in ((["c2p", "p2c"], 3), (["p2c"], 2)):
        spec = {"name": "deberta", "pos_att_type": terms}
        scheme = relpos.make_scheme(spec, d_model=8, num_heads=2, causal=False)
        qr, kr = scheme.rotate(q, k, pos, pos)
        torch.testing.assert_close(qr, q / math.sqrt(s))
        assert kr is k


# ------------------------------------------------------------------------------ HF parity
HF_BUCKETS = [(256, 512), (8, 20), (2, 5), (32, 128), (7, 100), (256, 300)]


@pytest.mark.parametrize(("buckets", "max_position"), HF_BUCKETS)
def test_buckets_equal_hf(buckets, max_position):
    hf = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")
    x = torch.arange(-1500, 1501)
    ours = deberta_buckets(x, position_buckets=buckets, max_relative_positions=max_position)
    assert torch.equal(ours, hf.make_log_bucket_position(x, buckets, max_position).long())
    # build_relative_position: query index minus key index, bucketed, for 40 queries × 60 keys
    layer = torch.zeros(1, 60, 4)
    rel = hf.build_relative_position(layer[:, :40], layer, buckets, max_position)
    i, j = torch.arange(40)[:, None], torch.arange(60)[None]
    ours = deberta_buckets(i - j, position_buckets=buckets, max_relative_positions=max_position)
    assert torch.equal(rel[0], ours)


def _hf_layer(terms, buckets, max_position, share):
    """HF's encoder (for its relative table and LayerNorm) and its first self-attention."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Encoder

    config = transformers.DebertaV2Config(
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=8,
        relative_attention=True,
        pos_att_type=terms,
        position_buckets=buckets,
        max_relative_positions=max_position,
        share_att_key=share,
        norm_rel_ebd="layer_norm",
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    encoder = DebertaV2Encoder(config).eval()
    with torch.no_grad():
        for p in encoder.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return encoder, encoder.layer[0].attention.self


def load_hf(attn: relpos.MultiheadAttention, encoder, hf_attention) -> None:
    """Copy HF's weights: q, k, v into the fused projection (the output projection is the
    identity: HF's self-attention returns the context), the relative table and its LayerNorm,
    and the position projections (the layer's query and key ones with ``share_att_key``)."""
    scheme = attn.scheme
    with torch.no_grad():
        hf = {n: getattr(hf_attention, n) for n in ("query_proj", "key_proj", "value_proj")}
        attn.qkv.weight.copy_(torch.cat([hf[n].weight for n in hf]))
        attn.qkv.bias.copy_(torch.cat([hf[n].bias for n in hf]))
        attn.out.weight.copy_(torch.eye(attn.out.weight.shape[0]))
        attn.out.bias.zero_()
        scheme.rel_embeddings.copy_(encoder.rel_embeddings.weight)
        scheme.layer_norm.load_state_dict(encoder.LayerNorm.state_dict())
        for name, module in scheme.projections.items():
            module.load_state_dict(getattr(hf_attention, name).state_dict())


HF_CASES = [
    (["c2p", "p2c"], 8, 20, True),
    (["c2p", "p2c"], 8, 20, False),
    (["c2p"], 8, 20, True),
    (["c2p"], 4, 12, False),
    (["p2c"], 6, 10, True),
    (["c2p", "p2c"], -1, 6, False),  # HF's -1: no buckets (ours: 0)
]


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked"])
@pytest.mark.parametrize(("terms", "buckets", "max_position", "share"), HF_CASES, ids=str)
def test_equals_hf_self_attention(terms, buckets, max_position, share, backend):
    """A right-padded batch of 3 rows of up to 30 tokens (distances past the buckets and the
    clipping): every real token's output equals HF's ``DisentangledSelfAttention``."""
    encoder, hf_attention = _hf_layer(terms, buckets, max_position, share)
    spec = {
        "name": "deberta",
        "pos_att_type": terms,
        "position_buckets": max(buckets, 0),
        "max_relative_positions": max_position,
        "share_att_key": share,
    }
    attn = relpos.MultiheadAttention(16, 2, spec, causal=False, backend=backend).eval()
    assert set(attn.scheme.projections) == {
        ("key_proj" if share else "pos_key_proj") if t == "c2p" else
        ("query_proj" if share else "pos_query_proj")
        for t in terms
    }  # fmt: skip
    load_hf(attn, encoder, hf_attention)
    x = torch.randn(3, 30, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 30, dtype=torch.bool)
    mask[1, 21:] = False
    mask[2, 9:] = False
    with torch.no_grad():
        ref = hf_attention(
            x, encoder.get_attention_mask(mask.long()), rel_embeddings=encoder.get_rel_embedding()
        )[0]
        out = attn(x, padding_mask=mask)
    torch.testing.assert_close(out[mask], ref[mask], atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the key-term hook
def test_key_bias_is_the_transposed_gather_of_the_key_logits():
    scheme = relpos.make_scheme(
        {"name": "deberta", "position_buckets": 4, "max_relative_positions": 8},
        d_model=8,
        num_heads=2,
        causal=False,
    ).double()
    k = torch.randn(2, 2, 7, 4, dtype=torch.float64)
    pos = Positions.from_segments(torch.tensor([[0, 0, 0, 1, 1, -1, 1], [0] * 7]))
    rel_k = scheme.relative_key_logits(k)
    assert rel_k.shape == (2, 2, 7, scheme.num_relative)
    index = scheme.relative_index(pos, pos)
    bias = scheme.key_bias(torch.zeros_like(k), k, pos, pos)
    for b in range(2):
        for i in range(7):
            for j in range(7):
                torch.testing.assert_close(bias[b, :, i, j], rel_k[b, :, j, index[b, i, j]])
    torch.testing.assert_close(
        bias, gather_relative(rel_k, index.transpose(-1, -2)).transpose(-1, -2)
    )


def test_index_reads_positions_not_array_indices():
    """``δ(i, j)`` of a packed row restarts with each document, and is ``bucket(p_i - p_j)``."""
    scheme = relpos.make_scheme(
        {"name": "deberta", "position_buckets": 4, "max_relative_positions": 8},
        d_model=8,
        num_heads=2,
        causal=False,
    )
    packed = Positions.from_segments(torch.tensor([[0] * 10 + [1] * 10]))
    alone = Positions.from_length(10)
    index = scheme.relative_index(packed, packed)
    assert torch.equal(index[0, 10:, 10:], scheme.relative_index(alone, alone)[0])
    rel = torch.arange(10)[:, None] - torch.arange(10)[None]
    expected = deberta_index(rel, position_buckets=4, max_relative_positions=8)
    assert torch.equal(index[0, :10, :10], expected)


def test_chunked_builds_no_b_h_i_j_tensor():
    """Forward and backward on the tiles path: the largest tensor is a tile, or the key term
    ``(b, h, j, R)``, never ``(b, h, i, j)``."""
    n, h, d, qb, kb = 2048, 2, 8, 64, 128
    spec = {"name": "deberta", "position_buckets": 32, "max_relative_positions": 128}
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=False)
    pos = Positions.from_lengths([[n // 2, n // 2]], n)
    q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
    assert chunked_path(scheme, q, pos, pos) == "tiles"
    with MaxNumel() as mode:
        out = chunked_attention(q, k, v, scheme, pos, pos, causal=False, q_block=qb, k_block=kb)
        out.sum().backward()
    assert mode.max <= max(h * n * scheme.num_relative, h * qb * kb) < h * n * n // 8
    assert all(p.grad is not None for p in scheme.parameters())


@dataclass(frozen=True)
class _GateConfig(SchemeConfig):
    name = "test-key-gate"


class KeyGate(relpos.Scheme):
    """A key term with no relative form (it reads every key: a cumulative gate, CoPE-like)."""

    config_class = _GateConfig
    hooks = frozenset({"key_bias"})

    def key_bias(self, q, k, q_positions, k_positions):
        return torch.sigmoid(q @ k.transpose(-1, -2)).cumsum(-1).float()


def test_a_key_bias_without_relative_form_is_routed_to_sdpa():
    scheme = KeyGate(d_model=8, num_heads=2, causal=False)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    pos = Positions.from_length(6)
    assert not chunked_supports(scheme) and sdpa_supports(scheme)
    assert not flex_supports(scheme, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="key bias of scheme KeyGate"):
        chunked_attention(q, k, v, scheme, pos, pos, causal=False)
    long_q = torch.randn(1, 2, 1024, 4)
    long_pos = Positions.from_length(1024)
    for grad in (False, True):
        assert choose_backend(scheme, long_q, long_pos, long_pos, needs_grad=grad) == "sdpa"
    ref = BACKENDS["eager"](q, k, v, scheme, pos, pos, causal=False)
    for name in ("sdpa", "auto"):
        torch.testing.assert_close(BACKENDS[name](q, k, v, scheme, pos, pos, causal=False), ref)


@pytest.mark.slow  # compiles FlexAttention (~20 s); test_backends' slow flex cases cover it too
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_flex_adds_the_key_term_in_inference():
    from relpos.attention.flex import flex_attention_backend, flex_available

    if not flex_available():
        pytest.skip("FlexAttention is not available in this torch")
    spec = {"name": "deberta", "pos_att_type": ["p2c"], "position_buckets": 6}
    scheme = relpos.make_scheme(spec, d_model=16, num_heads=2, causal=False)
    assert flex_supports(scheme, device=torch.device("cpu"))
    pos = Positions.from_segments(torch.tensor([[0] * 20 + [1] * 12, [-1] * 4 + [0] * 28]))
    q, k, v = (torch.randn(2, 2, 32, 8) for _ in range(3))
    with torch.no_grad():
        ref = BACKENDS["eager"](q, k, v, scheme, pos, pos, causal=False)
        try:
            out = flex_attention_backend(q, k, v, scheme, pos, pos, causal=False)
        except Exception as e:  # no C++ compiler, unsupported build
            if isinstance(e, ValueError):
                raise
            pytest.skip(f"FlexAttention does not compile here: {type(e).__name__}: {e}")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"pos_att_type": ["c2p", "x2y"]}, ValueError, "pos_att_type must be a non-empty subset"),
        ({"pos_att_type": []}, ValueError, "pos_att_type"),
        ({"pos_att_type": ["c2p", "c2p"]}, ValueError, "without repeats"),
        ({"pos_att_type": [1]}, TypeError, "pos_att_type must be a list of strings"),
        ({"position_buckets": -1}, ValueError, "position_buckets must be >= 0"),
        ({"position_buckets": 1}, ValueError, "position_buckets must be 0"),
        ({"position_buckets": 256, "max_relative_positions": 129}, ValueError, "position_buckets"),
        ({"max_relative_positions": 0}, ValueError, "max_relative_positions must be >= 1"),
        ({"share_att_key": 1}, TypeError, "share_att_key must be a bool"),
        ({"norm_rel_ebd": "rms"}, ValueError, "norm_rel_ebd must be one of"),
        ({"layer_norm_eps": 0.0}, ValueError, "layer_norm_eps must be a finite number > 0"),
    ],
)
def test_bad_config_names_the_field(fields, error, match):
    with pytest.raises(error, match=match):
        relpos.DebertaConfig(**fields)


def test_config_accepts_hf_spellings():
    """HF's ``"p2c|c2p"`` string and any order give the canonical tuple; JSON lists round-trip."""
    a = relpos.DebertaConfig(pos_att_type="p2c|c2p")
    b = relpos.config_from_dict({"name": "deberta", "pos_att_type": ["p2c", "c2p"]})
    assert a == b and a.pos_att_type == ("c2p", "p2c")
    assert relpos.DebertaConfig(position_buckets=0, max_relative_positions=7).span == 7
    scheme = relpos.make_scheme("deberta", d_model=16, num_heads=2, causal=False)
    assert scheme.num_relative == 512 and scheme.hooks == {"rotate", "score_bias", "key_bias"}
