"""The dtype policy: positions, angles, biases and softmax run in at least float32, and
``torch.autocast`` does not reach inside relpos's attention.

Autocast would run relpos's float32 matmuls in bfloat16 (FIRE's MLP, RoPE's angles, the tiles'
``q·kᵀ``): biases wrong at long distances, or a dtype clash inside a kernel. Under autocast the
model's projections still give bfloat16 ``q, k, v``; attention then computes as it does for any
bfloat16 input (float32 inside, bfloat16 out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import Tensor

from ..runtime import native_bf16

__all__ = ["autocast_off", "compute_dtype", "half_products", "outside_autocast"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (fp16/bf16) and float32; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def half_products(x: Tensor) -> torch.dtype | None:
    """bfloat16 where ``x`` is bfloat16 on a CPU that computes it natively: ``sdpa``'s training
    path then keeps its products (``q·kᵀ``, ``p·v`` and their gradients) in it, as torch's math
    kernel does under autocast. None otherwise: products in :func:`compute_dtype`."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and native_bf16(x.device):
        return torch.bfloat16
    return None


@contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """A block that ``torch.autocast`` does not reach on ``device_type`` (no-op where it is off)."""
    if not (
        torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    ):
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


_F = TypeVar("_F", bound=Callable[..., object])


def outside_autocast(fn: _F) -> _F:
    """``fn`` run in :func:`autocast_off` on the device of its first tensor argument: every
    attention backend, and the forward and backward of relpos's autograd Functions (a backward
    runs under autocast when ``loss.backward()`` is called inside the autocast block)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
        with autocast_off(device):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
