"""relpos: positional encodings for transformers, correct for padded, packed and cached batches.

Every scheme is a function of each token's own position inside its own sequence (a
:class:`Positions`), never of array indices.

``import relpos`` needs only numpy: the configs (:mod:`relpos.spec`) load at once, the PyTorch
modules on first use (``pip install "relpos[torch]"``); :mod:`relpos.keras` never loads torch.
"""

import importlib
import importlib.util
from typing import Any

from .spec import (
    ALiBiConfig,
    CoPEConfig,
    DebertaConfig,
    DynamicPositionBiasConfig,
    FireConfig,
    ForgetGateConfig,
    KerpleConfig,
    LearnedAbsoluteConfig,
    LearnedALiBiConfig,
    MusicConfig,
    NoPEConfig,
    RotaryConfig,
    SandwichConfig,
    SchemeConfig,
    ShawConfig,
    SinusoidalConfig,
    T5Config,
    TransformerXLConfig,
    config_from_dict,
)

#: The PyTorch names, imported on first use (PEP 562) so that ``import relpos`` and
#: ``import relpos.keras`` need no torch: name -> the module that defines it.
_TORCH_NAMES = {
    **dict.fromkeys(["BACKENDS", "KVCache", "MultiheadAttention", "eager_attention"], "attention"),
    "TokenPositionEmbedding": "embedding",
    **dict.fromkeys(["Transformer", "TransformerConfig"], "models"),
    **dict.fromkeys(
        ["PAD_SEGMENT", "Positions", "resolve_positions", "sequence_lengths"], "positions"
    ),
    **dict.fromkeys(
        [
            "SCHEMES",
            "ALiBi",
            "CoPE",
            "DeBERTa",
            "DecayBiasScheme",
            "DistanceBiasScheme",
            "DynamicPositionBias",
            "Fire",
            "ForgetGate",
            "Kerple",
            "LearnedAbsolute",
            "LearnedALiBi",
            "LinearBiasScheme",
            "MusicRelative",
            "NoPE",
            "PairBiasScheme",
            "RelativeScheme",
            "Rotary",
            "Sandwich",
            "Scheme",
            "ShawRelative",
            "Sinusoidal",
            "T5Bias",
            "TransformerXL",
            "make_scheme",
            "register",
        ],
        "schemes",
    ),
}


def _import(module: str) -> Any:
    """``relpos.<module>``; a clear ImportError when it needs torch and torch is missing."""
    try:
        return importlib.import_module(f".{module}", __name__)
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        raise ImportError(
            f"relpos.{module} needs PyTorch, which is not installed: "
            'pip install "relpos[torch]" (relpos.keras and relpos.spec need no torch)'
        ) from error


def __getattr__(name: str) -> Any:
    """A PyTorch name or a submodule (``relpos.functional``, ``relpos.schemes``, ...), imported on
    first use."""
    if name in _TORCH_NAMES:
        value = getattr(_import(_TORCH_NAMES[name]), name)
    elif name.isidentifier() and not name.startswith("_") and _is_submodule(name):
        value = _import(name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _is_submodule(name: str) -> bool:
    return importlib.util.find_spec(f"{__name__}.{name}") is not None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "PAD_SEGMENT",
    "SCHEMES",
    "ALiBi",
    "ALiBiConfig",
    "CoPE",
    "CoPEConfig",
    "DeBERTa",
    "DebertaConfig",
    "DecayBiasScheme",
    "DistanceBiasScheme",
    "DynamicPositionBias",
    "DynamicPositionBiasConfig",
    "Fire",
    "FireConfig",
    "ForgetGate",
    "ForgetGateConfig",
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
    "PairBiasScheme",
    "Positions",
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
    "TokenPositionEmbedding",
    "Transformer",
    "TransformerConfig",
    "TransformerXL",
    "TransformerXLConfig",
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
