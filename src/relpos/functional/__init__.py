"""Pure tensor functions: the math of every scheme, stateless and compile-friendly."""

from .alibi import alibi_bias, alibi_slopes
from .cope import cope_logits, cope_positions
from .deberta import deberta_buckets, deberta_index, deberta_span
from .distance_form import DISTANCE_FORMS, DistanceForm, distance_form_bias
from .dtypes import compute_dtype
from .fire import fire_bias, fire_inputs, fire_pairs
from .kerple import kerple_bias
from .pair_bias import PairBias
from .relative import clipped_relative_index, relative_distance
from .rope import apply_rope, rope_angles, rope_frequencies
from .rope_scaling import scaled_rope_frequencies, sequence_rope_frequencies
from .sandwich import sandwich_bias, sandwich_head_scales
from .sinusoidal import sinusoid_frequencies, sinusoidal_table
from .skew import (
    gather_relative,
    gather_table,
    scatter_relative,
    scatter_table,
    skew,
)
from .t5 import t5_buckets
from .xpos import xpos_decay, xpos_max_position, xpos_scale

__all__ = [
    "DISTANCE_FORMS",
    "DistanceForm",
    "PairBias",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "clipped_relative_index",
    "compute_dtype",
    "cope_logits",
    "cope_positions",
    "deberta_buckets",
    "deberta_index",
    "deberta_span",
    "distance_form_bias",
    "fire_bias",
    "fire_inputs",
    "fire_pairs",
    "gather_relative",
    "gather_table",
    "kerple_bias",
    "relative_distance",
    "rope_angles",
    "rope_frequencies",
    "sandwich_bias",
    "sandwich_head_scales",
    "scaled_rope_frequencies",
    "scatter_relative",
    "scatter_table",
    "sequence_rope_frequencies",
    "sinusoid_frequencies",
    "sinusoidal_table",
    "skew",
    "t5_buckets",
    "xpos_decay",
    "xpos_max_position",
    "xpos_scale",
]
