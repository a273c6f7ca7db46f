"""The framework-neutral definition of every scheme: its config, every check and its constant
tables, in numpy. Imports neither torch nor keras.

The PyTorch schemes (:mod:`relpos.schemes`) and the Keras schemes (:mod:`relpos.keras`) both build
from it: a config is validated by :meth:`SchemeConfig.validate` when made and by
:meth:`SchemeConfig.check_dims` when a layer of either framework builds its scheme, so a spec is
accepted or refused the same way, with the same message, in both.
"""

from .absolute import LearnedAbsoluteConfig, SinusoidalConfig
from .alibi import ALiBiConfig, LearnedALiBiConfig
from .base import (
    ABSOLUTE_SCHEMES,
    CONFIGS,
    SchemeConfig,
    check_bool,
    check_causal,
    check_heads,
    check_int,
    check_positive_float,
    config_class,
    config_from_dict,
    head_mask,
    register_config,
    scheme_config,
)
from .cope import CoPEConfig
from .deberta import DebertaConfig
from .dpb import DynamicPositionBiasConfig
from .fire import FireConfig
from .forgetting import ForgetGateConfig
from .kerple import KerpleConfig
from .model import ModelConfig
from .music import MusicConfig
from .nope import NoPEConfig
from .rope import RotaryConfig
from .sandwich import SandwichConfig
from .shaw import ShawConfig
from .t5 import T5Config
from .transformer_xl import TransformerXLConfig

__all__ = [
    "ABSOLUTE_SCHEMES",
    "CONFIGS",
    "ALiBiConfig",
    "CoPEConfig",
    "DebertaConfig",
    "DynamicPositionBiasConfig",
    "FireConfig",
    "ForgetGateConfig",
    "KerpleConfig",
    "LearnedALiBiConfig",
    "LearnedAbsoluteConfig",
    "ModelConfig",
    "MusicConfig",
    "NoPEConfig",
    "RotaryConfig",
    "SandwichConfig",
    "SchemeConfig",
    "ShawConfig",
    "SinusoidalConfig",
    "T5Config",
    "TransformerXLConfig",
    "check_bool",
    "check_causal",
    "check_heads",
    "check_int",
    "check_positive_float",
    "config_class",
    "config_from_dict",
    "head_mask",
    "register_config",
    "scheme_config",
]
