"""RoPE scalings: frequencies pinned to each formula, equal to Hugging Face's where it is
installed, configs pasted from checkpoints, and clear errors for what is not supported.

The per-row properties (padded, packed, cached) and the loop oracle run through the shared suites:
``tests/helpers.SCHEME_SPECS`` holds a YaRN spec, and ``tests/oracles.rope_frequency`` computes
every scaling pair by pair.
"""

import json
import math

import pytest
import torch

import relpos
from relpos import Positions
from relpos.functional.rope_scaling import (
    check_rope_scaling,
    scaled_rope_frequencies,
    sequence_rope_frequencies,
)
from relpos.schemes.rope import RotaryConfig
from tests.oracles import rope_attention_factor, rope_frequency

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "ntk", "factor": 8.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
@pytest.mark.parametrize(("r", "theta"), [(64, 10000.0), (16, 500000.0)])
def test_frequencies_equal_the_oracle(scaling, r, theta):
    normal = check_rope_scaling(scaling, theta=theta)
    inv, factor = scaled_rope_frequencies(r, theta, normal)
    want = torch.tensor([rope_frequency(m, r, theta, normal) for m in range(r // 2)])
    torch.testing.assert_close(inv, want, rtol=1e-6, atol=0)
    if "mscale" not in scaling:
        assert factor == pytest.approx(rope_attention_factor(normal))


def test_pinned_values():
    # Linear: every frequency divided by the factor.
    inv, _ = scaled_rope_frequencies(8, 10000.0, check_rope_scaling(SCALINGS[0], theta=1e4))
    torch.testing.assert_close(inv, torch.tensor([1.0, 0.1, 0.01, 0.001]) / 4)
    # NTK: the fastest pair kept, the slowest divided by the factor exactly.
    inv, _ = scaled_rope_frequencies(8, 10000.0, check_rope_scaling(SCALINGS[1], theta=1e4))
    assert inv[0] == 1.0 and inv[-1].item() == pytest.approx(0.001 / 8, rel=1e-6)
    # Llama 3.1 (factor 8, bands 8192/4 and 8192/1): wavelengths under 2048 kept, over 8192 ÷ 8.
    llama = check_rope_scaling(SCALINGS[-1], theta=500000.0)
    base, _ = scaled_rope_frequencies(128, 500000.0, None)
    inv, factor = scaled_rope_frequencies(128, 500000.0, llama)
    wavelength = 2 * math.pi / base
    assert factor == 1.0
    assert torch.equal(inv[wavelength < 2048], base[wavelength < 2048])
    torch.testing.assert_close(inv[wavelength > 8192], base[wavelength > 8192] / 8)
    mid = (wavelength >= 2048) & (wavelength <= 8192)
    assert mid.any() and ((inv[mid] < base[mid]) & (inv[mid] > base[mid] / 8)).all()
    # YaRN (factor 4, L=64, d=16): dims up to floor(d(32 turns)) kept, from ceil(d(1 turn)) ÷ 4.
    yarn = check_rope_scaling(SCALINGS[2], theta=1e4)
    base, _ = scaled_rope_frequencies(16, 1e4, None)
    inv, factor = scaled_rope_frequencies(16, 1e4, yarn)
    lo = math.floor(16 * math.log(64 / (32 * 2 * math.pi)) / (2 * math.log(1e4)))
    hi = math.ceil(16 * math.log(64 / (2 * math.pi)) / (2 * math.log(1e4)))
    assert (max(lo, 0), hi) == (0, 3)
    assert inv[0] == base[0]
    torch.testing.assert_close(inv[hi:], base[hi:] / 4)
    assert factor == pytest.approx(0.1 * math.log(4) + 1)


@pytest.mark.parametrize(
    "scaling", [s for s in SCALINGS if s["rope_type"] != "ntk"], ids=lambda s: s["rope_type"]
)
def test_frequencies_equal_hugging_face(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = 10000.0
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=65536,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    want, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    got, factor = scaled_rope_frequencies(64, theta, check_rope_scaling(scaling, theta=theta))
    torch.testing.assert_close(got, want.float(), rtol=2e-6, atol=0)
    assert factor == pytest.approx(want_factor)


def test_a_checkpoint_config_pastes_as_is():
    # Llama 3.1's rope_scaling, HF's older "type" key, and v5's rope_parameters with rope_theta.
    llama31 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    for scaling in (
        llama31,
        {"type": "linear", "factor": 2.0},
        {**llama31, "rope_theta": 500000.0},
    ):
        config = relpos.schemes.RotaryConfig(theta=500000.0, scaling=scaling)
        again = relpos.schemes.config_from_dict(config.to_dict())
        assert again == config and hash(again) == hash(config)
        scheme = relpos.make_scheme(config.to_dict(), d_model=64, num_heads=2, causal=True)
        assert scheme.inv_freq.dtype == torch.float32


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        (
            {"rope_type": "dynamic", "factor": 2.0},
            r"needs key\(s\) \['original_max_position_embeddings'\]",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [2.0],
                "original_max_position_embeddings": 8,
            },
            "needs factor, attention_factor or max_position_embeddings",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0, -1.0],
                "long_factor": [2.0, 2.0],
                "original_max_position_embeddings": 8,
                "factor": 2.0,
            },
            r"short_factor\[1\] must be a finite number > 0, got -1.0",
        ),
        (
            {
                "rope_type": "longrope",
                "short_factor": 1.0,
                "long_factor": [2.0],
                "original_max_position_embeddings": 8,
                "factor": 2.0,
            },
            "short_factor must be a non-empty list of numbers",
        ),
        ({"rope_type": "su", "factor": 2.0}, r"unknown rope_type 'su'; supported: \["),
        ({"factor": 2.0}, "unknown rope_type None"),
        (
            {"rope_type": "yarn", "factor": 2.0},
            r"needs key\(s\) \['original_max_position_embeddings'\]",
        ),
        ({"rope_type": "linear", "factor": 2.0, "beta": 1}, r"unknown key\(s\) \['beta'\]"),
        ({"rope_type": "linear", "factor": 0}, "factor must be a finite number > 0"),
        ({"rope_type": "linear", "factor": float("inf")}, "factor must be a finite number > 0"),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, "differs from theta"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "set rotary_dim"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
            r"high_freq_factor \(1.0\) must exceed low_freq_factor \(4.0\)",
        ),
    ],
)
def test_bad_scalings_are_refused(scaling, match):
    with pytest.raises(ValueError, match=match):
        relpos.schemes.RotaryConfig(scaling=scaling)


def test_rope_doc_example_runs():
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "rope.md"
    for block in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S):
        exec(compile(block, str(doc), "exec"), {})


# ------------------------------------------------------------------ length-dependent scalings
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + m / 8 for m in range(8)],
    "long_factor": [1.0 + m for m in range(8)],
    "original_max_position_embeddings": 64,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize("scaling", [DYNAMIC, LONGROPE], ids=lambda s: s["rope_type"])
def test_length_dependent_frequencies_equal_the_oracle(scaling):
    normal = check_rope_scaling(scaling, theta=1e4)
    lengths = torch.tensor([[1, 63, 64, 65, 100, 1000]])
    got = sequence_rope_frequencies(16, 1e4, normal, lengths)
    want = torch.tensor(
        [[[rope_frequency(m, 16, 1e4, normal, length=n) for m in range(8)] for n in lengths[0]]]
    )
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    # Up to the original context: exactly the static frequencies.
    static, factor = scaled_rope_frequencies(16, 1e4, normal)
    assert torch.equal(got[0, 2], static) and not torch.equal(got[0, 3], static)
    assert factor == pytest.approx(rope_attention_factor(normal))


def test_length_dependent_pinned_values():
    # Dynamic NTK, twice the original length, factor 4: base θ·(4·2 - 3)^(r/(r-2)) = θ·5^(8/6).
    normal = check_rope_scaling(DYNAMIC, theta=1e4)
    inv = sequence_rope_frequencies(8, 1e4, normal, torch.tensor([[128]]))[0, 0]
    base = 1e4 * 5 ** (8 / 6)
    torch.testing.assert_close(inv, torch.tensor([base ** (-m / 4) for m in range(4)]).float())
    # LongRoPE: the long factors past 64 tokens, and √(1 + ln 4 / ln 64) on q and k.
    normal = check_rope_scaling(LONGROPE, theta=1e4)
    inv = sequence_rope_frequencies(16, 1e4, normal, torch.tensor([[65]]))[0, 0]
    torch.testing.assert_close(inv[3], torch.tensor(1e4 ** (-6 / 16) / 4.0))
    _, factor = scaled_rope_frequencies(16, 1e4, normal)
    assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))


@pytest.mark.parametrize("scaling", [DYNAMIC, LONGROPE], ids=lambda s: s["rope_type"])
@pytest.mark.parametrize("length", [40, 64, 65, 300])
def test_length_dependent_frequencies_equal_hugging_face(scaling, length):
    """HF computes them for the batch's longest row; per row, ours equal HF's for that length."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = 10000.0
    hf_scaling = {k: v for k, v in scaling.items() if k != "max_position_embeddings"}
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        # HF's dynamic NTK reads the original context from max_position_embeddings.
        max_position_embeddings=scaling.get("max_position_embeddings", 64),
        rope_parameters={**hf_scaling, "rope_theta": theta},
    )
    want, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, seq_len=length)
    normal = check_rope_scaling(scaling, theta=theta)
    got = sequence_rope_frequencies(16, theta, normal, torch.tensor([[length]]))[0, 0]
    torch.testing.assert_close(got, want.float(), rtol=2e-6, atol=0)
    assert scaled_rope_frequencies(16, theta, normal)[1] == pytest.approx(want_factor)


def _decode_left_padded(attn, x, lengths):
    """Prefill left-padded prompts (the first 3 tokens of each row's sequence), then decode the
    rest one token a step; return each row's outputs for its real tokens."""
    b, n, _ = x.shape
    prompt = 3
    mask = torch.zeros(b, prompt, dtype=torch.bool)
    tokens = torch.zeros(b, prompt, x.shape[-1])
    for r, length in enumerate(lengths):
        start = n - length  # each row's sequence is the tail of x[r]
        mask[r], tokens[r] = True, x[r, start : start + prompt]
    cache = relpos.KVCache()
    outs = [attn(tokens, padding_mask=mask, cache=cache)]
    for t in range(prompt, min(lengths)):
        step = torch.stack([x[r, n - length + t] for r, length in enumerate(lengths)])[:, None]
        outs.append(attn(step, cache=cache))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("scaling", [DYNAMIC, LONGROPE], ids=lambda s: s["rope_type"])
@pytest.mark.parametrize("backend", sorted(relpos.BACKENDS))
def test_dynamic_decoding_equals_the_full_forward_per_row(scaling, backend):
    """A left-padded batch of rows of different lengths crosses the original context (8 tokens
    here) while decoding: every step equals that row's full forward over its prefix, alone."""
    scaling = {**scaling, "original_max_position_embeddings": 8}
    if scaling["rope_type"] == "longrope":
        scaling = {**scaling, "short_factor": [1.0, 1.5], "long_factor": [3.0, 5.0]}
    spec = {"name": "rope", "rotary_dim": 4, "scaling": scaling}
    torch.manual_seed(0)
    attn = relpos.MultiheadAttention(16, 2, spec, causal=True, backend=backend).eval()
    lengths = [14, 11]
    x = torch.randn(2, 14, 16)
    with torch.no_grad():
        got = _decode_left_padded(attn, x, lengths)
        for r, length in enumerate(lengths):
            seq = x[r : r + 1, 14 - length :]
            for t in range(got.shape[1]):
                want = attn(seq[:, : t + 1])[0, -1]
                torch.testing.assert_close(got[r, t], want, atol=1e-5, rtol=1e-5)


def test_rotating_cached_keys_once_would_disagree():
    """The choice matters: keys rotated once, with the frequencies of the row's length when they
    arrived (Hugging Face's cache), differ from the full forward once the row is long."""
    spec = {"name": "rope", "scaling": {**DYNAMIC, "original_max_position_embeddings": 4}}
    torch.manual_seed(0)
    attn = relpos.MultiheadAttention(16, 2, spec, causal=True, backend="eager").eval()
    x = torch.randn(1, 10, 16)
    with torch.no_grad():
        want = attn(x)[0, -1]
        for rotate_all in (True, False):
            attn.scheme.rotates_cached_keys = rotate_all
            cache = relpos.KVCache()
            got = [attn(x[:, t : t + 1], cache=cache) for t in range(10)][-1][0, 0]
            gap = (got - want).abs().max().item()
            assert gap < 1e-5 if rotate_all else gap > 1e-3


def test_packed_documents_get_their_own_length():
    """Two documents of 10 and 3 tokens in one row: only the long one is scaled."""
    normal = check_rope_scaling({**DYNAMIC, "original_max_position_embeddings": 4}, theta=1e4)
    pos = Positions.from_segments(torch.tensor([[0] * 10 + [1] * 3 + [-1]]))
    (lengths,) = relpos.sequence_lengths(pos)
    assert lengths.tolist() == [[10] * 10 + [3] * 3 + [0]]
    inv = sequence_rope_frequencies(8, 1e4, normal, lengths)
    static, _ = scaled_rope_frequencies(8, 1e4, normal)
    assert torch.equal(inv[0, 10], static) and not torch.equal(inv[0, 0], static)


def test_length_dependent_config_round_trip_and_errors():
    config = RotaryConfig(scaling=LONGROPE)
    assert config.length_dependent and isinstance(config.scaling_dict["long_factor"], tuple)
    again = relpos.config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and hash(again) == hash(config)
    with pytest.raises(
        ValueError, match="learned_freq cannot be combined with rope_type 'dynamic'"
    ):
        RotaryConfig(scaling=DYNAMIC, learned_freq=True)
    with pytest.raises(ValueError, match=r"short_factor has 8 entries; rotary_dim 8 needs one per"):
        relpos.make_scheme(
            {"name": "rope", "scaling": LONGROPE}, d_model=16, num_heads=2, causal=True
        )
