"""Attention schemes as Keras layers: the same hooks and configs as :mod:`relpos.schemes`.

A scheme is built from the framework-neutral config (:mod:`relpos.spec`, which validates names,
fields and the fields against the layer's geometry for both frameworks), so a config dict means
the same thing, and is refused with the same message, in both. It holds its tables as Keras
weights and contributes through at most three hooks (every default does nothing):

===========================  =================================================================
hook                         contract (Keras layout: heads after tokens)
===========================  =================================================================
``rotate(q, k, qp, kp)``     rotated ``q (b, i, h, d)`` and ``k (b, j, h, d)``
``score_bias(q, qp, kp)``    float32 ``(b|1, h|1, i, j)`` added to the *scaled* logits
``key_bias(q, k, qp, kp)``   float32 ``(b, h, i, j)`` added to the scaled logits, reading the
                             keys too: every key of the call (cached ones included, rotated,
                             key/value heads repeated to ``h``); DeBERTa's p2c, CoPE's gates
``value_term(p, qp, kp)``    float32 ``(b, i, h, d)`` added to the output, from probs
                             ``(b, h, i, j)``
``token_log_decay(x)``       (``contextual`` schemes) ``log f (b, n, h)`` of every token from the
                             layer input ``x``; the attention layer turns it into the positions'
                             ``log_decay`` (per-document cumulative sums, continued through the
                             cache): the Forgetting Transformer's gates
===========================  =================================================================

``qp``/``kp`` are :class:`~relpos.keras.positions.Positions`; no hook reads array indices. A
scheme whose key rotation depends on the other keys (a length-dependent RoPE scaling) declares
``rotates_cached_keys``: keys then enter the cache raw and ``rotate`` gets every cached key. A
scheme defined for causal attention only declares ``causal_only`` (``causal=False`` raises, with
the PyTorch side's message).
Absolute schemes (``sinusoidal``, ``learned``) act at the input: see
:class:`~relpos.keras.embeddings.TokenAndPositionEmbedding`.

The package imports every module it holds, so each scheme's ``@register`` runs, and exports every
registered scheme's class by name (:mod:`relpos.exports`): a new scheme is a new module here, with
no list to edit. Static analysers see them through their modules
(``relpos.keras.schemes.t5.T5Scheme``); ``from relpos.keras.schemes import T5Scheme`` works at run
time.
"""

from ...exports import export_classes, import_modules
from .base import (
    KERAS_SCHEMES,
    AttentionScheme,
    DistanceBiasScheme,
    make_attention_scheme,
    scheme_config,
)

import_modules(__name__, __path__)  # every scheme's module: its class registers itself

__all__ = [
    "KERAS_SCHEMES",
    "AttentionScheme",
    "DistanceBiasScheme",
    "make_attention_scheme",
    "scheme_config",
]
#: Every registered Keras attention scheme's class (``T5Scheme``, ...), bound here by its name.
__all__ += export_classes(globals(), KERAS_SCHEMES.values())
