"""Bad input gets a clear error naming the argument, the shape received and the one expected."""

import numpy as np
import pytest

import relpos.keras as rk

from .util import kt, np_, traced

X = np.zeros((2, 5, 8), "float32")
SEG = np.array([[0, 0, 1, 1, -1], [0, 1, 1, 1, 1]], "int32")
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize(
    ("make", "call", "error", "match"),
    [
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X[0])),
            ValueError,
            r"query must have shape \(b, i, D\), got \(5, 8\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), query_mask=kt(np.ones((2, 4), bool))),
            ValueError,
            r"mask must have shape \(b, i\) = \(2, 5\), got \(2, 4\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), positions=kt(np.zeros((2, 5), "float32"))),
            TypeError,
            "positions must hold integers, got dtype float32",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), segment_ids=kt(np.zeros((2, 5), "float32"))),
            TypeError,
            "segment_ids must hold integers",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), start_index=kt(np.zeros(3, "int32"))),
            ValueError,
            r"start_index must be an int or have shape \(b,\) = \(2,\), got shape \(3,\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), start_index=-1),
            ValueError,
            "start_index must be >= 0",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme="forgetting", causal=True),
            lambda layer: layer(kt(X), kt(X[:, :3])),
            ValueError,
            r"scheme 'forgetting' computes its positions from the layer's own tokens "
            r"\(self-attention only\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme="forgetting", causal=True),
            lambda layer: layer(
                kt(X), cache=kt(np.zeros((2, 2, 5, 2, 4), "float32")), cache_update_index=0
            ),
            ValueError,
            r"scheme 'forgetting' needs its cache as a pair \(keys and values, log gates\), as "
            r"empty_cache\(\) builds it; got one tensor",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme="forgetting", causal=True),
            lambda layer: layer(
                kt(X),
                cache=(kt(np.zeros((2, 2, 5, 2, 4), "float32")), kt(np.zeros((2, 5, 3)))),
                cache_update_index=0,
            ),
            ValueError,
            r"the log gates of the cache must have shape \(b, S=5, h=2\), got \(2, 5, 3\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme="rope", causal=True),
            lambda layer: layer(
                kt(X),
                cache=rk.RelativeMultiHeadAttention(
                    2, 4, scheme="forgetting", causal=True
                ).empty_cache(2, 5),
                cache_update_index=0,
            ),
            ValueError,
            r"scheme 'rope' needs its cache as one tensor, as empty_cache\(\) builds it; got a "
            "pair",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme="rope", causal=True),
            lambda layer: layer(
                kt(X), cache=kt(np.zeros((2, 5, 2, 4), "float32")), cache_update_index=0
            ),
            ValueError,
            r"cache must have shape \(b=2, 2, S, h=2, d=4\), got \(2, 5, 2, 4\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True, num_key_value_heads=1),
            lambda layer: layer(
                kt(X), cache=kt(np.zeros((2, 2, 5, 2, 4), "float32")), cache_update_index=0
            ),
            ValueError,
            r"cache must have shape \(b=2, 2, S, num_key_value_heads=1, d=4\), got "
            r"\(2, 2, 5, 2, 4\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(kt(X), cache=kt(np.zeros((2, 2, 5, 2, 4), "float32"))),
            ValueError,
            "a cache needs cache_update_index",
        ),
        (  # the scheme's rotation alone: the projections in float16 would compile on JAX
            lambda: rk.make_attention_scheme(
                {"name": "rope", "xpos_scale_base": 8.0}, num_heads=2, head_dim=4, causal=True
            ),
            lambda scheme: scheme.rotate(
                kt(X.reshape(2, 5, 2, 4), "float16"),
                kt(X.reshape(2, 5, 2, 4), "float16"),
                *[rk.resolve_positions(5, start_index=300)] * 2,
            ),
            ValueError,
            r"xPos scales overflow float16 beyond position 35 \(xpos_scale_base=8.0\); got "
            "position 304",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), attention_mask=kt(np.ones((2, 5, 4), bool))),
            ValueError,
            r"attention_mask must have shape \(b, i, j\) = \(2, 5, 5\), got \(2, 5, 4\)",
        ),
        (
            lambda: rk.PositionEmbedding(4),
            lambda layer: layer(kt(X)),
            ValueError,
            r"a sequence of 5 tokens starting at position 0 is longer than the learned table "
            r"\(sequence_length=4\)",
        ),
        (
            lambda: rk.PositionEmbedding(6),
            lambda layer: layer(kt(X), start_index=2),
            ValueError,
            "starting at position 2",
        ),
        (
            lambda: rk.SinePositionEncoding(),
            lambda layer: layer(kt(np.zeros((2, 5, 7), "float32"))),
            ValueError,
            "the feature dim must be even",
        ),
        (
            lambda: rk.TokenAndPositionEmbedding(10, 8, 4),
            lambda layer: layer(kt(X)),
            ValueError,
            r"inputs must be token ids of shape \(b, n\), got \(2, 5, 8\)",
        ),
        # Token ids outside the table, wherever they hold values (eagerly, every backend).
        (
            lambda: rk.TokenAndPositionEmbedding(20, 8, 4),
            lambda layer: layer(kt(np.array([[1, 25, 2]]))),
            ValueError,
            r"inputs \(token ids\) must lie in \[0, vocabulary_size\) = \[0, 20\), got id 25",
        ),
        (
            lambda: rk.TokenAndPositionEmbedding(20, 8, 4),
            lambda layer: layer(kt(np.array([[1, -1, 2]]))),
            ValueError,
            r"inputs \(token ids\) must lie in \[0, vocabulary_size\) = \[0, 20\), got id -1",
        ),
        (
            lambda: rk.Transformer(11, d_model=8, num_heads=2, num_layers=1),
            lambda model: model(kt(np.array([[3, 11]]))),
            ValueError,
            r"tokens \(token ids\) must lie in \[0, vocab_size\) = \[0, 11\), got id 11",
        ),
        (
            lambda: rk.RotaryEmbedding(rotary_dim=10),
            lambda layer: layer(kt(np.zeros((2, 5, 2, 8), "float32"))),
            ValueError,
            r"the rotated features \(10\) must be even and <= the feature dim 8",
        ),
        # Positions past a learned table, eagerly: a tensor start_index, explicit positions.
        (
            lambda: rk.PositionEmbedding(6),
            lambda layer: layer(kt(X), start_index=kt(np.array([0, 4], "int32"))),
            ValueError,
            r"start_index gives position 8, outside the learned table \(sequence_length=6: "
            r"positions 0..5\)",
        ),
        (
            lambda: rk.TokenAndPositionEmbedding(10, 6, 4),
            lambda layer: layer(kt(np.ones((2, 5), "int32")), start_index=kt(np.int32(2))),
            ValueError,
            "start_index gives position 6, outside the learned table",
        ),
        (
            lambda: rk.PositionEmbedding(6),
            lambda layer: layer(kt(X), positions=kt(np.array([0, 1, 2, 3, -1], "int32"))),
            ValueError,
            "positions gives position -1, outside the learned table",
        ),
        # A cache write past the cache's end: an int index, a tensor one per row, negative.
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(kt(X), cache=layer.empty_cache(2, 4), cache_update_index=2),
            ValueError,
            r"cache_update_index \+ n must be <= S: 5 new token\(s\) written at slot 2 need 7 "
            r"slots, the cache has S=4",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(
                kt(X), cache=layer.empty_cache(2, 8), cache_update_index=kt(np.array([0, 4]))
            ),
            ValueError,
            r"written at slot 4 need 9 slots, the cache has S=8",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(kt(X), cache=layer.empty_cache(2, 8), cache_update_index=-1),
            ValueError,
            "cache_update_index must be >= 0, got -1",
        ),
        # value_mask / key_mask: (b, j), and not with a cache (cache_mask marks the slots).
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), value_mask=kt(np.ones((2, 4), bool))),
            ValueError,
            r"value_mask must have shape \(b, j\) = \(2, 5\), got \(2, 4\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(
                kt(X),
                cache=layer.empty_cache(2, 8),
                cache_update_index=0,
                key_mask=kt(np.ones((2, 5), bool)),
            ),
            ValueError,
            "with a cache, cache_mask says which slots hold tokens; do not pass value_mask",
        ),
        # Batch sizes that disagree with the query's b = 2.
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), positions=kt(np.zeros((3, 5), "int32"))),
            ValueError,
            r"positions must have shape \(i,\) or \(b, i\) = \(2, 5\), got \(3, 5\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(
                kt(X), cache=layer.empty_cache(2, 8), cache_update_index=kt(np.zeros(3, "int32"))
            ),
            ValueError,
            r"cache_update_index must be an int or have shape \(b,\) = \(2,\), got shape \(3,\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(
                kt(X),
                cache=layer.empty_cache(2, 8),
                cache_update_index=0,
                cache_mask=kt(np.ones((3, 8), bool)),
            ),
            ValueError,
            r"cache_mask must have shape \(b, S\) = \(2, 8\), got \(3, 8\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(kt(X), cache=layer.empty_cache(3, 8), cache_update_index=0),
            ValueError,
            r"cache must have shape \(b=2, 2, S, h=2, d=4\), got \(3, 2, 8, 2, 4\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), kt(np.zeros((2, 4, 8), "float32")), kt(X[:, :3])),
            ValueError,
            r"key must have shape \(b, j, D\) with value's j = 4, got \(2, 3, 8\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), kt(np.zeros((3, 4, 8), "float32"))),
            ValueError,
            r"value must have shape \(b, j, D\) with the query's b = 2, got \(3, 4, 8\)",
        ),
        # The value sequence's own positions (cross-attention): shapes, dtypes, where they apply.
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(
                kt(X), kt(X[:, :3]), segment_ids=kt(SEG), value_segment_ids=kt(SEG[:, :4])
            ),
            ValueError,
            r"value_segment_ids must have shape \(b, j\) = \(2, 3\), got \(2, 4\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(
                kt(X),
                kt(X[:, :3]),
                segment_ids=kt(SEG),
                value_segment_ids=kt(SEG[:, :3]),
                value_mask=kt(np.ones((2, 3), bool)),
                key_mask=kt(np.ones((2, 4), bool)),
            ),
            ValueError,
            r"key_mask must have shape \(b, j\) = \(2, 3\), got \(2, 4\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(
                kt(X), kt(X[:, :3]), segment_ids=kt(SEG), value_segment_ids=kt(SEG[:1, :3])
            ),
            ValueError,
            r"value_segment_ids must have shape \(b, j\) = \(2, 3\), got \(1, 3\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(
                kt(X),
                kt(X[:, :3]),
                segment_ids=kt(SEG),
                value_segment_ids=kt(np.zeros((2, 3), "float32")),
            ),
            TypeError,
            "value_segment_ids must hold integers, got dtype float32",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), kt(X[:, :3]), value_positions=kt(np.zeros((3, 3), "int32"))),
            ValueError,
            r"value_positions must have shape \(j,\) or \(b, j\) = \(2, 3\), got \(3, 3\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), kt(X[:, :3]), value_positions=kt(np.arange(5))),
            ValueError,
            r"value_positions must have shape \(j,\) or \(b, j\) = \(2, 3\), got \(1, 5\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(
                kt(X),
                kt(X[:, :3]),
                segment_ids=kt(SEG),
                value_segment_ids=kt(SEG[:, :3]),
                value_positions=kt(np.arange(3)),
            ),
            ValueError,
            "pass at most one of value_positions and value_segment_ids",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), segment_ids=kt(SEG), positions=kt(np.arange(5))),
            ValueError,
            "pass at most one of positions and segment_ids: explicit positions are one sequence",
        ),
        *(
            (
                lambda: rk.RelativeMultiHeadAttention(2, 4),
                call,
                ValueError,
                r"value_segment_ids need a distinct value sequence \(cross-attention\)",
            )
            for call in (
                lambda layer: layer(kt(X), value_segment_ids=kt(SEG)),
                lambda layer: layer(X, X, segment_ids=SEG, value_segment_ids=SEG),
            )
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), value_positions=kt(np.arange(5))),
            ValueError,
            r"value_positions need a distinct value sequence \(cross-attention\)",
        ),
        # A cache is self-attention only: in cross-attention it used to take the value tokens
        # into slots sized by the query (meaningless numbers), whatever else is passed.
        *(
            (
                lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
                call,
                ValueError,
                r"a cache cannot be combined with cross-attention \(a distinct value\): a "
                "cross-attention layer takes the whole context at every step",
            )
            for call in (
                lambda layer: layer(
                    kt(X), kt(X[:, :3]), cache=layer.empty_cache(2, 8), cache_update_index=0
                ),
                lambda layer: layer(  # an equal but distinct tensor is cross-attention
                    kt(X), kt(X), cache=layer.empty_cache(2, 8), cache_update_index=0
                ),
                lambda layer: layer(
                    kt(X),
                    kt(X),
                    cache=layer.empty_cache(2, 8),
                    cache_update_index=0,
                    value_positions=kt(np.arange(5)),
                ),
            )
        ),
        # start_index beside what places every token (it used to be ignored); the default 0 is
        # not "given", any tensor is (decided on the arguments, as under jit).
        *(
            (
                lambda: rk.RelativeMultiHeadAttention(2, 4),
                call,
                ValueError,
                "pass at most one of positions and start_index: explicit positions place every "
                "token, so start_index would be ignored",
            )
            for call in (
                lambda layer: layer(kt(X), positions=kt(np.arange(5)), start_index=2),
                lambda layer: layer(
                    kt(X), positions=kt(np.arange(5)), start_index=kt(np.zeros(2, "int32"))
                ),
                lambda layer: layer(kt(X), kt(X[:, :3]), positions=kt(np.arange(5)), start_index=1),
            )
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(
                kt(X), cache=layer.empty_cache(2, 8), cache_update_index=0, start_index=3
            ),
            ValueError,
            "with a cache, positions come from cache_mask; do not pass start_index",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, causal=True),
            lambda layer: layer(
                kt(X),
                cache=layer.empty_cache(2, 8),
                cache_update_index=0,
                positions=kt(np.arange(5)),
                segment_ids=kt(SEG),
            ),
            ValueError,
            "with a cache, positions come from cache_mask; do not pass positions or segment_ids",
        ),
        # Segment ids below -1, eagerly, as PyTorch's Positions.from_segments: the query's (alone
        # or beside query_mask), the value sequence's, and the position layers'.
        *(
            (make, call, ValueError, rf"{name} must be >= 0, or -1 for padding \(got -2\)")
            for make, call, name in (
                (
                    lambda: rk.RelativeMultiHeadAttention(2, 4),
                    lambda layer: layer(kt(X), segment_ids=kt(SEG - 1)),
                    "segment_ids",
                ),
                (
                    lambda: rk.RelativeMultiHeadAttention(2, 4),
                    lambda layer: layer(
                        kt(X), segment_ids=kt(SEG - 1), query_mask=kt(np.ones((2, 5), bool))
                    ),
                    "segment_ids",
                ),
                (
                    lambda: rk.RelativeMultiHeadAttention(2, 4),
                    lambda layer: layer(
                        kt(X),
                        kt(X[:, :3]),
                        segment_ids=kt(SEG),
                        value_segment_ids=kt(SEG[:, :3] - 2),
                    ),
                    "value_segment_ids",
                ),
                (
                    lambda: rk.RotaryEmbedding(),
                    lambda layer: layer(kt(X), segment_ids=kt(SEG - 1)),
                    "segment_ids",
                ),
                (
                    lambda: rk.PositionEmbedding(6),
                    lambda layer: layer(kt(X), segment_ids=kt(SEG - 1), mask=kt(SEG >= 0)),
                    "segment_ids",
                ),
                (
                    lambda: None,
                    lambda _: rk.positions.positions_from_segments(kt(SEG - 1)),
                    "segment_ids",
                ),
            )
        ),
        # In cross-attention segment_ids go with value_segment_ids: one side alone would be one
        # document, and the other side's documents past 0 would attend to nothing (zeros).
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), kt(X[:, :3]), segment_ids=kt(SEG)),
            ValueError,
            r"in cross-attention segment_ids needs value_segment_ids \(b, j\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), kt(X[:, :3]), value_segment_ids=kt(SEG[:, :3])),
            ValueError,
            r"in cross-attention value_segment_ids needs the queries' segment_ids \(b, i\)",
        ),
        # Keys of another sequence with the queries as values: Keras' layer needs value= too.
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4),
            lambda layer: layer(kt(X), key=kt(X + 1.0)),
            ValueError,
            "key given without value: pass value= too",
        ),
    ],
)
def test_bad_call_arguments(make, call, error, match):
    with pytest.raises(error, match=match):
        call(make())


def test_traced_token_ids_are_not_checked():
    """Under ``jit`` / ``tf.function`` token ids are traced and cannot be read: no check there
    (docs/keras.md); a negative id reads row ``id + vocabulary_size``, as the gather does."""
    layer = rk.TokenAndPositionEmbedding(20, 8, 4)
    layer.build((1, 3))  # the weights exist before tracing
    fn = traced(lambda ids: layer(ids))
    if fn is None:
        pytest.skip("the torch backend runs eagerly")
    got = np_(fn(kt(np.array([[1, -1, 2]], "int32"))))
    np.testing.assert_allclose(got, np_(layer(kt(np.array([[1, 19, 2]], "int32")))), atol=1e-6)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: rk.RelativeMultiHeadAttention(0, 4),
            ValueError,
            "num_heads must be >= 1, got 0",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme="bogus"),
            ValueError,
            r"unknown scheme 'bogus'; Keras attention schemes: \['alibi', 'cope', 'deberta', "
            r"'dpb', 'fire', 'forgetting', 'kerple', 'learned_alibi', 'music', 'nope', 'rope', "
            r"'sandwich', 'shaw', 't5', 'transformer_xl'\]",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(1, 3, scheme="transformer_xl"),
            ValueError,
            r"transformer_xl needs an even d_model, got 3",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(
                2, 4, scheme={"name": "kerple", "variant": "cubic"}
            ),
            ValueError,
            r"variant must be one of \('log', 'power'\), got 'cubic'",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme="learned"),
            ValueError,
            "is absolute: it acts at the input",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme={"name": "shaw", "k": 3}),
            ValueError,
            r"unknown key\(s\) \['k'\] for scheme 'shaw'",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, value_dim=3, scheme="shaw"),
            ValueError,
            r"needs value_dim == key_dim \(4\), got 3",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, scheme=3),
            TypeError,
            "scheme must be a name, a config dict or a SchemeConfig, got int",
        ),
        *(
            (
                lambda name=name: rk.RelativeMultiHeadAttention(2, 4, scheme=name),
                ValueError,
                f"{name} needs causal=True: the scheme is causal only",
            )
            for name in ("cope", "forgetting", "fire")
        ),
        (lambda: rk.RelativeMultiHeadAttention(2, 4, dropout=1.0), ValueError, "dropout"),
        (
            lambda: rk.RelativeMultiHeadAttention(3, 4, num_key_value_heads=2),
            ValueError,
            r"num_heads \(3\) must be a multiple of num_key_value_heads \(2\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, num_key_value_heads=0),
            ValueError,
            "num_key_value_heads must be >= 1, got 0",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(
                2, 4, scheme={"name": "rope", "xpos_scale_base": 512.0}
            ),
            ValueError,
            r"xPos needs causal attention: its scale",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(
                2, 4, scheme={"name": "rope", "learned_freq": True, "scaling": DYNAMIC}
            ),
            ValueError,
            "learned_freq cannot be combined with rope_type 'dynamic'",
        ),
        (
            lambda: rk.Transformer(11, d_model=16, num_heads=4, num_kv_heads=3),
            ValueError,
            r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, attention_axes=(2,)),
            ValueError,
            r"attention_axes is not supported: relpos attends over the sequence axis of "
            r"\(b, n, D\) inputs \(axis 1\) only, got \(2,\)",
        ),
        (
            lambda: rk.RelativeMultiHeadAttention(2, 4, output_shape=(2, 3)),
            ValueError,
            r"output_shape must be an int or a 1-tuple \(the output width\)",
        ),
        (lambda: rk.PositionEmbedding(None), ValueError, "sequence_length must be an int"),
        (
            lambda: rk.T5RelativeBias(2, num_buckets=3),
            ValueError,
            "bidirectional T5 bias needs an even num_buckets >= 4",
        ),
        (
            lambda: rk.T5RelativeBias(2, num_buckets=32, max_distance=16, bidirectional=False),
            ValueError,
            r"max_distance \(16\) must exceed the exact buckets per direction \(16\)",
        ),
        (
            lambda: rk.RotaryEmbedding(rotary_dim=3),
            ValueError,
            "rotary_dim must be a positive even",
        ),
        (
            lambda: rk.RotaryEmbedding(rope_type="ntk"),
            ValueError,
            r"rope_type must be one of \('linear', 'dynamic', 'yarn'\) \(keras-hub's\), got 'ntk'",
        ),
        (
            lambda: rk.RotaryEmbedding(rope_type="yarn", denominator_dim=8),
            ValueError,
            r"denominator_dim \(8\) is not read with rope_type='yarn'",
        ),
        (
            lambda: rk.RotaryEmbedding(denominator_dim=0),
            ValueError,
            "denominator_dim must be a positive int, got 0",
        ),
        (lambda: rk.RotaryEmbedding(truncate=1), ValueError, "truncate must be a bool, got 1"),
        *(
            (
                lambda name=name, value=value: rk.RotaryEmbedding(**{name: value}),
                ValueError,
                f"{name} must be a finite number > 0, got {value!r}",
            )
            for name in (
                "max_wavelength",
                "scaling_factor",
                "beta_fast",
                "beta_slow",
                "original_max_position_embeddings",
            )
            for value in (0, float("nan"), float("inf"))
        ),
        *(
            (
                lambda value=value: rk.SinePositionEncoding(value),
                ValueError,
                f"max_wavelength must be a finite number > 0, got {value!r}",
            )
            for value in (-1.0, float("nan"), float("inf"), "10")
        ),
        (
            lambda: rk.RelativePositionEmbedding(-1, 4),
            ValueError,
            "max_distance must be an int >= 0",
        ),
    ],
)
def test_bad_constructor_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.torch_reference
def test_from_torch_refuses_what_it_cannot_convert():
    import torch

    with pytest.raises(TypeError, match="from_torch does not convert Linear"):
        rk.from_torch(torch.nn.Linear(2, 2))
