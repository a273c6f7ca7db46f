"""A key/value cache for incremental decoding, one per attention layer."""

from __future__ import annotations

import torch
from torch import Tensor

from ..positions import Positions

__all__ = ["KVCache"]


class KVCache:
    """Keys and values seen so far and their :class:`Positions`. Keys are stored as the scheme's
    ``rotate`` left them (rotated, for RoPE), or raw for a scheme that ``rotates_cached_keys``.

    Decoding feeds one token, or a chunk, at a time; :meth:`update` appends the new keys and values
    and returns everything a query may attend to. The new tokens' positions continue each row's
    last sequence (``positions.continued(n)``) unless the caller passes others.

    Shapes:
        k, v: ``(b, h, j, d)``; positions: ``(b, j)``.
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.positions: Positions | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def reset(self) -> None:
        self.k = self.v = None
        self.positions = None

    def update(
        self, k: Tensor, v: Tensor, positions: Positions
    ) -> tuple[Tensor, Tensor, Positions]:
        """Append new keys/values with their positions; return all keys, values and positions."""
        if self.k is None:
            self.k, self.v, self.positions = k, v, positions.expand(k.shape[0])
        else:
            if k.shape[:2] != self.k.shape[:2] or k.shape[-1] != self.k.shape[-1]:
                raise ValueError(
                    f"new keys have shape {tuple(k.shape)}, the cache holds {tuple(self.k.shape)}: "
                    "batch, heads and head dim must match"
                )
            self.k = torch.cat([self.k, k], dim=-2)
            self.v = torch.cat([self.v, v], dim=-2)
            self.positions = self.positions.cat(positions)
        return self.k, self.v, self.positions
