"""The ``chunked`` backend and its CPU engines (see :mod:`.backend` for the paths).

==============  ==========================================================================
module          job
==============  ==========================================================================
``backend``     the entry point: input checks, the path for a call
``plan``        which tiles the general path computes, from block summaries
``tiles``       the general path: tiles with a streaming softmax, custom backward
``region``      far parts by the fused kernel + a band engine, merged by log-sum-exp
``geometry``    a band's blocks, windows, masks and strided skew views
``relative``    a band's relative logit term and its gradients (both engines)
``narrow``      band engine in distance coordinates (narrow bands: Shaw, T5)
``band``        band engine on tiles (wide bands: a Music Transformer with a large ``M``)
``alibi``       ALiBi's left / diagonal / right fused-kernel parts
``job``         one call's scheme, positions and geometry; the band-engine contract
``kernels``     the stock flash kernel, ``flush_exp_``, block bounds
``grads``       the scheme's parameter gradients inside a custom backward
==============  ==========================================================================
"""

from .backend import chunked_attention, chunked_path, chunked_supports
from .plan import TilePlan, plan_tiles
from .tiles import DEFAULT_BLOCK

__all__ = [
    "DEFAULT_BLOCK",
    "TilePlan",
    "chunked_attention",
    "chunked_path",
    "chunked_supports",
    "plan_tiles",
]
