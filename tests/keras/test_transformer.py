"""``relpos.keras.transformer.Transformer`` on whichever ``KERAS_BACKEND`` is set: shapes, left
padding, config round trip, ``.keras`` save/load, ``fit``."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")  # conftest.py seeds every test (keras.utils.set_random_seed)

from relpos.keras import from_torch  # noqa: E402
from relpos.keras.transformer import Transformer  # noqa: E402
from relpos.spec import scheme_config  # noqa: E402

SMALL = {"vocab_size": 11, "d_model": 16, "num_heads": 2, "num_layers": 2, "dropout": 0.0}
ONE_LAYER = {**SMALL, "num_layers": 1}  # a smaller graph to compile (JAX)
#: Row 0 left-padded, row 1 full. One shape for every test: JAX compiles per shape.
BATCH = np.array([[0, 0, 0, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]], "int32")
TOL = {"atol": 2e-5, "rtol": 1e-5}


def _logits(model, tokens) -> np.ndarray:
    tokens = np.asarray(tokens, "int32")
    if keras.backend.backend() == "jax":  # one jit per shape: eager JAX compiles op by op
        return np.asarray(model.predict_on_batch(tokens))
    return keras.ops.convert_to_numpy(model(tokens))


@pytest.mark.parametrize(
    "scheme",
    ["t5", "sinusoidal", {"name": "learned", "max_len": 16}],  # in attention; at the input
    ids=lambda s: s if isinstance(s, str) else s["name"],
)
def test_each_row_is_computed_alone(scheme):
    model = Transformer(**SMALL, scheme=scheme)
    logits = _logits(model, BATCH)
    assert logits.shape == (2, 8, SMALL["vocab_size"]) and np.isfinite(logits).all()
    # The left-padded row's tokens get the logits of the row alone (positions from the mask).
    np.testing.assert_allclose(logits[0, 3:], _logits(model, [[3, 4, 5, 6, 7]])[0], **TOL)
    # Row 1 does not see row 0, and no token sees a later one (causal).
    changed = BATCH.copy()
    changed[0] = 9
    changed[1, 6:] = [10, 10]
    other = _logits(model, changed)
    np.testing.assert_allclose(other[1, :6], logits[1, :6], **TOL)
    assert not np.allclose(other[1, 6:], logits[1, 6:])


def _copy_torch_weights(torch_model, model) -> None:
    """The weights of a :class:`relpos.Transformer` into a Keras one of the same config."""
    sd = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    model.token_embedding.embeddings.assign(sd["embed.tokens.weight"])
    for i, (block, kblock) in enumerate(zip(torch_model.blocks, model.blocks, strict=True)):
        for src, dst in zip(from_torch(block.attn).weights, kblock.attn.weights, strict=True):
            dst.assign(keras.ops.convert_to_numpy(src.value))
        for name in ("ln1", "ln2"):
            getattr(kblock, name).gamma.assign(sd[f"blocks.{i}.{name}.weight"])
            getattr(kblock, name).beta.assign(sd[f"blocks.{i}.{name}.bias"])
        for k, dense in ((0, kblock.mlp_in), (2, kblock.mlp_out)):
            dense.kernel.assign(sd[f"blocks.{i}.mlp.{k}.weight"].T)
            dense.bias.assign(sd[f"blocks.{i}.mlp.{k}.bias"])
    model.ln_f.gamma.assign(sd["ln_f.weight"])
    model.ln_f.beta.assign(sd["ln_f.bias"])
    model.head.kernel.assign(sd["head.weight"].T)


@pytest.mark.parametrize(
    ("scheme", "num_kv_heads"),
    [
        ({"name": "t5", "num_buckets": 8, "max_distance": 16}, None),
        ({"name": "rope"}, 1),
        ({"name": "transformer_xl", "max_distance": 4}, None),
        pytest.param({"name": "dpb", "hidden": 8}, 1, marks=pytest.mark.slow),
        ({"name": "forgetting"}, None),  # gates from each block's normalised input
        pytest.param(
            {"name": "deberta", "position_buckets": 4, "max_relative_positions": 8},
            1,
            marks=pytest.mark.slow,
        ),
        pytest.param({"name": "cope", "npos_max": 4}, None, marks=pytest.mark.slow),
    ],
    ids=["t5", "rope-mqa", "transformer_xl", "dpb-mqa", "forgetting", "deberta-mqa", "cope"],
)
@pytest.mark.torch_reference
def test_matches_the_pytorch_transformer_with_its_weights(scheme, num_kv_heads):
    import torch

    from relpos.models import Transformer as TorchTransformer
    from relpos.models import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(**SMALL, scheme=scheme, num_kv_heads=num_kv_heads)
    torch_model = TorchTransformer(config).eval()
    with torch.no_grad():  # weights that start at 0 (LayerNorm's shift, Transformer-XL's u, v)
        for p in torch_model.parameters():
            if not p.any():
                p.normal_(0.0, 0.1)
    model = Transformer(**SMALL, scheme=scheme, num_kv_heads=num_kv_heads)
    model.build((None, None))
    _copy_torch_weights(torch_model, model)
    with torch.no_grad():
        want = torch_model(torch.from_numpy(BATCH), padding_mask=torch.from_numpy(BATCH != 0))
    real = BATCH != 0
    np.testing.assert_allclose(_logits(model, BATCH)[real], want.numpy()[real], **TOL)


def test_get_config_round_trip():
    scheme = {"name": "t5", "num_buckets": 8, "max_distance": 16}
    for tie_weights, kv_heads in ((False, None), (True, 1)):
        model = Transformer(
            **SMALL, d_ff=24, scheme=scheme, tie_weights=tie_weights, num_kv_heads=kv_heads
        )
        model.build((None, None))
        config = model.get_config()
        # The scheme's full config: the given fields, every other at its default.
        assert scheme_config(config["scheme"]) == scheme_config(scheme) and config["d_ff"] == 24
        assert config["tie_weights"] is tie_weights and config["causal"] is True
        assert config["num_kv_heads"] == kv_heads
        assert model.blocks[0].attn.num_key_value_heads == (kv_heads or SMALL["num_heads"])
        clone = Transformer.from_config(config)
        clone.build((None, None))
        assert clone.get_config() == config
        assert clone.count_params() == model.count_params()
        serialized = keras.saving.serialize_keras_object(model)
        restored = keras.saving.deserialize_keras_object(serialized)
        assert isinstance(restored, Transformer) and restored.get_config() == config
    untied, tied = Transformer(**SMALL), Transformer(**SMALL, tie_weights=True)
    untied.build((None, None))
    tied.build((None, None))
    assert untied.count_params() - tied.count_params() == SMALL["d_model"] * SMALL["vocab_size"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        Transformer(11, d_model=10, num_heads=4)
    with pytest.raises(ValueError, match="nonsense"):
        Transformer(11, d_model=16, num_heads=2, scheme="nonsense")
    with pytest.raises(ValueError, match=r"shape \(b, n\)"):
        Transformer(**SMALL)(np.ones((2, 3, 4), "int32"))


@pytest.mark.parametrize(
    ("scheme", "tie_weights"),
    [("t5", False), ({"name": "learned", "max_len": 16}, True)],
    ids=["t5", "learned-tied"],
)
def test_keras_save_and_load_give_the_same_outputs(tmp_path, scheme, tie_weights):
    model = Transformer(**ONE_LAYER, scheme=scheme, tie_weights=tie_weights)
    before = _logits(model, BATCH)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, Transformer) and loaded.get_config() == model.get_config()
    np.testing.assert_allclose(_logits(loaded, BATCH), before, atol=1e-6, rtol=1e-6)


def test_fit_lowers_the_loss():
    model = Transformer(**ONE_LAYER, scheme="rope")
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, SMALL["vocab_size"], size=(4, 9)).astype("int32")
    tokens[0, 6:] = 0  # right padding: masked inputs, zero-weight targets
    x, y = tokens[:, :-1], tokens[:, 1:]
    model.build(x.shape)
    before = [np.array(w.numpy()) for w in model.trainable_weights]
    history = model.fit(x, y, sample_weight=(y != 0).astype("float32"), epochs=3, verbose=0)
    losses = history.history["loss"]
    assert len(losses) == 3 and np.isfinite(losses).all() and losses[-1] < losses[0]
    after = [np.array(w.numpy()) for w in model.trainable_weights]
    assert all(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
