"""Every positional scheme, registered by name (see :data:`SCHEMES`).

The package imports every module it holds, so each scheme's ``@register`` runs, and exports every
registered scheme's class and config class by name (:mod:`relpos.exports`): a new scheme is a new
module here, with no list to edit. Static analysers see them through their modules
(``relpos.schemes.t5.T5Bias``); ``from relpos.schemes import T5Bias`` works at run time.
"""

from ..exports import export_classes, import_modules
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

import_modules(__name__, __path__)  # every scheme's module: its class registers itself

__all__ = [
    "SCHEMES",
    "DecayBiasScheme",
    "DistanceBiasScheme",
    "DistanceClip",
    "LinearBiasScheme",
    "PairBiasScheme",
    "RelativeScheme",
    "Scheme",
    "SchemeConfig",
    "config_from_dict",
    "make_scheme",
    "register",
    "scheme_config",
]
#: Every registered scheme's class (``T5Bias``, ...) and config class (``T5Config``, ...).
__all__ += export_classes(
    globals(), [cls for scheme in SCHEMES.values() for cls in (scheme, scheme.config_class)]
)
