"""Drift between the frameworks is tested, not trusted (issue 44): Hypothesis draws scheme specs
(valid, edge and invalid: zero and one heads, buckets equal to the distance, odd widths, huge
distances, NaN, wrong types) with a geometry and ``causal``, and checks that PyTorch and Keras

* accept the same ones and refuse the same ones with the same error type and message, for the
  scheme alone (``relpos.make_scheme`` / ``make_attention_scheme``) and for the attention layers
  (``relpos.MultiheadAttention`` / ``RelativeMultiHeadAttention``) where the layer geometry is
  valid (the layers' own arguments, checked before the spec: test_layer_drift.py);
* give the same outputs where accepted, the Keras layer built by ``from_torch``.

Cheap by design (few examples, one 5-token row): it runs on every Keras backend. The PyTorch side
needs torch (``torch_reference``), imported by those tests alone.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relpos
from relpos.keras import RelativeMultiHeadAttention, from_torch, make_attention_scheme
from relpos.keras.schemes import KERAS_SCHEMES

from .util import COMPILED, kt, np_

NAN, INF = math.nan, math.inf
#: Valid and edge values (accepted or not depending on the geometry), then invalid ones.
HEADS = ([None, [0], [1], [0, 2]], [[], [-1], [0.5]])
SLOPES = ([None, [0.5, 0.25], [0.0, 1.0, 0.5]], [[NAN, 0.5], [-1.0, 0.5], [0.0, INF]])
SCALINGS = (
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 3},
        {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0], "factor": 2.0,
         "original_max_position_embeddings": 3},
    ],
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
         "beta_fast": NAN},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1.5},
        {"rope_type": "linear", "type": "dynamic", "factor": 2.0},
    ],
)  # fmt: skip
#: Each scheme's fields: (valid and edge values, invalid values).
FIELDS: dict[str, dict[str, tuple[list, list]]] = {
    "nope": {},
    "forgetting": {},
    "t5": {
        "num_buckets": ([2, 4, 7, 8, 32], [0, -2, NAN, "8"]),
        "max_distance": ([1, 2, 4, 16, 2**40], [0, NAN, True]),
        "heads": HEADS,
    },
    "alibi": {"slopes": SLOPES, "heads": HEADS},
    "learned_alibi": {"slopes": SLOPES, "heads": HEADS},
    "shaw": {
        "max_distance": ([0, 1, 3, 10**4], [-1, NAN]),
        "keys": ([True, False], ["no"]),
        "values": ([True, False], [0]),
        "per_head": ([True, False], [None]),
    },
    "music": {"max_distance": ([0, 1, 3, 10**4], [-1, 2.5])},
    "transformer_xl": {"max_distance": ([0, 1, 3, 10**4], [-1, NAN])},
    "kerple": {"variant": (["log", "power"], ["cubic", 1]), "heads": HEADS},
    "dpb": {
        "hidden": ([1, 4], [0, NAN]),
        "depth": ([0, 1], [-1]),
        "log_distance": ([True, False], [1]),
        "heads": HEADS,
    },
    "sandwich": {
        "dim": ([2, 8], [3, 0]),
        "base": ([1.5, 2.0, 1e4], [1.0, NAN, INF, -2.0]),
        "heads": HEADS,
    },
    "fire": {
        "hidden": ([1, 4], [0]),
        "init_c": ([0.1, 2.0], [0.0, NAN, INF]),
        "init_threshold": ([1.0, 4.5], [-1.0, NAN]),
        "heads": HEADS,
    },
    "cope": {"npos_max": ([1, 4], [0, -1]), "per_head": ([True, False], ["yes"])},
    "deberta": {
        "position_buckets": ([0, 2, 4], [3, -1]),
        "max_relative_positions": ([4, 8, 10**4], [1, 0]),
        "pos_att_type": ([["c2p"], ["p2c"], "c2p|p2c"], [[], ["x"]]),
        "share_att_key": ([True, False], ["yes"]),
        "norm_rel_ebd": (["none", "layer_norm"], ["batch"]),
    },
    "rope": {
        "theta": ([1.0, 2.0, 1e4], [0.0, NAN, INF]),
        "rotary_dim": ([None, 2, 4, 8], [3]),
        "interleaved": ([True, False], ["no"]),
        "xpos_scale_base": ([None, 8.0], [0.0, NAN]),
        "learned_freq": ([False, True], [1]),
        "scaling": SCALINGS,
        "sections": ([None, [1, 1], [2]], [[0]]),
        "axial": ([False, True], ["no"]),
    },
}


def test_every_keras_scheme_is_drawn():
    assert set(FIELDS) == set(KERAS_SCHEMES)


@st.composite
def cases(draw):
    """A spec and a geometry: valid and edge values, with one invalid value (a field, zero heads
    or a ``causal`` that is no bool) half of the time."""
    name = draw(st.sampled_from(sorted(FIELDS)))
    fields = FIELDS[name]
    spec = {"name": name}
    for field, (valid, _) in fields.items():
        if draw(st.booleans()):
            spec[field] = draw(st.sampled_from(valid))
    num_heads = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([1, 2, 3, 4, 4]))
    causal = draw(st.sampled_from([True, False]))
    if draw(st.booleans()):
        broken = draw(st.sampled_from([*fields, "num_heads", "causal"]))
        if broken == "num_heads":
            num_heads = 0
        elif broken == "causal":
            causal = draw(st.sampled_from(["false", 1, None]))
        else:
            spec[broken] = draw(st.sampled_from(fields[broken][1]))
    return spec, num_heads, head_dim, causal


def _outcome(build):
    """``("ok", value)`` or ``("error", type name, message)``."""
    try:
        return ("ok", build())
    except (ValueError, TypeError) as error:
        return ("error", type(error).__name__, str(error))


def _same_refusal(torch_side, keras_side):
    assert (torch_side[0], keras_side[0]) in (("ok", "ok"), ("error", "error")), (
        torch_side,
        keras_side,
    )
    if torch_side[0] == "error":
        assert torch_side[1:] == keras_side[1:]


def _torch_module(spec, h, d, causal):
    import torch

    module = relpos.MultiheadAttention(h * d, h, spec, causal=causal, backend="eager").eval()
    with torch.no_grad():  # off their initial values: only copied weights agree
        for p in module.scheme.parameters():
            p.mul_(1.0 + 0.3 * torch.rand_like(p))
            if not p.any():
                p.normal_(0.0, 0.5)
    return module


@settings(
    max_examples=12 if COMPILED else 30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases())
@pytest.mark.torch_reference
def test_both_frameworks_accept_refuse_and_compute_alike(case):
    import torch

    spec, h, d, causal = case
    torch_scheme = _outcome(
        lambda: relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=causal)
    )
    keras_scheme = _outcome(
        lambda: make_attention_scheme(spec, num_heads=h, head_dim=d, causal=causal)
    )
    _same_refusal(torch_scheme, keras_scheme)
    if h < 1:
        return  # the layers refuse it in their own words, before the spec
    torch.manual_seed(zlib.crc32(repr(case).encode()))
    torch_layer = _outcome(lambda: _torch_module(spec, h, d, causal))
    keras_layer = _outcome(lambda: RelativeMultiHeadAttention(h, d, scheme=spec, causal=causal))
    _same_refusal(torch_layer, keras_layer)
    if torch_layer[0] == "error":
        return
    module = torch_layer[1]
    x = torch.randn(1, 5, h * d)
    with torch.no_grad():
        want = module(x).numpy()
    got = np_(from_torch(module)(kt(x)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=repr(spec))


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            lambda spec: relpos.MultiheadAttention(16, 2, spec, causal=True),
            marks=pytest.mark.torch_reference,
            id="torch",
        ),
        pytest.param(
            lambda spec: RelativeMultiHeadAttention(
                num_heads=2, key_dim=8, scheme=spec, causal=True
            ),
            id="keras",
        ),
    ],
)
def test_t5_distance_within_the_exact_buckets_is_refused_by_both(build):
    """Issue 44's example: 32 causal buckets are 16 exact ones and 16 log-spaced ones from
    distance 16 to ``max_distance``; at ``max_distance = 16`` their scale is ``log(1) = 0``."""
    spec = {"name": "t5", "num_buckets": 32, "max_distance": 16}
    with pytest.raises(
        ValueError, match=r"max_distance \(16\) must exceed the exact buckets per direction \(16\)"
    ):
        build(spec)


def test_causal_must_be_a_bool_in_the_keras_layer():
    """Issue 45, item 2: ``causal="false"`` (truthy) ran causal."""
    with pytest.raises(TypeError, match=r"causal must be a bool, got str \('false'\)"):
        RelativeMultiHeadAttention(2, 4, scheme="rope", causal="false")
