"""The dtype policy: positions, angles, biases and softmax run in at least float32."""

from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (fp16/bf16) and float32; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)
