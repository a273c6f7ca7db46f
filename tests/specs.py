"""The scheme specs under test, shared by the PyTorch suite and the Keras suite, and the pure
helpers on them. Imports no torch (:mod:`relpos.spec` only): the Keras suite runs in a Keras
user's install too, where torch is absent (``tests/run_suites.py``)."""

from __future__ import annotations

from relpos.spec import RotaryConfig, config_class

#: Scheme configurations under test: every registered scheme, plus its important variants. Sizes
#: are small so that clipping and bucketing edges are reached by short sequences.
SCHEME_SPECS: list[dict] = [
    {"name": "nope"},
    {"name": "sinusoidal"},
    {"name": "sinusoidal", "interleaved": False},
    {"name": "learned", "max_len": 64},
    {"name": "shaw", "max_distance": 2},
    {"name": "shaw", "max_distance": 3, "per_head": True},
    {"name": "shaw", "max_distance": 2, "values": False},
    {"name": "shaw", "max_distance": 2, "keys": False},
    {"name": "music", "max_distance": 4},
    {"name": "t5", "num_buckets": 8, "max_distance": 12},
    {"name": "transformer_xl", "max_distance": 5},
    # DeBERTa: log buckets from distance 3, clipped beyond 7 (rows 0..7); c2p only, unbucketed
    # (no key term: the region path). tests/test_deberta.py draws the other variants.
    {"name": "deberta", "position_buckets": 4, "max_relative_positions": 8},
    {
        "name": "deberta",
        "pos_att_type": ["c2p"],
        "position_buckets": 0,
        "max_relative_positions": 3,
        "share_att_key": False,
        "norm_rel_ebd": "none",
    },
    # CoPE: contextual positions clamp at 5, reached by short sequences. Causal only (its
    # bidirectional cells check the refusal); tests/test_cope.py runs its backends.
    {"name": "cope", "npos_max": 6},
    {"name": "alibi"},
    {"name": "learned_alibi"},
    {"name": "kerple"},
    {"name": "kerple", "variant": "power"},
    {"name": "dpb", "hidden": 8, "depth": 1, "log_distance": True},
    # FIRE's threshold L = 4.5 is crossed by short test sequences: queries on both sides of it.
    {"name": "fire", "hidden": 8, "init_threshold": 4.5},
    {"name": "sandwich", "dim": 32},
    # Per-head control: head 0 alone gets the bias (on the fused T5 paths too).
    {"name": "t5", "num_buckets": 8, "max_distance": 12, "heads": [0]},
    {"name": "kerple", "heads": [0]},
    {"name": "rope"},
    {"name": "rope", "interleaved": True, "rotary_dim": 4},
    {
        "name": "rope",
        "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    },
    # Length-dependent scalings switch at 5 tokens, so short test sequences cross the switch.
    {
        "name": "rope",
        "scaling": {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 5},
    },
    {
        "name": "rope",
        "rotary_dim": 4,
        "scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5],
            "long_factor": [3.0, 5.0],
            "original_max_position_embeddings": 5,
            "factor": 4.0,
        },
    },
    {"name": "rope", "learned_freq": True},
    # Multi-axis rotary on 1-D positions (every axis reads pos); tests/test_multi_axis.py gives
    # them coordinates. rotary_dim 4 fits every head dim the suites draw.
    {"name": "rope", "rotary_dim": 4, "sections": [1, 1]},
    {"name": "rope", "rotary_dim": 4, "sections": [1, 1], "axial": True, "interleaved": True},
    # Causal only: the suites skip its bidirectional cases (causal_only); its positions come from
    # the layer input (contextualize), so the backend suites leave it to tests/test_forgetting.py.
    {"name": "forgetting"},
]


def length_dependent(spec: dict) -> bool:
    """Whether a spec's frequencies follow each sequence's length (dynamic NTK, LongRoPE)."""
    return (
        spec["name"] == "rope"
        and RotaryConfig(**{k: v for k, v in spec.items() if k != "name"}).length_dependent
    )


def causal_only(spec: dict) -> bool:
    """Whether the scheme is defined for causal attention only (CoPE, FIRE, the forget gate):
    building it with ``causal=False`` raises a ``ValueError``. Its config declares it, for both
    frameworks."""
    return config_class(spec["name"]).causal_only
