"""The framework-neutral layer (``relpos.spec``, issue 44) and typed, range-checked config fields
(issue 45, item 2).

* ``relpos.spec`` imports neither torch nor keras; the top-level configs are its classes;
* its numpy tables are the ones the PyTorch schemes use (DeBERTa's rows equal the PyTorch
  bucket function's everywhere);
* every config field drawn from {valid, boundary, wrong type, NaN, ±inf, negative, 0} gives a
  config, or a ``ValueError``/``TypeError`` naming the field; an accepted config builds a layer
  (or refuses the geometry) and runs to finite outputs; every ``rope_scaling`` key likewise;
* ``causal`` is a bool everywhere; YaRN's and Llama 3's keys are typed and ordered.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relpos
from relpos import spec
from relpos.functional import deberta_buckets
from relpos.spec.rope_scaling import check_rope_scaling, scaled_rope_frequencies

NAN, INF = math.nan, math.inf
#: Values drawn for any field: valid or boundary for some, a wrong type, NaN, ±inf, negative, 0.
ANY_VALUE = [0, 1, 2, 3, 4, 8, -1, 0.0, 0.5, 2.0, NAN, INF, -INF, -2.5, True, False, None, "1"]
ANY_VALUE += [[], [0], [1, 0], [0.5, 0.25], [NAN], "c2p"]


def _built(build):
    """``(value, None)``, or ``(None, error)`` for a ``ValueError``/``TypeError``."""
    try:
        return build(), None
    except (ValueError, TypeError) as error:
        return None, error


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )  # fmt: skip


def test_spec_imports_neither_torch_nor_keras():
    code = (
        "import sys, relpos.spec; "
        "assert not {'torch', 'keras'} & set(sys.modules), sorted(sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_top_level_configs_are_the_spec_classes():
    assert relpos.T5Config is spec.t5.T5Config
    assert relpos.SCHEMES["rope"].config_class is spec.RotaryConfig
    assert {name: cls.config_class for name, cls in relpos.SCHEMES.items()} == spec.CONFIGS
    for name, cls in relpos.SCHEMES.items():
        assert cls.causal_only == spec.CONFIGS[name].causal_only, name


@pytest.mark.parametrize(("buckets", "max_rel"), [(4, 8), (8, 32), (256, 512), (0, 16), (2, 5)])
def test_deberta_rows_equal_the_pytorch_bucket_function(buckets, max_rel):
    config = spec.DebertaConfig(position_buckets=buckets, max_relative_positions=max_rel)
    rel = np.arange(-3 * config.reach, 3 * config.reach + 1)
    want = deberta_buckets(
        torch.from_numpy(rel), position_buckets=buckets, max_relative_positions=max_rel
    )
    want = (want + config.span).clamp(0, 2 * config.span - 1).numpy()
    table = config.index_table()
    assert np.array_equal(table[np.clip(rel, -config.reach, config.reach) + config.reach], want)


@st.composite
def field_cases(draw):
    name = draw(st.sampled_from(sorted(spec.CONFIGS)))
    fields = [f.name for f in dataclasses.fields(spec.CONFIGS[name])]
    if not fields:
        return name, None, None
    field = draw(st.sampled_from(fields))
    return name, field, draw(st.sampled_from(ANY_VALUE))


@fuzz(150)
@given(case=field_cases(), causal=st.booleans())
def test_every_field_is_typed_and_range_checked(case, causal):
    name, field, value = case
    data = {"name": name} if field is None else {"name": name, field: value}
    config, error = _built(lambda: spec.config_from_dict(data))
    if error is not None:
        assert field in str(error), (data, error)
        return
    for f in dataclasses.fields(config):  # what is kept is what the field means
        kept = getattr(config, f.name)
        if isinstance(kept, float):
            assert math.isfinite(kept), (data, f.name)
    try:
        layer = relpos.TokenPositionEmbedding if name in spec.ABSOLUTE_SCHEMES else None
        if layer is not None:
            module = layer(5, 8, config)
            out = module(torch.tensor([[1, 2, 3]]))
        else:
            module = relpos.MultiheadAttention(8, 2, config, causal=causal, backend="eager")
            out = module(torch.randn(1, 3, 8))
    except (ValueError, TypeError):
        return  # a geometry the config refuses (odd widths, causal-only): named elsewhere
    assert torch.isfinite(out).all(), data


#: One valid scaling per type; each key is then replaced by a drawn value.
SCALINGS = [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "ntk", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
    {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.0],
        "long_factor": [2.0, 3.0],
        "factor": 2.0,
        "original_max_position_embeddings": 16,
    },
]
OPTIONAL = ["beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"]
OPTIONAL += ["max_position_embeddings"]


@fuzz(200)
@given(
    base=st.sampled_from(SCALINGS),
    key=st.sampled_from(["factor", "original_max_position_embeddings", *OPTIONAL]),
    value=st.sampled_from(ANY_VALUE),
)
def test_every_rope_scaling_key_is_typed_and_range_checked(base, key, value):
    scaling = {**base, key: value}
    normal, error = _built(lambda: check_rope_scaling(scaling, theta=1e4))
    if error is not None:
        assert key in str(error) or "rope_type" in str(error), (scaling, error)
        return
    inv, factor = scaled_rope_frequencies(4, 1e4, normal)
    assert np.isfinite(inv).all() and (inv > 0).all(), scaling
    assert math.isfinite(factor) and factor > 0, scaling


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("scaling", "error", "match"),
    [
        *[
            ({**YARN, key: bad}, ValueError, rf"{key} must be a finite number > 0, got {bad}")
            for key in ("attention_factor", "mscale", "mscale_all_dim")
            for bad in (NAN, -1.0, 0)
        ],
        ({**YARN, "truncate": "yes"}, TypeError, r"truncate must be a bool, got str \('yes'\)"),
        ({**YARN, "truncate": 1}, TypeError, r"truncate must be a bool, got int \(1\)"),
        ({**YARN, "beta_fast": NAN}, ValueError, "beta_fast must be a finite number > 0, got nan"),
        (
            {**YARN, "beta_fast": 1.0, "beta_slow": 32.0},
            ValueError,
            r"beta_fast \(1.0\) must exceed beta_slow \(32.0\)",
        ),
        (
            {**LLAMA3, "original_max_position_embeddings": 1.5},
            TypeError,
            r"original_max_position_embeddings must be an int, got float \(1.5\)",
        ),
        (
            {"rope_type": "linear", "type": "dynamic", "factor": 2.0},
            ValueError,
            r"rope_type 'linear' and type 'dynamic' disagree",
        ),
        ({**YARN, "factor": "4"}, TypeError, r"factor must be a number, got str \('4'\)"),
    ],
)
def test_rope_scaling_values_that_make_no_sense_are_refused(scaling, error, match):
    """Issue 45, item 2."""
    with pytest.raises(error, match=match):
        relpos.RotaryConfig(scaling=scaling)


def test_rope_type_and_an_agreeing_type_are_accepted():
    config = relpos.RotaryConfig(scaling={"rope_type": "linear", "type": "linear", "factor": 2.0})
    assert config.scaling_dict == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    "build",
    [
        lambda: relpos.MultiheadAttention(8, 2, "rope", causal="false"),
        lambda: relpos.TransformerConfig(vocab_size=4, causal="false"),
        lambda: relpos.make_scheme("alibi", d_model=8, num_heads=2, causal=1),
    ],
    ids=["attention", "model config", "make_scheme"],
)
def test_causal_must_be_a_bool(build):
    """Issue 45, item 2: ``causal="false"`` (truthy) ran causal."""
    with pytest.raises(TypeError, match=r"causal must be a bool, got"):
        build()


def test_t5_distance_within_the_exact_buckets_is_refused():
    """Issue 44's example: its log buckets would be scaled by ``log(1) = 0``."""
    with pytest.raises(ValueError, match=r"max_distance \(16\) must exceed the exact buckets"):
        relpos.MultiheadAttention(
            16, 2, {"name": "t5", "num_buckets": 32, "max_distance": 16}, causal=True
        )


TORCH_SIDE = ("torch", "relpos.functional", "relpos.schemes", "relpos.attention", "relpos.models")


def _module_level_imports(path):
    """The modules a file imports at module level (not inside functions or TYPE_CHECKING)."""
    import ast

    package = "relpos." + ".".join(path.relative_to(SRC).with_suffix("").parts[:-1])
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                found.append(".".join([*base, *([node.module] if node.module else [])]))
            else:
                found.append(node.module)
    return found


SRC = __import__("pathlib").Path(relpos.__file__).parent


@pytest.mark.parametrize(
    "path", sorted((SRC / "keras").rglob("*.py")) + sorted((SRC / "spec").rglob("*.py")),
    ids=lambda p: str(p.relative_to(SRC)),
)  # fmt: skip
def test_keras_and_spec_import_nothing_from_the_torch_side(path):
    """The Keras layers build from the spec only; ``from_torch`` imports the PyTorch classes when
    it runs (issue 44)."""
    bad = [m for m in _module_level_imports(path) if m.startswith(TORCH_SIDE)]
    assert not bad, bad
