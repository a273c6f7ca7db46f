"""Pure tensor functions: the math of every scheme, stateless and compile-friendly."""

from .alibi import alibi_bias, alibi_slopes
from .dtypes import compute_dtype
from .relative import clipped_relative_index, relative_distance
from .rope import apply_rope, rope_angles, rope_frequencies
from .sinusoidal import sinusoid_frequencies, sinusoidal_table
from .skew import gather_relative, scatter_relative, skew
from .t5 import t5_buckets

__all__ = [
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "clipped_relative_index",
    "compute_dtype",
    "gather_relative",
    "relative_distance",
    "rope_angles",
    "rope_frequencies",
    "scatter_relative",
    "sinusoid_frequencies",
    "sinusoidal_table",
    "skew",
    "t5_buckets",
]
