"""Multi-axis positions and the rotary embeddings that read them: M-RoPE and axial RoPE.

* ``Positions`` with coordinates: ``from_grids`` by hand, ``with_coords`` checks, every method
  carries them, the M-RoPE continuation rule, clear errors;
* a loop oracle from the formulas (pair ``m`` turns by ``coord[axis(m)]·ω'_m``,
  ``tests/oracles.rope_pair``): ``MultiheadAttention`` equals it on every backend, outputs and
  gradients, on packed rows of random grids;
* logits depend on coordinate differences only; packed and padded images get what they get
  alone; M-RoPE on 1-D positions is plain RoPE; decoding text after an image with the KV cache
  equals one pass;
* Hugging Face's Qwen2-VL rotary embeddings (M-RoPE, and its vision encoder's axial 2-D RoPE).

The 1-D suites (conformance, backends, oracle, fuzz) cover both variants through the two
multi-axis specs in ``tests/helpers.SCHEME_SPECS``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

import relpos
from relpos import KVCache, MultiheadAttention, Positions, Transformer, TransformerConfig
from relpos.attention.backends import BACKENDS
from tests.helpers import oracle_attention_layer, randomize_parameters

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.usefixtures("one_thread"),
]

#: Head dim 8 (4 rotary pairs) in the tiny models below.
AXIAL_2D = {"name": "rope", "sections": [2, 2], "axial": True}
MROPE_3D = {"name": "rope", "sections": [2, 1, 1]}
causal_ids = ["causal", "bidirectional"]


# ------------------------------------------------------------------------------ Positions
def test_from_grids_by_hand():
    p = Positions.from_grids([[(2, 3), (1, 2)], [(3, 1)]], n=8)
    assert p.pos.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 0, 0, 0, 0, 0]]
    assert p.seg.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, -1, -1, -1, -1, -1]]
    assert p.coords.tolist() == [
        [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [0, 0], [0, 1]],
        [[0, 0], [1, 0], [2, 0], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0]],
    ]
    video = Positions.from_grids([[(2, 1, 2)]], n=4)
    assert video.coords.tolist() == [[[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]]
    assert video.pos.tolist() == [[0, 1, 2, 3]] and video.num_axes == 3


def test_with_coords_checks_broadcasts_and_zeroes_padding():
    p = Positions.from_padding_mask(torch.tensor([[True, True, False], [False, True, True]]))
    coords = torch.tensor([[[5, 1], [6, 2], [7, 3]], [[8, 4], [9, 5], [1, 6]]], dtype=torch.int32)
    q = p.with_coords(coords)
    assert q.coords.dtype == torch.long
    assert q.coords.tolist() == [[[5, 1], [6, 2], [0, 0]], [[0, 0], [9, 5], [1, 6]]]
    assert torch.equal(q.pos, p.pos) and torch.equal(q.seg, p.seg)
    # A batch-1 value expands to the coordinates' batch, batch-1 coordinates to the value's.
    plain = Positions.from_length(3).with_coords(coords)
    assert plain.batch == 2 and torch.equal(plain.coords, coords.long())
    one = p.with_coords(coords[:1])
    assert one.coords.shape == (2, 3, 2) and one.coords[1, 1].tolist() == [6, 2]


def test_every_method_carries_coords():
    p = Positions.from_grids([[(2, 2)]], n=5)
    assert p.expand(3).coords.shape == (3, 5, 2)
    assert torch.equal(p.expand(3).coords[2], p.coords[0])
    assert p[1:3].coords.tolist() == [[[0, 1], [1, 0]]]
    assert torch.equal(p.to("cpu").coords, p.coords)
    again = p[:2].cat(p[2:])
    assert torch.equal(again.coords, p.coords) and torch.equal(again.pos, p.pos)
    assert "coords=[[[0, 0], [0, 1]" in repr(p)
    # The KV cache keeps them: prefill, then a continued token.
    cache, k = KVCache(), torch.zeros(1, 1, 5, 2)
    cache.update(k, k, p)
    _, _, kp = cache.update(k[:, :, :1], k[:, :, :1], cache.positions.continued(1))
    assert kp.coords.tolist() == [[[0, 0], [0, 1], [1, 0], [1, 1], [0, 0], [2, 2]]]


def test_continued_follows_the_mrope_rule():
    """New tokens: every axis at 1 + the largest coordinate of the row's last segment, then +1
    per token; positions continue as without coordinates."""
    pad = [0, 0, 0]
    image = [[2, 2 + r, 2 + c] for r in range(2) for c in range(3)]  # a 2×3 image after 2 texts
    coords = [
        [[0, 0, 0], [1, 1, 1], *image, pad],  # text, text, image, padding
        [[0, 0, 0], [1, 1, 1], [2, 2, 2], pad, pad, pad, pad, pad, pad],  # text only
        [pad] * 9,  # nothing yet
        [[9, 9, 9], [9, 9, 10], [0, 0, 0], [0, 1, 1], pad, pad, pad, pad, pad],  # two segments
    ]
    seg = [[0] * 8 + [-1], [0] * 3 + [-1] * 6, [-1] * 9, [0, 0, 1, 1] + [-1] * 5]
    p = Positions.from_segments(torch.tensor(seg)).with_coords(torch.tensor(coords))
    c = p.continued(2)
    assert c.coords.tolist() == [
        [[5, 5, 5], [6, 6, 6]],
        [[3, 3, 3], [4, 4, 4]],
        [[0, 0, 0], [1, 1, 1]],
        [[2, 2, 2], [3, 3, 3]],
    ]
    assert c.pos.tolist() == [[8, 9], [3, 4], [0, 1], [2, 3]]
    assert c.seg.tolist() == [[0, 0], [0, 0], [0, 0], [1, 1]]
    assert Positions.from_length(3).continued(2).coords is None


two_axes = Positions.from_grids([[(1, 2)]], n=2)
three_axes = Positions.from_grids([[(1, 1, 2)]], n=2)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: two_axes.with_coords(torch.zeros(1, 2, 2)), TypeError, "integers"),
        (
            lambda: two_axes.with_coords(torch.zeros(1, 2, dtype=torch.long)),
            ValueError,
            "3 dimensions",
        ),
        (
            lambda: two_axes.with_coords(torch.zeros(1, 3, 2, dtype=torch.long)),
            ValueError,
            r"coords must have shape \(b, n, a\) with \(b, n\) = \(1, 2\)",
        ),
        (
            lambda: two_axes.with_coords(torch.zeros(1, 2, 0, dtype=torch.long)),
            ValueError,
            "a >= 1",
        ),
        (
            lambda: two_axes.cat(Positions.from_length(2)),
            ValueError,
            "different coordinate axes: 2 and None",
        ),
        (lambda: two_axes.cat(three_axes), ValueError, "different coordinate axes: 2 and 3"),
        (lambda: Positions.from_grids([[(2, 2), (2,)]], n=8), ValueError, "same number"),
        (lambda: Positions.from_grids([[], []], n=8), ValueError, "at least one grid"),
        (lambda: Positions.from_grids([[(2, -1)]], n=8), ValueError, r"grids\[0\]\[0\]"),
        (lambda: Positions.from_grids([[3]], n=8), ValueError, "must be a shape"),
        (lambda: Positions.from_grids([[(3, 3)]], n=8), ValueError, "more than n=8"),
    ],
)
def test_bad_coordinates_are_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "spec",
    [
        {"name": "rope", "sections": [16, 24, 24]},
        {"name": "rope", "sections": [8, 8], "axial": True, "interleaved": True},
        {"name": "rope", "sections": [2, 2], "scaling": {"rope_type": "linear", "factor": 2.0}},
        # Qwen2-VL's rope_parameters (transformers 5) and rope_scaling (transformers 4), pasted.
        {
            "name": "rope",
            "theta": 1e6,
            "scaling": {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        },
        {"name": "rope", "scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
    ],
    ids=str,
)
def test_config_round_trips_through_json(spec):
    config = relpos.config_from_dict(spec)
    again = relpos.config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and hash(again) == hash(config)
    assert isinstance(again.sections, tuple)
    if "scaling" in spec and "mrope_section" in spec["scaling"]:
        assert config.sections == (16, 24, 24)
        assert config.scaling_dict["rope_type"] == "default"


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (
            {"sections": [2, 2], "rotary_dim": 6},
            ValueError,
            r"sections \[2, 2\] hold 4 rotary pairs, but rotary_dim 6 has 3",
        ),
        ({"sections": [2, 0]}, ValueError, "positive ints"),
        ({"sections": []}, ValueError, "positive ints"),
        ({"sections": [1.5, 2]}, ValueError, "positive ints"),
        ({"sections": "16"}, TypeError, "list of ints"),
        ({"axial": True}, ValueError, "axial rope needs sections"),
        ({"sections": [2, 2], "axial": 1}, TypeError, "axial must be a bool"),
        (
            {"sections": [2, 2], "axial": True, "scaling": {"rope_type": "linear", "factor": 2}},
            ValueError,
            "axial rope takes no scaling",
        ),
        (
            {"sections": [2, 2], "scaling": {"type": "mrope", "mrope_section": [1, 3]}},
            ValueError,
            r"sections \[2, 2\] differ from the scaling's mrope_section \[1, 3\]",
        ),
        (
            {
                "sections": [2, 2],
                "scaling": {
                    "rope_type": "dynamic",
                    "factor": 2.0,
                    "original_max_position_embeddings": 8,
                },
            },
            ValueError,
            "sections cannot be combined with rope_type 'dynamic'",
        ),
        ({"sections": [2, 2], "xpos_scale_base": 512.0}, ValueError, "xPos is defined on one axis"),
        (  # Qwen3-VL's interleaved M-RoPE: not supported, refused rather than run sectioned
            {"scaling": {"rope_type": "default", "mrope_section": [1, 1], "mrope_interleaved": 1}},
            ValueError,
            r"unknown key\(s\) \['mrope_interleaved'\]",
        ),
    ],
)
def test_bad_configs_are_refused(spec, error, match):
    with pytest.raises(error, match=match):
        relpos.schemes.RotaryConfig(**spec)


def test_sections_must_fit_the_head_and_the_positions():
    with pytest.raises(ValueError, match="rotary_dim 8 has 4"):
        MultiheadAttention(16, 2, {"name": "rope", "sections": [2, 3]})
    attn = MultiheadAttention(16, 2, MROPE_3D)
    with pytest.raises(ValueError, match=r"2 coordinate axes, but the rope sections \[2, 1, 1\]"):
        attn(torch.randn(1, 2, 16), two_axes)


# ------------------------------------------------------------------------------ the oracle
VARIANTS = ["mrope", "mrope-yarn", "axial", "axial-learned"]


def random_case(rng: random.Random, variant: str) -> tuple[dict, int, Positions]:
    """A random multi-axis spec, its head dim, and packed rows of random grids (shifted: the
    coordinates need not start at 0)."""
    a = rng.choice([2, 3])
    sections = [rng.randint(1, 3) for _ in range(a)]
    r = 2 * sum(sections)
    spec = {
        "name": "rope",
        "theta": rng.choice([100.0, 10000.0]),
        "rotary_dim": r,
        "sections": sections,
        "axial": variant.startswith("axial"),
        "interleaved": rng.random() < 0.5,
        "learned_freq": variant.endswith("learned"),
    }
    if variant == "mrope-yarn":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
        spec["scaling"] = yarn
    grids = []
    for _ in range(rng.randint(1, 2)):
        row = [tuple(rng.randint(1, 3) for _ in range(a)) for _ in range(rng.randint(1, 3))]
        while len(row) > 1 and sum(math.prod(g) for g in row) > 18:  # the oracle is slow
            row.pop()
        grids.append(row)
    n = max(sum(math.prod(g) for g in row) for row in grids) + rng.randint(0, 2)
    p = Positions.from_grids(grids, n)
    shift = torch.tensor([[[rng.randint(0, 6) for _ in range(a)]] for _ in range(p.batch)])
    return spec, r + 2 * rng.randint(0, 1), p.with_coords(p.coords + shift)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("causal", [True, False], ids=causal_ids)
@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_equals_the_oracle_on_every_backend(variant, causal, seed):
    """float64: ``eager`` equals the oracle up to the float32 rounding of the frequencies (the
    oracle's are exact), and every other backend equals ``eager`` to rounding."""
    rng = random.Random(f"{variant}{causal}{seed}")
    spec, d, p = random_case(rng, variant)
    h = rng.randint(1, 2)
    torch.manual_seed(seed)
    attn = MultiheadAttention(h * d, h, spec, causal=causal, backend="eager").double()
    randomize_parameters(attn, seed)
    x = torch.randn(p.batch, len(p), h * d, dtype=torch.float64, requires_grad=True)
    inputs = [x, *attn.parameters()]
    grad_out = torch.randn(x.shape, dtype=torch.float64)

    def run(layer):
        out = layer(x, p)
        return out, torch.autograd.grad(out, inputs, grad_out)

    def check(got, want, tol, name):
        torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol, msg=name)
        for t, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=f"{name}: grad {t}")

    eager = run(attn)
    check(eager, run(lambda x, p: oracle_attention_layer(attn, x, p)), 1e-5, "oracle")
    for backend in sorted(set(BACKENDS) - {"eager", "flex", "fused"}):  # flex below; fused: fp64
        attn.backend = backend
        check(run(attn), eager, 1e-9, backend)


def test_flex_equals_the_oracle_in_inference():
    if "flex" not in BACKENDS:
        pytest.skip("FlexAttention is not available in this torch")
    spec, d, p = random_case(random.Random(5), "axial")
    torch.manual_seed(5)
    attn = MultiheadAttention(2 * d, 2, spec, causal=True, backend="flex")
    randomize_parameters(attn)
    x = torch.randn(p.batch, len(p), 2 * d)
    with torch.no_grad():
        want = oracle_attention_layer(attn, x, p)
        try:
            got = attn(x, p)
        except Exception as e:  # no C++ compiler, unsupported build
            if isinstance(e, ValueError):
                raise
            pytest.skip(f"FlexAttention does not compile here: {type(e).__name__}: {e}")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ properties
@pytest.mark.parametrize(
    ("spec", "grid", "shift"),
    [
        ({**AXIAL_2D, "sections": [4, 4]}, (3, 4), (5, 11)),
        ({**MROPE_3D, "sections": [2, 3, 3]}, (2, 2, 3), (3, 7, 2)),
    ],
    ids=["axial-2d", "mrope-3d"],
)
def test_logits_depend_only_on_coordinate_differences(spec, grid, shift):
    scheme = relpos.make_scheme(spec, d_model=32, num_heads=2, causal=False).double()
    n = math.prod(grid)
    p = Positions.from_grids([[grid]], n)
    q, k = (torch.randn(1, 2, n, 16, dtype=torch.float64) for _ in range(2))

    def logits(q_coords, k_coords):
        qr, kr = scheme.rotate(q, k, p.with_coords(q_coords), p.with_coords(k_coords))
        return qr @ kr.transpose(-1, -2)

    moved = p.coords + torch.tensor(shift)
    torch.testing.assert_close(logits(moved, moved), logits(p.coords, p.coords))
    # Not trivially so: shifting the keys alone changes them.
    assert not torch.allclose(logits(p.coords, moved), logits(p.coords, p.coords), atol=1e-3)


def tiny_model(spec: dict, causal: bool, backend: str) -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=13,
        d_model=16,
        num_heads=2,
        num_layers=2,
        dropout=0.0,
        causal=causal,
        scheme=spec,
        backend=backend,
    )
    model = Transformer(cfg).eval()
    randomize_parameters(model)
    return model


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("causal", [True, False], ids=causal_ids)
@pytest.mark.parametrize(
    ("spec", "rows"),
    [
        (AXIAL_2D, [[(2, 3), (3, 2), (1, 1)], [(4, 1), (2, 2)]]),
        (MROPE_3D, [[(1, 2, 3), (2, 1, 2)], [(2, 2, 2)]]),
    ],
    ids=["axial-2d", "mrope-3d"],
)
@torch.no_grad()
def test_packed_and_padded_images_get_what_they_get_alone(spec, rows, causal, backend):
    model = tiny_model(spec, causal, backend)
    n = max(sum(math.prod(g) for g in row) for row in rows) + 1
    tokens = torch.randint(0, 13, (len(rows), n), generator=torch.Generator().manual_seed(1))
    packed = Positions.from_grids(rows, n)
    out = model(tokens, packed)
    for r, row in enumerate(rows):
        for s, grid in enumerate(row):
            size, mine = math.prod(grid), packed.seg[r] == s
            image = tokens[r][mine].unsqueeze(0)
            alone = model(image, Positions.from_grids([[grid]], size))[0]
            torch.testing.assert_close(out[r][mine], alone, atol=1e-5, rtol=1e-5)
            padded = torch.cat([image, torch.zeros(1, 3, dtype=torch.long)], 1)
            got = model(padded, Positions.from_grids([[grid]], size + 3))[0, :size]
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@torch.no_grad()
def test_mrope_on_one_axis_positions_is_plain_rope(interleaved):
    plain = MultiheadAttention(32, 2, {"name": "rope", "interleaved": interleaved}, causal=True)
    randomize_parameters(plain)
    spec = {"name": "rope", "interleaved": interleaved, "sections": [3, 2, 3]}
    mrope = MultiheadAttention(32, 2, spec, causal=True)
    mrope.load_state_dict(plain.state_dict())
    x = torch.randn(3, 7, 32)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, :3] = mask[2, 5:] = False
    p = Positions.from_padding_mask(mask)
    want = plain(x, p)
    assert torch.equal(mrope(x, p), want)
    # Text tokens with coordinates: the position on every axis.
    assert torch.equal(mrope(x, p.with_coords(p.pos.unsqueeze(-1).expand(-1, -1, 3))), want)
    # Axial RoPE on 1-D positions is not plain RoPE: every axis has its own ladder.
    axial = MultiheadAttention(32, 2, {**spec, "axial": True}, causal=True)
    axial.load_state_dict(plain.state_dict())
    assert not torch.allclose(axial(x, p), want, atol=1e-3)


def mrope_coords(parts: list) -> list[list[int]]:
    """M-RoPE coordinates ``(t, h, w)`` of a row of text runs (ints: token counts) and grids
    (shapes), as Qwen2-VL lays them out: text tokens sit at one position on every axis; a grid's
    tokens at the next position plus their multi-index; text after a grid starts one past its
    largest coordinate."""
    coords: list[list[int]] = []
    start = 0
    for part in parts:
        if isinstance(part, int):
            coords += [[start + t] * 3 for t in range(part)]
        else:
            coords += [[start + i for i in at] for at in itertools.product(*map(range, part))]
        start = max(max(c) for c in coords) + 1
    return coords


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("backend", ["eager", "auto"])
@torch.no_grad()
def test_decoding_text_after_an_image_equals_one_pass(backend, chunk):
    """Left-padded prompts of text and images with M-RoPE coordinates, then text decoded with the
    KV cache (``continued``): every row equals its prompt and continuation in one pass, with the
    coordinates the M-RoPE rule gives."""
    prompts = [[2, (1, 2, 2), 1], [1, (2, 3, 2)]]  # row 1 ends on the grid
    steps = 4
    model = tiny_model(MROPE_3D, True, backend)
    layouts = [mrope_coords(parts) for parts in prompts]
    n = max(len(c) for c in layouts)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 13, (len(prompts), n), generator=g)
    later = torch.randint(0, 13, (len(prompts), steps), generator=g)
    mask = torch.zeros(len(prompts), n, dtype=torch.bool)
    coords = torch.zeros(len(prompts), n, 3, dtype=torch.long)
    for r, c in enumerate(layouts):
        mask[r, n - len(c) :], coords[r, n - len(c) :] = True, torch.tensor(c)
    cache = model.new_cache()
    first = model(tokens, Positions.from_padding_mask(mask).with_coords(coords), cache=cache)
    rest = [model(later[:, t : t + chunk], cache=cache) for t in range(0, steps, chunk)]
    for r, parts in enumerate(prompts):
        full = mrope_coords([*parts, steps])
        doc = torch.cat([tokens[r][mask[r]], later[r]]).unsqueeze(0)
        want = model(doc, Positions.from_length(len(full)).with_coords(torch.tensor([full])))[0]
        got = torch.cat([first[r][mask[r]], *[s[r] for s in rest]])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ Hugging Face
def test_mrope_equals_hugging_face_qwen2_vl():
    pytest.importorskip("transformers", minversion="5")
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    # Qwen2-VL's geometry: head dim 128, mrope_section [16, 24, 24], theta 1e6.
    params = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    config = Qwen2VLTextConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    rotary = hf.Qwen2VLRotaryEmbedding(config)
    g = torch.Generator().manual_seed(0)
    coords = torch.randint(0, 64, (2, 12, 3), generator=g)  # (b, n, 3); HF takes (3, b, n)
    q, k = (torch.randn(2, 2, 12, 128, generator=g) for _ in range(2))
    cos, sin = rotary(q, coords.permute(2, 0, 1))
    want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    # The checkpoint's rope_parameters, pasted as is.
    spec = {"name": "rope", "theta": 1e6, "scaling": config.rope_parameters}
    scheme = relpos.make_scheme(spec, d_model=256, num_heads=2, causal=True)
    assert scheme.config.sections == (16, 24, 24)
    torch.testing.assert_close(scheme.inv_freq, rotary.inv_freq, rtol=2e-6, atol=0)
    p = Positions.from_length(12).with_coords(coords)
    got_q, got_k = scheme.rotate(q, k, p, p)
    torch.testing.assert_close(got_q, want_q, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=2e-5, rtol=1e-5)


def test_axial_equals_hugging_face_qwen2_vl_vision():
    pytest.importorskip("transformers", minversion="5")
    from transformers import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    config = Qwen2VLVisionConfig(embed_dim=128, num_heads=2)  # head dim 64: 16 pairs per axis
    rotary = hf.Qwen2VLVisionRotaryEmbedding(config)
    p = Positions.from_grids([[(4, 6), (3, 3)]], n=33)  # two images, tokens in (h, w) order
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(33, 2, 64, generator=g) for _ in range(2))  # HF's (tokens, heads, dim)
    cos, sin = rotary(q, p.coords[0])
    want_q, want_k = hf.apply_rotary_pos_emb_vision(q, k, cos, sin)
    theta = config.rope_parameters["rope_theta"]
    spec = {"name": "rope", "theta": theta, "sections": [16, 16], "axial": True}
    scheme = relpos.make_scheme(spec, d_model=128, num_heads=2, causal=False)
    got_q, got_k = scheme.rotate(q.transpose(0, 1)[None], k.transpose(0, 1)[None], p, p)
    torch.testing.assert_close(got_q[0].transpose(0, 1), want_q, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_k[0].transpose(0, 1), want_k, atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ docs
def test_the_rope_doc_example_for_multi_axis_positions_runs():
    doc = Path(__file__).resolve().parents[1] / "docs" / "rope.md"
    section = doc.read_text().split("## Multi-axis positions", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/rope.md: the multi-axis section has no example"
    for block in blocks:
        exec(compile(block, str(doc), "exec"), {})
