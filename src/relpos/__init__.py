"""relpos: positional encodings for transformers, correct for padded, packed and cached batches.

Every scheme is a function of each token's own position inside its own sequence (a
:class:`Positions`), never of array indices.

``import relpos`` needs only numpy: the configs (:mod:`relpos.spec`) load at once, the PyTorch
modules on first use (``pip install "relpos[torch]"``); :mod:`relpos.keras` never loads torch.

The names come from the registries, so adding a scheme edits nothing here: every registered
config (``T5Config``, ...) is bound at import from :data:`relpos.spec.CONFIGS`, and every
:class:`Scheme` class :mod:`relpos.schemes` exports (``T5Bias``, ...: it exports its registry)
resolves on first use (PEP 562 ``__getattr__``), as do the other PyTorch names (``_TORCH_NAMES``).
``__all__`` is computed on first access: every public name where PyTorch is installed (reading it,
``dir(relpos)`` or ``from relpos import *`` then imports torch), the torch-free names otherwise.
Static analysis: with no list written out, type checkers see ``relpos.T5Bias`` and
``relpos.T5Config`` through ``__getattr__`` (as ``Any``), and IDEs complete them from the running
module; the defining modules (``relpos.schemes.t5.T5Bias``, ``relpos.spec.t5.T5Config``) are fully
static. A stub or a checked-in list would restate the registry, which this layout removes.
"""

import importlib
import importlib.util
from types import ModuleType
from typing import Any

from . import spec
from .exports import export_classes
from .spec import SchemeConfig as SchemeConfig  # re-exported (__all__ is computed)
from .spec import config_from_dict as config_from_dict

__version__ = "0.1.0"

#: Every registered scheme's config class (``T5Config``, ...), bound here by its name.
_CONFIG_NAMES = export_classes(globals(), spec.CONFIGS.values())

#: The names ``import relpos`` binds without torch.
_TORCH_FREE_NAMES = ("SchemeConfig", "__version__", "config_from_dict", *_CONFIG_NAMES)

#: The PyTorch names other than the scheme classes, imported on first use (PEP 562) so that
#: ``import relpos`` and ``import relpos.keras`` need no torch: name -> the module that defines it.
_TORCH_NAMES = {
    **dict.fromkeys(["BACKENDS", "KVCache", "MultiheadAttention", "eager_attention"], "attention"),
    "TokenPositionEmbedding": "embedding",
    **dict.fromkeys(["Transformer", "TransformerConfig"], "models"),
    **dict.fromkeys(
        ["PAD_SEGMENT", "Positions", "resolve_positions", "sequence_lengths"], "positions"
    ),
    **dict.fromkeys(["SCHEMES", "make_scheme", "register"], "schemes"),
}

#: The PyTorch submodules ``__all__`` lists (every submodule resolves on first use).
_TORCH_MODULES = ("checks", "functional")


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


def _torch_schemes() -> ModuleType | None:
    """:mod:`relpos.schemes`, or None where PyTorch is not installed."""
    try:
        return importlib.import_module(".schemes", __name__)
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        return None


def _scheme_classes(schemes: ModuleType) -> dict[str, type]:
    """Every :class:`Scheme` class ``schemes`` (:mod:`relpos.schemes`) exports, by name: each
    registered scheme's, and the base classes."""
    exported = {name: getattr(schemes, name) for name in schemes.__all__}
    return {
        name: value
        for name, value in exported.items()
        if isinstance(value, type) and issubclass(value, schemes.Scheme)
    }


def _scheme_class(name: str) -> type:
    """The scheme class ``relpos.<name>``; AttributeError where there is none (naming the torch
    extra where PyTorch is missing, as the class may need it)."""
    schemes = _torch_schemes()
    if schemes is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r}; PyTorch is not installed, and the "
            f'PyTorch schemes need it: pip install "relpos[torch]" (relpos.keras and relpos.spec '
            "need no torch)"
        )
    classes = _scheme_classes(schemes)
    if name not in classes:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return classes[name]


def _public_names() -> list[str]:
    """``__all__``: every public name where PyTorch is installed, the torch-free ones otherwise."""
    schemes = _torch_schemes()
    if schemes is None:
        return sorted(_TORCH_FREE_NAMES)
    names = {*_TORCH_FREE_NAMES, *_TORCH_NAMES, *_TORCH_MODULES, *_scheme_classes(schemes)}
    return sorted(names)


def __getattr__(name: str) -> Any:
    """``__all__``, a PyTorch name, a submodule (``relpos.functional``, ``relpos.schemes``, ...)
    or a scheme class (``relpos.T5Bias``), computed or imported on first use."""
    if name == "__all__":
        value = _public_names()
    elif name in _TORCH_NAMES:
        value = getattr(_import(_TORCH_NAMES[name]), name)
    elif name.startswith("_") or not name.isidentifier():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    elif _is_submodule(name):
        value = _import(name)
    else:
        value = _scheme_class(name)
    globals()[name] = value
    return value


def _is_submodule(name: str) -> bool:
    return importlib.util.find_spec(f"{__name__}.{name}") is not None


def __dir__() -> list[str]:
    names = globals().get("__all__") or __getattr__("__all__")
    return sorted(set(globals()) | set(names))
