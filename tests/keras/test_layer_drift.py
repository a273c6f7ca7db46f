"""The attention layers' own arguments are checked once (``relpos.spec.base``) for both frameworks
(issue 44): ``relpos.MultiheadAttention(d_model, num_heads, num_kv_heads=, dropout=)`` and
``RelativeMultiHeadAttention(num_heads, key_dim, num_key_value_heads=, dropout=)`` accept the same
head counts and rates and refuse the rest with the same error type and message, the grouped heads
named by each framework's own argument. The two ``Transformer`` models (one
``ModelConfig``) likewise. Every combination of valid, edge and invalid values: constructors only.
"""

from __future__ import annotations

import itertools
import math

import pytest

import relpos
from relpos.keras import RelativeMultiHeadAttention
from relpos.keras import Transformer as KerasTransformer

pytestmark = pytest.mark.torch_reference

KEY_DIM = 4
NUM_HEADS = [1, 2, 4, 0, -1, "2", True, 2.0]
NUM_KV_HEADS = [None, 1, 2, 3, 0, "1", False]
DROPOUT = [0.0, 0.5, 1.0, -0.1, math.nan, "0.1", True]


def outcome(make, *args, **kwargs) -> tuple[str, str] | None:
    """None where ``make(*args, **kwargs)`` builds, else the error's type and message."""
    try:
        make(*args, **kwargs)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


def width(num_heads) -> int:
    """The PyTorch layer's ``d_model`` for ``num_heads`` heads of ``KEY_DIM`` (any value where
    ``num_heads`` is not a positive int: the head count is checked first)."""
    valid = isinstance(num_heads, int) and not isinstance(num_heads, bool) and num_heads > 0
    return num_heads * KEY_DIM if valid else KEY_DIM


def torch_transformer(**args) -> relpos.Transformer:
    return relpos.Transformer(relpos.TransformerConfig(**args))


@pytest.mark.parametrize("dropout", DROPOUT, ids=repr)
def test_attention_layers_accept_and_refuse_alike(dropout):
    for num_heads, num_kv_heads in itertools.product(NUM_HEADS, NUM_KV_HEADS):
        torch_side = outcome(
            relpos.MultiheadAttention,
            width(num_heads),
            num_heads,
            "nope",
            num_kv_heads=num_kv_heads,
            dropout=dropout,
        )
        keras_side = outcome(
            RelativeMultiHeadAttention,
            num_heads,
            KEY_DIM,
            num_key_value_heads=num_kv_heads,
            dropout=dropout,
        )
        if keras_side is not None:
            kind, message = keras_side
            keras_side = kind, message.replace("num_key_value_heads", "num_kv_heads")
        assert keras_side == torch_side, (num_heads, num_kv_heads, dropout)


@pytest.mark.parametrize("dropout", DROPOUT, ids=repr)
def test_transformers_accept_and_refuse_alike(dropout):
    for num_heads, num_kv_heads in itertools.product(NUM_HEADS, NUM_KV_HEADS):
        args = dict(
            vocab_size=11,
            d_model=width(num_heads),
            num_heads=num_heads,
            num_layers=1,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
        )
        torch_side = outcome(torch_transformer, **args)
        keras_side = outcome(KerasTransformer, **args)
        assert keras_side == torch_side, args


def test_the_grid_meets_every_rule():
    """Not vacuous: the grid builds some layers and reaches each rule in both frameworks."""
    seen = set()
    for num_heads, num_kv_heads, dropout in itertools.product(NUM_HEADS, NUM_KV_HEADS, DROPOUT):
        got = outcome(
            RelativeMultiHeadAttention,
            num_heads,
            KEY_DIM,
            num_key_value_heads=num_kv_heads,
            dropout=dropout,
        )
        seen.add("built" if got is None else got[1].split(" ")[0] + " " + got[0])
    assert {
        "built",
        "num_heads TypeError",
        "num_heads ValueError",
        "num_key_value_heads TypeError",
        "num_key_value_heads ValueError",
        "dropout TypeError",
        "dropout ValueError",
    } <= seen, seen
