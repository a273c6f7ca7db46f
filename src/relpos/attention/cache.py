"""A key/value cache for incremental decoding, one per attention layer."""

from __future__ import annotations

import torch
from torch import Tensor

from ..positions import Positions

__all__ = ["KVCache"]


class KVCache:
    """Keys and values seen so far and their :class:`Positions`. Keys are stored as the scheme's
    ``rotate`` left them (rotated, for RoPE), or raw for a scheme that ``rotates_cached_keys``.
    The positions keep what ``contextualize`` added (the forget gate's per-token ``log_decay``), so
    new tokens continue each row's sums.

    Decoding feeds one token, or a chunk, at a time; :meth:`update` appends the new keys and values
    and returns everything a query may attend to. The new tokens' positions continue each row's
    last sequence (``positions.continued(n)``) unless the caller passes others.

    Shapes:
        k, v: ``(b, h, j, d)``; positions: ``(b, j)``.
    """

    def __init__(self, *, max_len: int | None = None, detach: bool = False) -> None:
        """Args:
        max_len: keep only the last ``max_len`` tokens between calls (a sliding memory); each
            call still attends to all of them plus its own tokens. ``None``: keep everything.
        detach: store keys and values (and a positions' ``log_decay``) without their autograd
            history, so a later call's loss does not backpropagate into earlier calls
            (Transformer-XL's stop-gradient memory).
        """
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)):
            raise TypeError(f"max_len must be an int or None, got {max_len!r}")
        if max_len is not None and max_len < 0:
            raise ValueError(f"max_len must be >= 0, got {max_len}")
        self.max_len, self.detach = max_len, bool(detach)
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
        """Append new keys/values with their positions; return all keys, values and positions
        (the stored ones, then the new ones). With ``max_len``, only the last ``max_len`` tokens
        are kept for the next call."""
        if self.k is None:
            k_all, v_all, p_all = k, v, positions.expand(k.shape[0])
        else:
            if k.shape[:2] != self.k.shape[:2] or k.shape[-1] != self.k.shape[-1]:
                raise ValueError(
                    f"new keys have shape {tuple(k.shape)}, the cache holds {tuple(self.k.shape)}: "
                    "batch, heads and head dim must match"
                )
            k_all = torch.cat([self.k, k], dim=-2)
            v_all = torch.cat([self.v, v], dim=-2)
            p_all = self.positions.cat(positions)
        keep = (
            slice(None) if self.max_len is None else slice(max(len(p_all) - self.max_len, 0), None)
        )
        self.k, self.v, self.positions = k_all[..., keep, :], v_all[..., keep, :], p_all[keep]
        if self.detach:
            self.k, self.v = self.k.detach(), self.v.detach()
            self.positions = self.positions.detach()
        return k_all, v_all, p_all
