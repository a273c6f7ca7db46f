"""Per-head control for the bias schemes: which heads get the bias.

A bias scheme's config may carry ``heads``: a list of head indices, or None for every head. The
heads left out get exactly 0 from the scheme on every backend (their rows of the bias table, or of
the MLP's output layer, are zeroed), so a layer can mix biased heads with position-free ones.
The indices are checked when the scheme is built, against the layer's ``num_heads``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_heads_field", "head_selection", "select_heads"]


def check_heads_field(heads: Any, *, field: str = "heads") -> tuple[int, ...] | None:
    """A config's ``heads``: None (every head) or a non-empty list of distinct ints ``>= 0``.

    Returns the indices as a sorted tuple (JSON gives a list), so equal selections compare equal.
    """
    if heads is None:
        return None
    if not isinstance(heads, list | tuple) or not heads:
        raise ValueError(
            f"{field} must be None (every head) or a non-empty list of head indices, got "
            f"{heads!r}; for no positional bias at all use the scheme 'nope'"
        )
    for t, h in enumerate(heads):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"{field}[{t}] must be an int >= 0 (a head index), got {h!r}")
    if len(set(heads)) != len(heads):
        raise ValueError(f"{field} lists a head twice: {list(heads)}")
    return tuple(sorted(int(h) for h in heads))


def head_selection(
    heads: tuple[int, ...] | None, num_heads: int, *, field: str = "heads"
) -> Tensor | None:
    """Bool ``(num_heads,)``: True for the heads that get the bias; None when all do.

    Raises:
        ValueError: an index ``>= num_heads``, naming the field, the index and ``num_heads``.
    """
    if heads is None:
        return None
    bad = [h for h in heads if h >= num_heads]
    if bad:
        raise ValueError(
            f"{field} {list(heads)}: head {bad[0]} is out of range for num_heads={num_heads} "
            f"(valid indices 0..{num_heads - 1})"
        )
    mask = torch.zeros(num_heads, dtype=torch.bool)
    mask[list(heads)] = True
    return mask


def select_heads(values: Tensor, selection: Tensor | None, *, dim: int = 0) -> Tensor:
    """``values`` with exact zeros (and zero gradients) for the heads not selected along ``dim``."""
    if selection is None:
        return values
    shape = [1] * values.dim()
    shape[dim] = -1
    keep = selection.to(values.device).view(shape)
    return torch.where(keep, values, values.new_zeros(()))
