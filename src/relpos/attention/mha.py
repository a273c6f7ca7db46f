"""Multi-head attention that takes any positional scheme, any masks and an optional KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..positions import Positions, resolve_positions
from ..schemes.base import Scheme, SchemeConfig, check_heads, check_int, make_scheme
from .backends import get_backend
from .cache import KVCache

__all__ = ["MultiheadAttention"]


class MultiheadAttention(nn.Module):
    """Multi-head self-attention with a positional scheme; grouped-query attention optional.

    Args:
        d_model: model width, divisible by ``num_heads``.
        num_heads: number of query heads ``h``; head dim ``d = d_model / h``.
        num_kv_heads: key/value heads (default ``h``); ``h`` must be a multiple of it. Query head
            ``i`` reads key/value head ``i // (h / num_kv_heads)`` (grouped-query attention,
            Ainslie et al., 2023; 1 is multi-query attention, Shazeer, 2019). The KV cache holds
            ``num_kv_heads`` heads; the backends receive them repeated per group.
        scheme: a scheme name, config dict, :class:`SchemeConfig` or built :class:`Scheme`
            (``None``: no positions).
        causal: a query sees only keys at positions ``<= `` its own (in its own sequence).
        dropout: dropout on the attention probabilities, in training.
        bias: whether the projections have biases.
        backend: ``"auto"`` (default: the fastest backend for the scheme, positions, device
            and whether gradients are needed), ``"eager"`` (materialised logits; the reference
            every other backend is tested against), ``"sdpa"``, ``"chunked"`` or ``"flex"``
            (see ``docs/performance.md``).

    Shapes:
        ``x``: ``(b, n, d_model)``; returns ``(b, n, d_model)``. Outputs of padding tokens are 0.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        scheme: str | dict[str, Any] | SchemeConfig | Scheme | None = None,
        *,
        causal: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        backend: str = "auto",
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        check_heads(d_model, num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_int("num_kv_heads", num_kv_heads, minimum=1)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        get_backend(backend)  # fail early on an unknown name
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.num_kv_heads = num_kv_heads
        self.causal, self.dropout, self.backend = causal, dropout, backend
        self.scheme = make_scheme(scheme, d_model=d_model, num_heads=num_heads, causal=causal)
        # Queries, then keys, then values: (h + 2·num_kv_heads)·d outputs (3·d_model without GQA).
        self.qkv = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def forward(
        self,
        x: Tensor,
        positions: Positions | None = None,
        *,
        padding_mask: Tensor | None = None,
        segment_ids: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Attend over ``x`` (and the cache's keys).

        Args:
            x: ``(b, n, d_model)``.
            positions: where each token is; or give ``padding_mask`` (``(b, n)`` bool, True =
                token) or ``segment_ids`` (``(b, n)`` int, -1 = padding). Default: ``0..n-1``, or
                continuing the cache.
            cache: a :class:`KVCache` to read and extend (incremental decoding).
        """
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (b, n, d_model={self.d_model}), got {shape}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating tensor, got dtype {x.dtype}")
        b, n, _ = x.shape
        positions = resolve_positions(
            b,
            n,
            positions=positions,
            padding_mask=padding_mask,
            segment_ids=segment_ids,
            cached=None if cache is None else cache.positions,
            device=x.device,
        )
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([h * d, kvh * d, kvh * d], dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)
        k = k.view(b, n, kvh, d).transpose(1, 2)
        v = v.view(b, n, kvh, d).transpose(1, 2)
        k_positions = positions
        if self.scheme.rotates_cached_keys:  # the cache holds raw keys; rotate all of them
            if cache is not None:
                k, v, k_positions = cache.update(k, v, positions)
            q, k = self.scheme.rotate(q, k, positions, k_positions)
        else:  # rotate the new keys once, before they enter the cache
            q, k = self.scheme.rotate(q, k, positions, positions)
            if cache is not None:
                k, v, k_positions = cache.update(k, v, positions)
        if kvh != h:  # every query head of a group reads its group's key/value head
            k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
        y = get_backend(self.backend)(
            q,
            k,
            v,
            self.scheme,
            positions,
            k_positions,
            causal=self.causal,
            dropout_p=self.dropout,
            training=self.training,
        )
        y = self.out(y.transpose(1, 2).reshape(b, n, self.d_model))
        # Padding tokens attend nowhere: their output is exactly zero (not the projection's bias).
        return torch.where(positions.valid.unsqueeze(-1), y, 0.0)

    def extra_repr(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}{kv}, causal={self.causal}, "
            f"backend={self.backend!r}"
        )
