"""Token + position embedding: the input layer of a transformer with an absolute scheme."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .functional.dtypes import autocast_off
from .positions import Positions
from .schemes.base import Scheme, SchemeConfig, make_scheme

__all__ = ["TokenPositionEmbedding"]


class TokenPositionEmbedding(nn.Module):
    """``E[token]·scale + PE(position)`` where ``PE`` comes from a scheme's ``embed`` hook.

    A scheme without an ``embed`` hook (a relative scheme) adds nothing here.

    Args:
        vocab_size: number of token ids.
        d_model: embedding width.
        scheme: name, config dict, config or module of the absolute scheme (``None``: tokens only).
        scale_tokens: multiply token embeddings by ``√d_model`` and initialise them with std
            ``1/√d_model``, so they have unit scale like a fixed sinusoid (Vaswani et al.,
            §3.4); otherwise they start at std 0.02. ``None`` (default): scale when the encoding
            is fixed (an ``embed`` hook with no parameters), whose unit amplitude would otherwise
            swamp small token embeddings.

    Shapes:
        tokens: ``(b, n)`` int; returns ``(b, n, d_model)``.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        scheme: str | dict[str, Any] | SchemeConfig | Scheme | None = None,
        *,
        scale_tokens: bool | None = None,
    ) -> None:
        super().__init__()
        self.scheme = make_scheme(scheme, d_model=d_model, num_heads=1, causal=False)
        if scale_tokens is None:
            fixed = "embed" in self.scheme.hooks and not any(True for _ in self.scheme.parameters())
            scale_tokens = fixed
        self.tokens = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.tokens.weight, std=d_model**-0.5 if scale_tokens else 0.02)
        self.scale = math.sqrt(d_model) if scale_tokens else 1.0

    def forward(self, tokens: Tensor, positions: Positions) -> Tensor:
        if tokens.dtype.is_floating_point or tokens.ndim != 2:
            raise ValueError(
                f"tokens must be an integer tensor of shape (b, n), got {tuple(tokens.shape)} "
                f"{tokens.dtype}"
            )
        vocab = self.tokens.num_embeddings
        if tokens.numel() and not torch.compiler.is_compiling():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"token ids must lie in [0, {vocab}), got values in [{lo}, {hi}]")
        x = self.tokens(tokens) * self.scale
        with autocast_off(x.device.type):  # positions in float32 under autocast too
            pe = self.scheme.embed(positions)
        if pe is not None:
            x = x + pe.to(x.dtype)
        return x
