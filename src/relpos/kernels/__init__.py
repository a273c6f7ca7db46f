"""Fused GPU kernels (Triton), imported only by the backends that use them.

:mod:`.relative_attention` — FlashAttention-2 with a relative logit table read per pair and the
attention mass per relative row: every :class:`~relpos.schemes.RelativeScheme` (the ``fused``
backend, :mod:`relpos.attention.fused`). Needs ``triton``; without a CUDA device the kernels run
in Triton's interpreter (for tests).

:mod:`.aot` — compiles those kernels for a CUDA architecture on a machine with no GPU and reports
the shared memory, registers and spills of each launch (``python -m relpos.kernels.aot``).
"""

from __future__ import annotations

import os
from importlib.util import find_spec

__all__ = ["interpreted", "triton_available"]


def triton_available() -> bool:
    """Whether ``triton`` can be imported (it ships with CUDA builds of PyTorch)."""
    return find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels then run on CPU
    tensors, slowly (the test suite's check of the kernels on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
