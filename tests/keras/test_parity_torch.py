"""Same numbers as the PyTorch modules: every Keras layer, with weights copied by ``from_torch``,
equals its relpos PyTorch module (fp32, 1e-5) on plain, left/right-padded and packed batches,
with and without grouped-query attention; length-dependent RoPE decodes as PyTorch's row alone.

The PyTorch modules are themselves tested against loop oracles (tests/test_oracle.py); what has
no PyTorch twin (segment ranks, the relative embedding tensor) is checked against loops in
tests/keras/test_oracles.py. Every test here needs torch (``torch_reference``): the Keras suite's
JAX part runs without them in a Keras user's install, and with them in the main environment.
"""

import zlib

import numpy as np
import pytest
from keras import ops

import relpos
from relpos.keras import RotaryEmbedding, from_torch, make_attention_scheme
from relpos.keras.positions import Positions, positions_from_segments

from ..specs import SCHEME_SPECS, length_dependent
from .util import BACKEND, COMPILED, LAYOUTS, decode, every_other, grads, kt, layout, np_

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch_reference

#: The PyTorch suite's: they switch at 5 tokens, so the test rows (5 to 9 tokens) cross it.
DYNAMIC, LONGROPE = [spec for spec in SCHEME_SPECS if length_dependent(spec)]
XPOS = {"name": "rope", "xpos_scale_base": 8.0}  # a small γ: a visible decay over 9 tokens
#: RoPE variants: on the grouped-query shape only (JAX compiles each op once per shape).
VARIANTS = [DYNAMIC, LONGROPE, XPOS, {"name": "rope", "learned_freq": True, "interleaved": True}]
#: Per-head control: the heads left out get no bias (the grouped-query shape has 4 heads).
VARIANTS += [
    {"name": "alibi", "heads": [0, 3]},
    {"name": "t5", "num_buckets": 8, "max_distance": 6, "heads": [1]},
    {"name": "kerple", "heads": [3]},  # the distance biases zero the heads left out alike
    {"name": "sandwich", "dim": 32, "heads": [0, 2]},
    {"name": "fire", "hidden": 8, "init_threshold": 4.5, "heads": [1, 2]},
]
SCHEMES = [
    "nope",
    "rope",
    {"name": "rope", "rotary_dim": 4, "interleaved": True},
    {
        "name": "rope",
        "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    },
    {"name": "rope", "sections": [1, 3], "axial": True},  # one-axis positions: both read pos
    "alibi",
    {"name": "t5", "num_buckets": 8, "max_distance": 6},
    {"name": "shaw", "max_distance": 3},
    {"name": "shaw", "max_distance": 2, "per_head": True, "keys": False},
    {"name": "music", "max_distance": 4},
    {"name": "music", "max_distance": 40},
]
#: Issue 17's relative family, on the grouped-query shape only. Transformer-XL clipped inside
#: the rows (3) and not (40: self-attention projects only the rows the length reaches); DPB small
#: with log distances; learned ALiBi with a head left unbiased. KERPLE's power variant (also in
#: the window test below) and DPB at its defaults (one more block) run under ``slow``.
KERPLE, KERPLE_POWER = "kerple", {"name": "kerple", "variant": "power"}
LEARNED_ALIBI = {"name": "learned_alibi", "slopes": [0.5, 0.0, 0.25, 0.125]}
DPB = {"name": "dpb", "hidden": 8, "depth": 1, "log_distance": True}
TXL = {"name": "transformer_xl", "max_distance": 3}
#: Sandwich (a fixed distance bias, d̄ small enough to oscillate within the rows) and FIRE (a
#: per-pair MLP of the query's position, causal only; its threshold 4.5 inside the 9-token rows).
SANDWICH = {"name": "sandwich", "dim": 8}
FIRE = {"name": "fire", "hidden": 8, "init_threshold": 4.5}
FAMILY = [
    KERPLE,
    KERPLE_POWER,
    LEARNED_ALIBI,
    DPB,
    "dpb",
    TXL,
    {"name": "transformer_xl", "max_distance": 40},
    SANDWICH,
    FIRE,
]
SLOW_FAMILY = (KERPLE_POWER, "dpb")  # under ``make test-all`` on every backend
#: Issue 17's schemes that read the keys or the layer input, on the grouped-query shape: DeBERTa
#: bucketed with both terms (shared projections, LayerNorm), and with p2c alone unbucketed
#: (separate projections, no norm); CoPE shared and per head (its positions clamp at 3: reached);
#: the forget gate. CoPE and the forget gate are causal only.
DEBERTA = {"name": "deberta", "position_buckets": 4, "max_relative_positions": 8}
DEBERTA_P2C = {
    "name": "deberta",
    "pos_att_type": ["p2c"],
    "position_buckets": 0,
    "max_relative_positions": 3,
    "share_att_key": False,
    "norm_rel_ebd": "none",
}
COPE, FOX = {"name": "cope", "npos_max": 4}, {"name": "forgetting"}
CONTEXTUAL = [DEBERTA, DEBERTA_P2C, COPE, {"name": "cope", "npos_max": 6, "per_head": True}, FOX]
#: (b, n, width, heads, key/value heads): grouped-query (2 query heads per key/value head: a
#: wrong head order shows; rows up to 9 tokens cross the length-dependent switch), multi-head.
SHAPES = [(3, 9, 32, 4, 2), (2, 5, 24, 3, 3)]
CASES = [
    *((s, shape) for s in SCHEMES for shape in SHAPES),
    *((s, SHAPES[0]) for s in VARIANTS),
    *((s, SHAPES[0]) for s in FAMILY),
    *((s, SHAPES[0]) for s in CONTEXTUAL),
]


def _causal_only(spec) -> bool:
    return (
        spec is XPOS or relpos.SCHEMES[spec if isinstance(spec, str) else spec["name"]].causal_only
    )


def _torch_positions(kind, lay):
    if kind == "plain":
        return {}
    if kind == "packed":
        return {"segment_ids": torch.from_numpy(lay["seg"]).long()}
    return {"padding_mask": torch.from_numpy(lay["mask"])}


def _keras_positions(kind, lay):
    if kind == "plain":
        return {}
    if kind == "packed":
        return {"segment_ids": kt(lay["seg"])}
    return {"query_mask": kt(lay["mask"])}


def _module(spec, width, h, kvh=None, *, causal):
    """A PyTorch attention layer; its scheme's parameters moved off their initial values, so
    that only copied weights agree (learned frequencies start at the fixed ladder; Transformer-XL's
    u and v at 0)."""
    module = relpos.MultiheadAttention(
        width, h, spec, causal=causal, backend="eager", num_kv_heads=kvh
    ).eval()
    with torch.no_grad():
        for p in module.scheme.parameters():
            p.mul_(1.0 + 0.3 * torch.rand_like(p))
            if not p.any():
                p.normal_(0.0, 0.5)
    return module


@pytest.mark.parametrize(
    ("spec", "shape", "causal"),
    every_other(
        [(spec, shape, causal) for spec, shape in CASES for causal in (False, True)],
        ids=lambda c: f"{c[0]}-h{c[1][3]}kv{c[1][4]}-{'causal' if c[2] else 'bidirectional'}",
        slow=lambda c: c[0] in SLOW_FAMILY,
    ),
)
def test_attention_equals_torch(spec, shape, causal):
    b, n, width, h, kvh = shape
    if not causal and _causal_only(spec):
        pytest.skip("causal only (refused otherwise: test_errors.py)")
    torch.manual_seed(zlib.crc32(repr((spec, causal, shape)).encode()))
    module = _module(spec, width, h, kvh, causal=causal)
    layer = from_torch(module)
    assert layer.num_key_value_heads == kvh
    x = torch.randn(b, n, width)
    for kind in LAYOUTS:
        lay = layout(kind, b, n, seed=n)
        with torch.no_grad():
            want = module(x, **_torch_positions(kind, lay)).numpy()
        got = np_(layer(kt(x), **_keras_positions(kind, lay)))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=kind)


#: Cross-attention: RoPE, ALiBi, T5 and Shaw (keys and values) clipped inside the rows, KERPLE.
CROSS = [
    "rope",
    "alibi",
    {"name": "t5", "num_buckets": 8, "max_distance": 6},
    {"name": "shaw", "max_distance": 3},
    KERPLE,
]


def _cross_layouts(b, i, j):
    """(kind, PyTorch keyword arguments, Keras keyword arguments) of a cross-attention of ``i``
    queries over ``j`` value tokens: packed pairs of documents (ids 0, 1, 2 on both sides),
    padding (queries left, values right), and explicit positions with gaps (the values' beside
    their padding mask)."""
    q_seg, k_seg = layout("packed", b, i, seed=i)["seg"], layout("packed", b, j, seed=j)["seg"]
    q_mask, k_mask = layout("left", b, i, seed=1)["mask"], layout("right", b, j, seed=2)["mask"]
    rng = np.random.default_rng(3)
    q_pos = np.sort(rng.integers(0, 3 * i, size=(b, i)), axis=1).astype("int32")
    k_pos = np.sort(rng.integers(0, 3 * j, size=(b, j)), axis=1).astype("int32")
    long = lambda a: torch.from_numpy(a).long()  # noqa: E731
    torch_k_pos = relpos.Positions(long(np.where(k_mask, k_pos, 0)), long(np.where(k_mask, 0, -1)))
    return [
        (
            "packed",
            {"segment_ids": long(q_seg), "context_segment_ids": long(k_seg)},
            {"segment_ids": kt(q_seg), "value_segment_ids": kt(k_seg)},
        ),
        (
            "padded",
            {
                "padding_mask": torch.from_numpy(q_mask),
                "context_padding_mask": torch.from_numpy(k_mask),
            },
            {"query_mask": kt(q_mask), "value_mask": kt(k_mask)},
        ),
        (
            "positions",
            {
                "positions": relpos.Positions(long(q_pos), torch.zeros(b, i, dtype=torch.long)),
                "context_positions": torch_k_pos,
            },
            {"positions": kt(q_pos), "value_positions": kt(k_pos), "value_mask": kt(k_mask)},
        ),
    ]


@pytest.mark.parametrize(
    ("spec", "causal"),
    every_other(
        [(spec, causal) for spec in CROSS for causal in (False, True)],
        ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'bidirectional'}",
    ),
)
def test_cross_attention_equals_torch(spec, causal):
    """Cross-attention with the value sequence's own positions equals the PyTorch layer's with
    ``context=`` on the same weights (grouped-query): ``value_segment_ids`` as
    ``context_segment_ids`` (packed encoder-decoder rows), ``value_mask`` as
    ``context_padding_mask``, ``value_positions`` as ``context_positions``; causal keeps
    ``k_pos <= q_pos`` (a query left with no key outputs zeros on both sides)."""
    b, i, j, width, h, kvh = 3, 9, 7, 32, 4, 2
    torch.manual_seed(zlib.crc32(repr((spec, causal, "cross")).encode()))
    module = _module(spec, width, h, kvh, causal=causal)
    layer = from_torch(module)
    x, context = torch.randn(b, i, width), torch.randn(b, j, width)
    for kind, torch_kw, keras_kw in _cross_layouts(b, i, j):
        with torch.no_grad():
            want = module(x, context=context, **torch_kw).numpy()
        got = np_(layer(kt(x), kt(context), **keras_kw))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=kind)


def test_learned_frequencies_start_at_the_scaled_ladder():
    spec = {"name": "rope", "learned_freq": True, "scaling": {"rope_type": "linear", "factor": 2.0}}
    module = relpos.MultiheadAttention(16, 2, spec, causal=True)
    scheme = make_attention_scheme(spec, num_heads=2, head_dim=8, causal=True)
    scheme.build()  # the scheme alone: no projections to initialise (slow on JAX)
    got = np_(scheme.inv_freq)
    np.testing.assert_array_equal(got, module.scheme.inv_freq.detach().numpy())


@pytest.mark.parametrize(
    ("spec", "kvh"),
    # The multi-query one compiles the most shapes: on the torch backend by default.
    [
        pytest.param(DYNAMIC, 1, id="dynamic-mqa", marks=(pytest.mark.slow,) if COMPILED else ()),
        pytest.param(LONGROPE, 2, id="longrope"),
    ],
)
def test_length_dependent_decoding_equals_torch_row_alone(spec, kvh):
    """Left-padded prompts of rows of different lengths, decoded one token a step with the
    keras-hub cache (raw keys, re-rotated at each call) as the rows cross the original context
    (5 tokens): every step equals the PyTorch layer's forward over that row's prefix, alone. One
    attention layer: see docs/rope.md for why deeper models cannot match a fresh forward. (The
    sizes of tests/keras/test_properties.py's decoding: JAX compiles each op once per shape.)"""
    b, n, width, h, prompt = 3, 8, 16, 2, 5
    torch.manual_seed(0)
    module = _module(spec, width, h, kvh, causal=True)
    layer = from_torch(module)
    assert layer.position_scheme.rotates_cached_keys
    lengths = [8, 6, 4]  # each row's sequence is the tail of x[r]
    x = torch.randn(b, n, width)
    mask = np.arange(n)[None] >= n - np.array(lengths)[:, None]
    got = decode(layer, x, mask, prompt)
    with torch.no_grad():
        for r, length in enumerate(lengths):
            for t in range(n - length, n):
                want = module(x[r : r + 1, n - length : t + 1])[0, -1].numpy()
                np.testing.assert_allclose(got[r, t], want, atol=1e-5, rtol=1e-5, err_msg=(r, t))


@pytest.mark.parametrize(
    "spec",
    [
        *(pytest.param(s, marks=pytest.mark.slow) for s in (KERPLE, LEARNED_ALIBI, SANDWICH)),
        DPB,
        FIRE,
        TXL,
        DEBERTA,
        COPE,
        FOX,
    ],
    ids=str,
)
def test_family_decoding_equals_torch(spec):
    """Left-padded prompts, a prefill, then one token a step through the keras-hub cache: every
    step equals the PyTorch layer's full causal forward at that token (the distance window then
    spans the cache's slots; Transformer-XL's u enters the queries before the cache; DeBERTa's
    p2c and CoPE's gates read the cached keys; the forget gate sums the log gates its cache keeps
    beside them; FIRE reads each query's position against the cached keys'). KERPLE, learned
    ALiBi and Sandwich take DPB's path with another function (KERPLE and Sandwich decode as their
    full Keras forward in tests/keras/test_properties.py): under ``slow``."""
    module, layer, x, mask = _left_padded_case(spec)
    got = decode(layer, x, mask, prompt=5)
    with torch.no_grad():
        want = module(x, padding_mask=torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", [FOX, COPE], ids=str)
def test_chunked_decoding_with_a_slot_per_row_equals_torch(spec):
    """Right-padded prompts of different lengths prefilled, then two chunks of two tokens, each
    row written at its own slot (``cache_update_index`` per row): every new token equals the
    PyTorch layer's forward over its row alone. The forget gate continues each row's running
    sum from the gates its cache holds; CoPE counts over the row's cached keys."""
    b, n, width, h, kvh = SHAPES[0]
    torch.manual_seed(zlib.crc32(repr(spec).encode()))
    module = _module(spec, width, h, kvh, causal=True)
    layer = from_torch(module)
    lengths = np.array([4, 2, 3])
    x = torch.randn(b, n, width)
    slots = np.arange(n)[None]
    prompt = slots < lengths[:, None]
    cache = layer.empty_cache(b, n, "float32")
    _, cache = layer(kt(x[:, :4]), cache=cache, cache_update_index=0, cache_mask=kt(prompt))
    got = []
    for step in range(2):
        start = lengths + 2 * step
        chunk = np.stack([x[r, start[r] : start[r] + 2].numpy() for r in range(b)])
        out, cache = layer(kt(chunk), cache=cache, cache_update_index=kt(start.astype("int32")))
        got.append(np_(out))
    got = np.concatenate(got, 1)  # (b, 4, width): tokens lengths[r] .. lengths[r] + 3
    with torch.no_grad():
        for r in range(b):
            want = module(x[r : r + 1, : lengths[r] + 4])[0, lengths[r] :].numpy()
            np.testing.assert_allclose(got[r], want, atol=1e-5, rtol=1e-5, err_msg=str(r))


def test_deberta_rows_equal_torch_far_and_near():
    """DeBERTa's relative rows (a table of the PyTorch function's values up to where it
    saturates) equal :func:`relpos.functional.deberta_index` on -1500 .. 1500 and far beyond, for
    log buckets, clipping and the default v3 config."""
    from relpos.functional import deberta_index

    rel = np.concatenate([np.arange(-1500, 1501), [-(10**6), -4097, 4097, 10**6]]).astype("int32")
    for spec in (DEBERTA, DEBERTA_P2C, {"name": "deberta"}):
        scheme = make_attention_scheme(spec, num_heads=2, head_dim=4, causal=False)
        c = scheme.config
        want = deberta_index(
            torch.from_numpy(rel),
            position_buckets=c.position_buckets,
            max_relative_positions=c.max_relative_positions,
        ).numpy()
        zero = kt(np.zeros((1, 1), "int32"))
        queries = Positions(kt(rel[None]), kt(np.zeros((1, rel.size), "int32")))
        index, lo, _ = scheme._index(queries, Positions(zero, zero))  # p_i - 0 for every row
        np.testing.assert_array_equal(np_(index)[0, :, 0] + lo, want, err_msg=str(spec))


#: Positions with gaps: their distances overflow the window of i + j - 1 (row 1: one gap, the
#: rest contiguous, so the batch falls back to per-pair evaluation as a whole).
GAPPED = np.array([[0, 3, 4, 10, 11, 12, 20, 21, 30], [5, 6, 7, 8, 9, 10, 11, 12, 40]], "int32")


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("spec", [KERPLE_POWER, DPB, SANDWICH], ids=str)
def test_distance_biases_beyond_the_window_equal_torch(spec, traced):
    """Explicit positions whose distances do not fit the window of i + j - 1 distances are
    evaluated per pair, eagerly and under jit (``keras.ops.cond``); contiguous ones through the
    window: both equal PyTorch."""
    if traced and BACKEND == "torch":
        pytest.skip("the torch backend runs eagerly")
    b, n, width, h, kvh = 2, 9, 32, 4, 2
    torch.manual_seed(0)
    module = _module(spec, width, h, kvh, causal=False)
    layer = from_torch(module)
    call = lambda x, p: layer(x, positions=p)  # noqa: E731
    if traced and BACKEND == "jax":
        import jax

        call = jax.jit(call)
    elif traced:
        import tensorflow as tf

        call = tf.function(call, jit_compile=True)
    x = torch.randn(b, n, width)
    for pos in (GAPPED, np.arange(n, dtype="int32")[None] + np.array([[0], [7]], "int32")):
        p = torch.from_numpy(pos).long()
        with torch.no_grad():
            want = module(x, relpos.Positions(p, torch.zeros_like(p))).numpy()
        got = np_(call(kt(x), kt(pos)))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _left_padded_case(spec):
    """``(module, layer, x, mask)``: a causal PyTorch layer of ``spec``, its Keras copy, an input
    and a left-padding mask (seeded by the spec)."""
    b, n, width, h, kvh = SHAPES[0]
    torch.manual_seed(zlib.crc32(repr(spec).encode()))
    module = _module(spec, width, h, kvh, causal=True)
    mask = layout("left", b, n, seed=n)["mask"]
    return module, from_torch(module), torch.randn(b, n, width), mask


def _keras_weight_name(name: str) -> tuple[str, bool]:
    """The Keras name of a PyTorch scheme parameter, and whether its layout is transposed
    (FIRE's ``mlp.{i}.weight`` ``(out, in)`` is ``mlp_{i}_kernel`` ``(in, out)``)."""
    if not name.startswith("mlp."):
        return name, False
    index, kind = name.removeprefix("mlp.").split(".")
    return f"mlp_{index}_{'kernel' if kind == 'weight' else 'bias'}", kind == "weight"


@pytest.mark.parametrize(
    "spec", [FIRE, {**FIRE, "heads": [0, 3]}, {"name": "kerple", "heads": [1]}], ids=str
)
def test_scheme_gradients_equal_torch(spec):
    """The gradients of a loss on a left-padded causal batch with respect to the scheme's weights
    equal PyTorch's: FIRE's piecewise-linear custom autograd function against Keras' autodiff of
    its own piecewise-linear form; with ``heads``, the heads left out get zero gradients on
    both sides (FIRE's output columns, KERPLE's ``r1``, ``r2``)."""
    module, layer, x, mask = _left_padded_case(spec)
    module(x, padding_mask=torch.from_numpy(mask)).square().sum().backward()
    weights = {w.name: w for w in layer.position_scheme.trainable_weights}
    names = dict(module.scheme.named_parameters())
    variables = [weights[_keras_weight_name(name)[0]] for name in names]
    got = grads(lambda: ops.sum(ops.square(layer(kt(x), query_mask=kt(mask)))), variables)
    for (name, p), g in zip(names.items(), got, strict=True):
        want = p.grad.numpy()
        g = np_(g).T if _keras_weight_name(name)[1] else np_(g)
        np.testing.assert_allclose(g, want, atol=1e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_absolute_layers_equal_torch(kind):
    torch.manual_seed(0)
    b, n, d = 3, 8, 12
    lay = layout(kind, b, n, seed=1)
    positions = relpos.Positions.from_segments(torch.from_numpy(lay["seg"]).long())
    kw = {"segment_ids": kt(lay["seg"])}
    x = kt(np.zeros((b, n, d), "float32"))
    learned = relpos.SCHEMES["learned"](
        relpos.schemes.LearnedAbsoluteConfig(max_len=10), d_model=d, num_heads=1, causal=False
    )
    sine = relpos.SCHEMES["sinusoidal"](d_model=d, num_heads=1, causal=False)
    for module in (learned, sine):
        with torch.no_grad():
            want = module.embed(positions).expand(b, n, d).numpy()
        np.testing.assert_allclose(np_(from_torch(module)(x, **kw)), want, atol=1e-6)
    tpe = relpos.TokenPositionEmbedding(
        20, d, {"name": "learned", "max_len": 10}, scale_tokens=False
    )
    tokens = np.random.default_rng(0).integers(1, 20, size=(b, n))
    with torch.no_grad():
        want = tpe(torch.from_numpy(tokens), positions).numpy()
    np.testing.assert_allclose(np_(from_torch(tpe)(kt(tokens), **kw)), want, atol=1e-6)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_bias_layers_equal_torch(kind, causal):
    torch.manual_seed(1)
    b, n, h = 3, 9, 4
    lay = layout(kind, b, n, seed=2)
    p = relpos.Positions.from_segments(torch.from_numpy(lay["seg"]).long())
    allowed = p.allowed(p).unsqueeze(1).numpy()
    x = kt(np.zeros((b, n, 8), "float32"))
    kw = {"segment_ids": kt(lay["seg"])}
    alibi_some_heads = {"name": "alibi", "slopes": [0.5, 0.0, 0.25, 0.0]}
    for spec in ("alibi", alibi_some_heads, {"name": "t5", "num_buckets": 8, "max_distance": 5}):
        module = relpos.make_scheme(spec, d_model=8 * h, num_heads=h, causal=causal)
        with torch.no_grad():
            want = module.score_bias(None, p, p).expand(b, h, n, n).numpy()
        got = np_(from_torch(module)(x, **kw))
        np.testing.assert_allclose(got, np.where(allowed, want, 0.0), atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_rotary_equals_torch(kind, interleaved):
    b, n, h, d, r = 3, 7, 2, 8, 6
    lay = layout(kind, b, n, seed=3)
    from relpos.functional import apply_rope, rope_angles, rope_frequencies

    p = relpos.Positions.from_segments(torch.from_numpy(lay["seg"]).long())
    x = torch.randn(b, n, h, d)
    angles = rope_angles(p.pos, rope_frequencies(r, 500.0))
    want = apply_rope(x.transpose(1, 2), angles, interleaved=interleaved).transpose(1, 2)
    layer = RotaryEmbedding(500, interleaved=interleaved, rotary_dim=r)
    got = layer(kt(x), segment_ids=kt(lay["seg"]))
    # Padding tokens: positions are 0 on both sides.
    np.testing.assert_allclose(np_(got), want.numpy(), atol=1e-5)
    # The feature axis may sit anywhere: (b, h, d, n) with the sequence last.
    moved = RotaryEmbedding(
        500, interleaved=interleaved, rotary_dim=r, sequence_axis=3, feature_axis=2
    )
    got2 = moved(kt(x.permute(0, 2, 3, 1).contiguous()), segment_ids=kt(lay["seg"]))
    np.testing.assert_allclose(np_(got2), want.permute(0, 2, 3, 1).numpy(), atol=1e-5)


def test_segment_positions_equal_torch():
    """The PyTorch Positions agree on the same ids (interleaved documents too); a loop checks the
    Keras ones alone: tests/keras/test_oracles.py."""
    seg = np.random.default_rng(4).integers(-1, 3, size=(4, 12)).astype("int32")
    torch_pos = relpos.Positions.from_segments(torch.from_numpy(seg).long())
    assert (np_(positions_from_segments(kt(seg)).pos) == torch_pos.pos.numpy()).all()


def test_attention_with_per_head_alibi_slopes_equals_torch():
    """Custom slopes (0: no bias on that head) reach the Keras scheme, not the paper's slopes."""
    torch.manual_seed(0)
    spec = {"name": "alibi", "slopes": [0.5, 0.0]}
    module = relpos.MultiheadAttention(16, 2, spec, causal=True, backend="eager").eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        want = module(x).numpy()
    np.testing.assert_allclose(np_(from_torch(module)(kt(x))), want, atol=1e-5, rtol=1e-5)
