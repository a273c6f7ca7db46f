"""The framework-neutral definition of every scheme: its config, every check and its constant
tables, in numpy. Imports neither torch nor keras.

The PyTorch schemes (:mod:`relpos.schemes`) and the Keras schemes (:mod:`relpos.keras`) both build
from it: a config is validated by :meth:`SchemeConfig.validate` when made and by
:meth:`SchemeConfig.check_dims` when a layer of either framework builds its scheme, so a spec is
accepted or refused the same way, with the same message, in both.

The package imports every module it holds, so each scheme's ``@register_config`` runs, and exports
every registered config class by its name (:mod:`relpos.exports`): a new scheme's config is a new
module here, with no list to edit. Static analysers see the configs through their modules
(``relpos.spec.t5.T5Config``); ``from relpos.spec import T5Config`` works at run time.
"""

from ..exports import export_classes, import_modules
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
from .model import ModelConfig

import_modules(__name__, __path__)  # every scheme's module: its config registers itself

__all__ = [
    "ABSOLUTE_SCHEMES",
    "CONFIGS",
    "ModelConfig",
    "SchemeConfig",
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
#: Every registered config class (``T5Config``, ``RotaryConfig``, ...), bound here by its name.
__all__ += export_classes(globals(), CONFIGS.values())
