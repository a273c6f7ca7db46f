"""relpos: positional encodings for transformers, correct for padded, packed and cached batches.

Every scheme is a function of each token's own position inside its own sequence (a
:class:`Positions`), never of array indices.
"""

from . import checks, functional
from .attention import BACKENDS, KVCache, MultiheadAttention, eager_attention
from .embedding import TokenPositionEmbedding
from .models import Transformer, TransformerConfig
from .positions import PAD_SEGMENT, Positions, resolve_positions, sequence_lengths
from .schemes import (
    SCHEMES,
    ALiBi,
    ALiBiConfig,
    DistanceBiasScheme,
    DynamicPositionBias,
    DynamicPositionBiasConfig,
    Kerple,
    KerpleConfig,
    LearnedAbsolute,
    LearnedAbsoluteConfig,
    LearnedALiBi,
    LearnedALiBiConfig,
    LinearBiasScheme,
    MusicConfig,
    MusicRelative,
    NoPE,
    NoPEConfig,
    RelativeScheme,
    Rotary,
    RotaryConfig,
    Scheme,
    SchemeConfig,
    ShawConfig,
    ShawRelative,
    Sinusoidal,
    SinusoidalConfig,
    T5Bias,
    T5Config,
    config_from_dict,
    make_scheme,
    register,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "PAD_SEGMENT",
    "SCHEMES",
    "ALiBi",
    "ALiBiConfig",
    "DistanceBiasScheme",
    "DynamicPositionBias",
    "DynamicPositionBiasConfig",
    "KVCache",
    "Kerple",
    "KerpleConfig",
    "LearnedALiBi",
    "LearnedALiBiConfig",
    "LearnedAbsolute",
    "LearnedAbsoluteConfig",
    "LinearBiasScheme",
    "MultiheadAttention",
    "MusicConfig",
    "MusicRelative",
    "NoPE",
    "NoPEConfig",
    "Positions",
    "RelativeScheme",
    "Rotary",
    "RotaryConfig",
    "Scheme",
    "SchemeConfig",
    "ShawConfig",
    "ShawRelative",
    "Sinusoidal",
    "SinusoidalConfig",
    "T5Bias",
    "T5Config",
    "TokenPositionEmbedding",
    "Transformer",
    "TransformerConfig",
    "__version__",
    "checks",
    "config_from_dict",
    "eager_attention",
    "functional",
    "make_scheme",
    "register",
    "resolve_positions",
    "sequence_lengths",
]
