"""One conformance helper run over every Keras layer (keras-hub style): config round trip,
``.keras`` save/load, output shape, mask propagation, a ``mixed_bfloat16`` run, gradients to every
weight, and a ``jit_compile=True`` training step. The RoPE variants and grouped-query attention
get the round trips, the gradients and one training step through all of them."""

import keras
import numpy as np
import pytest
from keras import ops

from relpos.keras import (
    KERAS_SCHEMES,
    AlibiBias,
    PositionEmbedding,
    RelativeMultiHeadAttention,
    RelativePositionEmbedding,
    RotaryEmbedding,
    SinePositionEncoding,
    T5RelativeBias,
    TokenAndPositionEmbedding,
)

from ..specs import SCHEME_SPECS as SHARED_SPECS
from ..specs import length_dependent
from .util import BACKEND, every_other, grads, kt, np_, on_compiled

B, N, WIDTH = 2, 6, 8
#: One spec per Keras attention scheme: the first of its name in the specs the PyTorch suite runs
#: (sizes small enough that short inputs reach their clipping and bucketing edges).
SCHEME_SPECS = {
    spec["name"]: spec for spec in reversed(SHARED_SPECS) if spec["name"] in KERAS_SCHEMES
}
#: Issue 17's relative family: their jit-compiled training step is one model through all of them.
FAMILY = ("kerple", "learned_alibi", "dpb", "transformer_xl")
#: Issue 17's schemes that read the keys or the layer input: one jit-compiled model too.
CONTEXTUAL = ("deberta", "cope", "forgetting")
#: RoPE variants and grouped-query attention: name -> RelativeMultiHeadAttention keyword args.
#: The PyTorch suite's length-dependent specs switch at 5 tokens, inside the 6-token inputs.
DYNAMIC, LONGROPE = [spec for spec in SHARED_SPECS if length_dependent(spec)]
VARIANTS = {
    "rope-dynamic-gqa": {"scheme": DYNAMIC, "num_key_value_heads": 1},
    "rope-longrope": {"scheme": LONGROPE},
    "rope-xpos-learned": {
        "scheme": {"name": "rope", "xpos_scale_base": 512.0, "learned_freq": True}
    },
    "kerple-power-gqa": {
        "scheme": {"name": "kerple", "variant": "power"},
        "num_key_value_heads": 1,
    },
    "transformer_xl-gqa": {"scheme": "transformer_xl", "num_key_value_heads": 1},
    "deberta-p2c-unshared-gqa": {
        "scheme": {
            "name": "deberta",
            "pos_att_type": ["p2c"],
            "position_buckets": 0,
            "max_relative_positions": 3,
            "share_att_key": False,
            "norm_rel_ebd": "none",
        },
        "num_key_value_heads": 1,
    },
}

# name -> (factory, input); every layer of relpos.keras appears here once per scheme.
LAYERS = {
    "PositionEmbedding": (lambda: PositionEmbedding(N), "embedded"),
    "SinePositionEncoding": (lambda: SinePositionEncoding(), "embedded"),
    "TokenAndPositionEmbedding": (
        lambda: TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True),
        "tokens",
    ),
    "RotaryEmbedding": (lambda: RotaryEmbedding(rotary_dim=2, interleaved=True), "heads"),
    "RelativePositionEmbedding": (lambda: RelativePositionEmbedding(2, 4), "embedded"),
    "AlibiBias": (lambda: AlibiBias(num_heads=2, causal=True), "embedded"),
    "T5RelativeBias": (lambda: T5RelativeBias(2, 8, 6), "embedded"),
    **{
        f"RelativeMultiHeadAttention[{name}]": (
            lambda spec=spec: RelativeMultiHeadAttention(2, 4, scheme=spec, causal=True),
            "embedded",
        )
        for name, spec in SCHEME_SPECS.items()
    },
    **{
        f"RelativeMultiHeadAttention[{name}]": (
            lambda kw=kw: RelativeMultiHeadAttention(2, 4, causal=True, **kw),
            "embedded",
        )
        for name, kw in VARIANTS.items()
    },
}


def test_every_scheme_and_layer_is_covered():
    assert set(SCHEME_SPECS) == set(KERAS_SCHEMES)
    import relpos.keras as rk

    layer_classes = {
        n
        for n in rk.__all__
        if isinstance(getattr(rk, n), type)
        and issubclass(getattr(rk, n), keras.layers.Layer)
        and n not in ("AttentionScheme", "ReversibleEmbedding", "Transformer", "TransformerBlock")
    }
    assert layer_classes <= {k.split("[")[0] for k in LAYERS}


def _input(kind):
    rng = np.random.default_rng(0)
    if kind == "tokens":
        tokens = rng.integers(1, 10, size=(B, N))
        tokens[1, :2] = 0  # left padding, masked by mask_zero
        return tokens.astype("int32")
    if kind == "heads":
        return rng.normal(size=(B, N, 2, 4)).astype("float32")
    return rng.normal(size=(B, N, WIDTH)).astype("float32")


def _model(name):
    make, kind = LAYERS[name]
    x = _input(kind)
    inp = keras.Input(shape=x.shape[1:], dtype=x.dtype, batch_size=B)
    out = make()(inp)
    return keras.Model(inp, out), x


@pytest.mark.parametrize("name", every_other(sorted(LAYERS), ids=str))
def test_config_round_trip_and_output_shape(name):
    make, kind = LAYERS[name]
    layer = make()
    x = kt(_input(kind))
    out = layer(x)
    clone = type(layer).from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    assert tuple(layer.compute_output_shape(tuple(x.shape))) == tuple(out.shape)


#: LAYERS, plus untied output tables (keras-hub draws them as the token table, reshaped) and
#: seeded initializers (a copy with the token table's seed draws its values again).
DRAWN = {
    **LAYERS,
    "TokenAndPositionEmbedding[untied]": (
        lambda: TokenAndPositionEmbedding(10, N, WIDTH, tie_weights=False),
        "tokens",
    ),
    "TokenAndPositionEmbedding[untied-seeded]": (
        lambda: TokenAndPositionEmbedding(
            10,
            N,
            WIDTH,
            tie_weights=False,
            embeddings_initializer=keras.initializers.RandomNormal(seed=3),
        ),
        "tokens",
    ),
    "TokenAndPositionEmbedding[untied-generator]": (
        lambda: TokenAndPositionEmbedding(
            10,
            N,
            WIDTH,
            tie_weights=False,
            embeddings_initializer=keras.initializers.GlorotUniform(
                seed=keras.random.SeedGenerator(5)
            ),
        ),
        "tokens",
    ),
}


@pytest.mark.parametrize("name", sorted(DRAWN))
def test_weights_start_distinct(name):
    """No two random weights of a layer start equal (a reused initializer instance draws the
    same values: Shaw's two tables, a dense layer's kernel and bias, an untied
    ``reverse_embeddings`` and its token table did)."""
    make, kind = DRAWN[name]
    layer = make()
    layer.build(_input(kind).shape)  # no call: nothing to compile
    drawn = [np_(w).ravel() for w in layer.weights if np.unique(np_(w)).size > 1]
    for a in range(len(drawn)):
        for b in range(a):
            n = min(drawn[a].size, drawn[b].size)
            assert not np.array_equal(drawn[a][:n], drawn[b][:n]), (name, a, b)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_keras_save_and_load(name, tmp_path):
    model, x = _model(name)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(np_(loaded(kt(x))), np_(model(kt(x))), atol=1e-6)


def test_mask_propagates_through_the_stack():
    tokens = kt(_input("tokens"))
    emb = TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True)
    attn = RelativeMultiHeadAttention(2, 4, scheme="alibi", causal=True)
    x = emb(tokens)
    y = attn(x, x)
    mask = np_(y._keras_mask) if hasattr(y, "_keras_mask") else None
    want = np_(tokens) != 0
    assert mask is not None and (mask == want).all()
    assert (np_(y)[~want] == 0).all()


@pytest.mark.parametrize("spec", sorted(SCHEME_SPECS), ids=str)
def test_mixed_bfloat16_stays_near_float32(spec):
    """The torch suite's autocast check for Keras: the same weights under ``mixed_bfloat16``
    give bf16 outputs within bf16's reach of float32, at positions from 60,000 (in bf16 they
    would round to multiples of 256; an ALiBi or T5 bias would lose them, fp16 overflow)."""
    x = kt(np.random.default_rng(0).normal(size=(1, 300, WIDTH)).astype("float32"))
    layers = []
    for policy in ("float32", "mixed_bfloat16"):
        keras.config.set_dtype_policy(policy)
        layers.append(RelativeMultiHeadAttention(2, 4, scheme=SCHEME_SPECS[spec], causal=True))
        layers[-1](x, start_index=60000)  # build
    rng = np.random.default_rng(1)
    for w, w_mixed in zip(layers[0].weights, layers[1].weights, strict=True):
        value = (rng.normal(size=w.shape) * 0.5).astype("float32")
        w.assign(value)
        w_mixed.assign(value)
    ref = np_(layers[0](x, start_index=60000))
    y = layers[1](x, start_index=60000)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    y = np_(ops.cast(y, "float32"))
    assert np.isfinite(y).all()
    assert np.abs(y - ref).max() <= 0.05 * np.abs(ref).max()


@pytest.mark.parametrize("name", every_other(sorted(LAYERS), ids=str))
def test_gradients_reach_every_weight(name):
    make, kind = LAYERS[name]
    layer = make()
    x = kt(_input(kind))
    layer(x)
    if not layer.trainable_variables:
        pytest.skip("no weights")

    def loss():
        y = layer(x)
        return ops.sum(ops.square(ops.cast(y, "float32")))

    for v, g in zip(layer.trainable_variables, grads(loss, layer.trainable_variables), strict=True):
        assert g is not None, v.path
        assert np.isfinite(np_(g)).all(), v.path
        if _softmax_ignores(v):
            continue
        assert float(np.abs(np_(g)).sum()) > 0, v.path


@pytest.mark.skipif(BACKEND == "torch", reason="jit_compile is for TensorFlow (XLA) and JAX")
@pytest.mark.parametrize(
    "spec", every_other(sorted(set(SCHEME_SPECS) - set(FAMILY) - set(CONTEXTUAL)), ids=str)
)
def test_jit_compiled_training_step(spec):
    tokens = keras.Input(shape=(N,), dtype="int32")
    x = TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True)(tokens)
    x = RelativeMultiHeadAttention(2, 4, scheme=SCHEME_SPECS[spec], causal=True)(x, x)
    _fit_changes_every_weight(keras.Model(tokens, keras.layers.Dense(10)(x)))


#: Weights that add one constant to every key of a query, which softmax ignores (zero gradient,
#: as in the papers' and HF's models): DeBERTa's c2p projection bias ``b_k`` (``q_i·b_k``), and
#: the output bias of DPB's and FIRE's MLPs (one constant per head).
SOFTMAX_IGNORES = ("key_proj_bias", "dense_2_bias", "mlp_2_bias")


def _softmax_ignores(weight) -> bool:
    return "position_scheme" in weight.path and weight.path.endswith(SOFTMAX_IGNORES)


def _fit_changes_every_weight(model):
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    data = _input("tokens")
    before = [np_(w).copy() for w in model.trainable_weights]
    history = model.fit(data, data, batch_size=B, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    for w, b in zip(model.trainable_weights, before, strict=True):
        assert _softmax_ignores(w) or (np_(w) != b).any(), w.path


@pytest.mark.skipif(BACKEND == "torch", reason="jit_compile is for TensorFlow (XLA) and JAX")
@on_compiled("tensorflow")
def test_jit_compiled_training_step_through_the_variants():
    """One layer with the traced parts of the variants (one small compile): the per-row sequence
    lengths of dynamic NTK (LongRoPE reads the same), the xPos scales (whose position check is
    skipped while traced) and grouped-query heads."""
    tokens = keras.Input(shape=(N,), dtype="int32")
    x = TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True)(tokens)
    scheme = {**DYNAMIC, "xpos_scale_base": 512.0}
    x = RelativeMultiHeadAttention(2, 4, causal=True, scheme=scheme, num_key_value_heads=1)(x, x)
    _fit_changes_every_weight(keras.Model(tokens, keras.layers.Dense(10)(x)))


@pytest.mark.skipif(BACKEND == "torch", reason="jit_compile is for TensorFlow (XLA) and JAX")
@on_compiled("jax")
def test_jit_compiled_training_step_through_the_relative_family():
    """One compile for issue 17's schemes, one layer each (the traced distance window of KERPLE
    and the dynamic position bias, Transformer-XL's u through rotate)."""
    tokens = keras.Input(shape=(N,), dtype="int32")
    x = TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True)(tokens)
    for name in ("kerple", "dpb", "transformer_xl"):  # learned ALiBi: KERPLE's traced path
        x = RelativeMultiHeadAttention(2, 4, scheme=SCHEME_SPECS[name], causal=True)(x, x)
    _fit_changes_every_weight(keras.Model(tokens, keras.layers.Dense(10)(x)))


@pytest.mark.skipif(BACKEND == "torch", reason="jit_compile is for TensorFlow (XLA) and JAX")
@on_compiled("tensorflow")
def test_jit_compiled_training_step_through_the_contextual_schemes():
    """One compile for the schemes that read the keys (DeBERTa's p2c, CoPE's gates) or the layer
    input (the forget gate's per-document sums), one layer each."""
    tokens = keras.Input(shape=(N,), dtype="int32")
    x = TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True)(tokens)
    for name in CONTEXTUAL:
        x = RelativeMultiHeadAttention(2, 4, scheme=SCHEME_SPECS[name], causal=True)(x, x)
    _fit_changes_every_weight(keras.Model(tokens, keras.layers.Dense(10)(x)))


def test_attention_on_one_tensor_reads_its_keras_mask():
    tokens = kt(_input("tokens"))  # row 1 is left-padded
    x = TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True)(tokens)
    attn = RelativeMultiHeadAttention(2, 4, scheme="rope", causal=True)
    np.testing.assert_allclose(np_(attn(x)), np_(attn(x, x)), atol=1e-6)


def test_reverse_embedding_keeps_the_token_mask():
    emb = TokenAndPositionEmbedding(10, N, WIDTH, mask_zero=True)
    tokens = kt(_input("tokens"))
    x = emb(tokens)
    logits = emb.token_embedding(x, reverse=True)
    assert tuple(logits.shape) == (B, N, 10)
    assert (np_(logits._keras_mask) == (np_(tokens) != 0)).all()
