"""Per-head control for the bias schemes: which heads get the bias.

A bias scheme's config may carry ``heads``: a list of head indices, or None for every head. The
heads left out get exactly 0 from the scheme on every backend (their rows of the bias table, or of
the MLP's output layer, are zeroed), so a layer can mix biased heads with position-free ones.
The indices are checked when the scheme is built, against the layer's ``num_heads``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.base import check_heads_field, head_mask

__all__ = ["check_heads_field", "head_selection", "select_heads"]


def head_selection(
    heads: tuple[int, ...] | None, num_heads: int, *, field: str = "heads"
) -> Tensor | None:
    """Bool ``(num_heads,)``: True for the heads that get the bias; None when all do
    (:func:`relpos.spec.base.head_mask` as a tensor).

    Raises:
        ValueError: an index ``>= num_heads``, naming the field, the index and ``num_heads``.
    """
    mask = head_mask(heads, num_heads, field=field)
    return None if mask is None else torch.from_numpy(mask)


def select_heads(values: Tensor, selection: Tensor | None, *, dim: int = 0) -> Tensor:
    """``values`` with exact zeros (and zero gradients) for the heads not selected along ``dim``."""
    if selection is None:
        return values
    shape = [1] * values.dim()
    shape[dim] = -1
    keep = selection.to(values.device).view(shape)
    return torch.where(keep, values, values.new_zeros(()))
