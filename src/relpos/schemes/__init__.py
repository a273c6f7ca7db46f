"""Every positional scheme, registered by name (see :data:`SCHEMES`)."""

from .absolute import LearnedAbsolute, LearnedAbsoluteConfig, Sinusoidal, SinusoidalConfig
from .alibi import ALiBi, ALiBiConfig, LearnedALiBi, LearnedALiBiConfig
from .base import (
    SCHEMES,
    DecayBiasScheme,
    DistanceBiasScheme,
    DistanceClip,
    LinearBiasScheme,
    PairBiasScheme,
    RelativeScheme,
    Scheme,
    SchemeConfig,
    config_from_dict,
    make_scheme,
    register,
    scheme_config,
)
from .cope import CoPE, CoPEConfig
from .deberta import DeBERTa, DebertaConfig
from .dpb import DynamicPositionBias, DynamicPositionBiasConfig
from .fire import Fire, FireConfig
from .forgetting import ForgetGate, ForgetGateConfig
from .kerple import Kerple, KerpleConfig
from .music import MusicConfig, MusicRelative
from .nope import NoPE, NoPEConfig
from .rope import Rotary, RotaryConfig
from .sandwich import Sandwich, SandwichConfig
from .shaw import ShawConfig, ShawRelative
from .t5 import T5Bias, T5Config
from .transformer_xl import TransformerXL, TransformerXLConfig

__all__ = [
    "SCHEMES",
    "ALiBi",
    "ALiBiConfig",
    "CoPE",
    "CoPEConfig",
    "DeBERTa",
    "DebertaConfig",
    "DecayBiasScheme",
    "DistanceBiasScheme",
    "DistanceClip",
    "DynamicPositionBias",
    "DynamicPositionBiasConfig",
    "Fire",
    "FireConfig",
    "ForgetGate",
    "ForgetGateConfig",
    "Kerple",
    "KerpleConfig",
    "LearnedALiBi",
    "LearnedALiBiConfig",
    "LearnedAbsolute",
    "LearnedAbsoluteConfig",
    "LinearBiasScheme",
    "MusicConfig",
    "MusicRelative",
    "NoPE",
    "NoPEConfig",
    "PairBiasScheme",
    "RelativeScheme",
    "Rotary",
    "RotaryConfig",
    "Sandwich",
    "SandwichConfig",
    "Scheme",
    "SchemeConfig",
    "ShawConfig",
    "ShawRelative",
    "Sinusoidal",
    "SinusoidalConfig",
    "T5Bias",
    "T5Config",
    "TransformerXL",
    "TransformerXLConfig",
    "config_from_dict",
    "make_scheme",
    "register",
    "scheme_config",
]
