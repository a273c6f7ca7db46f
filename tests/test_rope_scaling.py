"""RoPE scalings: frequencies pinned to each formula, equal to Hugging Face's where it is
installed, configs pasted from checkpoints, and clear errors for what is not supported.

The per-row properties (padded, packed, cached) and the loop oracle run through the shared suites:
``tests/helpers.SCHEME_SPECS`` holds a YaRN spec, and ``tests/oracles.rope_frequency`` computes
every scaling pair by pair.
"""

import math

import pytest
import torch

import relpos
from relpos.functional.rope_scaling import check_rope_scaling, scaled_rope_frequencies
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
        ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported yet"),
        (
            {"rope_type": "longrope", "short_factor": [1], "long_factor": [2]},
            "'longrope' is not supported yet",
        ),
        ({"rope_type": "su", "factor": 2.0}, r"unknown rope_type 'su'; supported: \["),
        ({"factor": 2.0}, "unknown rope_type None"),
        (
            {"rope_type": "yarn", "factor": 2.0},
            r"needs key\(s\) \['original_max_position_embeddings'\]",
        ),
        ({"rope_type": "linear", "factor": 2.0, "beta": 1}, r"unknown key\(s\) \['beta'\]"),
        ({"rope_type": "linear", "factor": 0}, "factor must be a number > 0"),
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
            "high_freq_factor must exceed",
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
