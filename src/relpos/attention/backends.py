"""Attention backends by name.

Each backend is a function ``(q, k, v, scheme, q_positions, k_positions, *, causal, dropout_p,
training) -> (b, h, i, d)`` with ``q (b, h, i, d)`` and ``k, v (b, h, j, d)`` already rotated. Every
backend must agree with ``eager`` (the reference), outputs and gradients.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .eager import eager_attention

__all__ = ["BACKENDS", "get_backend"]

BackendFn = Callable[..., Tensor]

BACKENDS: dict[str, BackendFn] = {"eager": eager_attention}


def get_backend(name: str) -> BackendFn:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]
