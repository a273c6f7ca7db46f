"""Multi-head self- or cross-attention that takes any positional scheme, any masks and an optional
KV cache."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional.dtypes import autocast_off
from ..positions import Positions, resolve_positions
from ..schemes.base import Scheme, SchemeConfig, make_scheme
from ..spec.base import check_dropout, check_head_groups, check_heads
from .backends import get_backend
from .cache import KVCache
from .contract import rows_with_keys

__all__ = ["MultiheadAttention", "zero_padding_tokens"]


def _check_both_packed(
    segment_ids: Tensor | None,
    queries_placed: bool,
    context_segment_ids: Tensor | None,
    context_positions: Positions | None,
) -> None:
    """In cross-attention a query attends to the context tokens of its own segment: documents on
    one side only would leave every query document but the first with no key (zeros).
    ``queries_placed``: the queries' segment ids or positions were given."""
    if segment_ids is not None and context_segment_ids is None and context_positions is None:
        given, missing = "segment_ids", "context_segment_ids or context_positions"
    elif context_segment_ids is not None and not queries_placed:
        given, missing = "context_segment_ids", "segment_ids or positions"
    else:
        return
    raise ValueError(
        f"{given} given without {missing}: in cross-attention a query attends to the context "
        "tokens of its own segment, so both sides need their documents (for padding alone, "
        "pass padding_mask / context_padding_mask)"
    )


def zero_padding_tokens(x: Tensor, positions: Positions) -> Tensor:
    """``x`` with the tokens at padding positions set to 0 (``torch.where``: a NaN or inf there is
    dropped, not multiplied by 0), so that nothing at a padding position reaches a weight's
    gradient either: a projection's weight gradient sums ``input ⊗ output gradient`` over every
    token, and ``NaN·0`` is NaN. Plain positions have no padding: ``x`` is returned as it is.

    Shapes: x ``(b, n, d_model)``; positions ``(b|1, n)``.
    """
    if positions.contiguous:
        return x
    return torch.where(positions.valid.unsqueeze(-1), x, 0.0)


class MultiheadAttention(nn.Module):
    """Multi-head self- or cross-attention with a positional scheme; grouped-query attention
    optional.

    Self-attention reads queries, keys and values from ``x``. Cross-attention (``context=``) reads
    queries from ``x`` and keys and values from ``context``, each stream at its own
    :class:`Positions`: the scheme sees the distance ``k_pos - q_pos`` between a query and a
    context token (RoPE rotates each by its own position), segment ``s`` of the queries attends to
    segment ``s`` of the context (packed pairs of documents), and ``causal`` keeps its meaning
    (``k_pos <= q_pos``). Both uses share the same weights. A scheme that computes positions
    from the layer's tokens (``contextualize``: the Forgetting Transformer's gates) is called
    with ``x`` before ``rotate``, continuing the cache's values; it is self-attention only.

    Args:
        d_model: model width, divisible by ``num_heads``.
        num_heads: number of query heads ``h``; head dim ``d = d_model / h``.
        num_kv_heads: key/value heads (default ``h``); ``h`` must be a multiple of it. Query head
            ``i`` reads key/value head ``i // (h / num_kv_heads)`` (grouped-query attention,
            Ainslie et al., 2023; 1 is multi-query attention, Shazeer, 2019). The KV cache holds
            ``num_kv_heads`` heads; the backends receive them repeated per group.
        scheme: a scheme name, config dict, :class:`SchemeConfig` or built :class:`Scheme`
            (``None``: no positions). An absolute scheme (``sinusoidal``, ``learned``) is a
            ``ValueError``: it acts at the input (:class:`~relpos.TokenPositionEmbedding`).
        causal: a query sees only keys at positions ``<= `` its own (in its own sequence).
        dropout: dropout on the attention probabilities, in training.
        bias: whether the projections have biases.
        backend: ``"auto"`` (default: the fastest backend for the scheme, positions, device
            and whether gradients are needed), ``"eager"`` (materialised logits; the reference
            every other backend is tested against), ``"sdpa"``, ``"chunked"`` or ``"flex"``
            (see ``docs/performance.md``).

    Shapes:
        ``b`` batch, ``n`` queries, ``m`` context tokens. ``x``: ``(b, n, d_model)``; ``context``:
        ``(b, m, d_model)``; returns ``(b, n, d_model)``. The output of a query with no key to
        attend to is exactly 0: padding, and in cross-attention also a query whose segment has no
        context token (or, when causal, none at a position ``<=`` its own).
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
        check_head_groups(num_heads, num_kv_heads)
        dropout = check_dropout(dropout)
        get_backend(backend)  # fail early on an unknown name
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.num_kv_heads = num_kv_heads
        self.causal, self.dropout, self.backend = causal, dropout, backend
        self.scheme = make_scheme(scheme, d_model=d_model, num_heads=num_heads, causal=causal)
        if "embed" in self.scheme.hooks:  # it would be a dead parameter here, silently
            raise ValueError(
                f"scheme {self.scheme.config.name!r} is absolute: it acts at the input (added to "
                "the token embeddings), not in attention; use relpos.TokenPositionEmbedding "
                "(relpos.Transformer places it there) and scheme='nope' here"
            )
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
        context: Tensor | None = None,
        context_positions: Positions | None = None,
        context_padding_mask: Tensor | None = None,
        context_segment_ids: Tensor | None = None,
    ) -> Tensor:
        """Attend over ``x`` (and the cache's keys), or over ``context``.

        Args:
            x: ``(b, n, d_model)``, the queries' tokens (and the keys' without ``context``).
            positions: where each token of ``x`` is; or give ``padding_mask`` (``(b, n)`` bool,
                True = token) or ``segment_ids`` (``(b, n)`` int, -1 = padding). Default:
                ``0..n-1``, or continuing the cache.
            cache: a :class:`KVCache` to read and extend (incremental decoding). Not with
                ``context``: a cross-attention layer takes the whole context at every step.
            context: ``(b, m, d_model)``: cross-attention, keys and values from these tokens.
            context_positions: where each context token is; or give ``context_padding_mask``
                (``(b, m)`` bool) or ``context_segment_ids`` (``(b, m)`` int). Default:
                ``0..m-1``. Only with ``context``.

        Returns:
            ``(b, n, d_model)``; a token that attends nowhere (padding) gets exactly 0. An
            empty batch (``b = 0``) gives an empty result (not with a cache).
        """
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (b, n, d_model={self.d_model}), got {shape}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating tensor, got dtype {x.dtype}")
        b, n, _ = x.shape
        context_given = {
            "context_positions": context_positions,
            "context_padding_mask": context_padding_mask,
            "context_segment_ids": context_segment_ids,
        }
        if context is None:
            named = [name for name, v in context_given.items() if v is not None]
            if named:
                raise ValueError(f"{', '.join(named)} given without context=")
        else:
            self._check_context(x, context, cache)
        packed_queries = segment_ids is not None or positions is not None
        positions = resolve_positions(
            b,
            n,
            positions=positions,
            padding_mask=padding_mask,
            segment_ids=segment_ids,
            cached=None if cache is None else cache.positions,
            device=x.device,
        )
        x = zero_padding_tokens(x, positions)
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if b == 0:  # an empty batch (a last shard): an empty output, on the projections' graph
            if cache is not None:
                raise ValueError("an empty batch (b = 0) cannot extend a KV cache")
            return self.out(self.qkv(x)[..., : h * d])
        # Autocast reaches the projections only (functional.dtypes): not positions or attention.
        if "contextualize" in self.scheme.hooks:  # per-token values from x (FoX's gates)
            cached = None if cache is None else cache.positions
            with autocast_off(x.device.type):
                positions = self.scheme.contextualize(x, positions, cached)
        if context is None:
            q, k, v = self.qkv(x).split([h * d, kvh * d, kvh * d], dim=-1)
            k_positions = positions
        else:
            k_positions = resolve_positions(
                b,
                context.shape[1],
                positions=context_positions,
                padding_mask=context_padding_mask,
                segment_ids=context_segment_ids,
                device=x.device,
                prefix="context_",
            )
            _check_both_packed(segment_ids, packed_queries, context_segment_ids, context_positions)
            context = zero_padding_tokens(context, k_positions)
            # The fused weight's query rows on x, its key and value rows on the context.
            weight, bias = self.qkv.weight, self.qkv.bias
            q = F.linear(x, weight[: h * d], None if bias is None else bias[: h * d])
            kv = F.linear(context, weight[h * d :], None if bias is None else bias[h * d :])
            k, v = kv.split([kvh * d, kvh * d], dim=-1)
        m = k.shape[1]  # keys: n, or the context's length
        q = q.view(b, n, h, d).transpose(1, 2)
        k = k.view(b, m, kvh, d).transpose(1, 2)
        v = v.view(b, m, kvh, d).transpose(1, 2)
        with autocast_off(x.device.type):
            y = self._attend(q, k, v, positions, k_positions, cache)
        y = self.out(y.transpose(1, 2).reshape(b, n, self.d_model))
        # A query that attends nowhere outputs exactly zero (not the projection's bias). In
        # self-attention that is padding; a cross-attention query may also find no context token.
        attends = (
            positions.valid
            if context is None
            else rows_with_keys(positions, k_positions, self.causal)
        )
        return torch.where(attends.unsqueeze(-1), y, 0.0)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Positions,
        k_positions: Positions,
        cache: KVCache | None,
    ) -> Tensor:
        """Rotate, read and extend the cache, and run the backend: ``(b, h, i, d)``."""
        if self.scheme.rotates_cached_keys:  # the cache holds raw keys; rotate all of them
            if cache is not None:
                k, v, k_positions = cache.update(k, v, positions)
            q, k = self.scheme.rotate(q, k, positions, k_positions)
        else:  # rotate the new keys once, before they enter the cache
            q, k = self.scheme.rotate(q, k, positions, k_positions)
            if cache is not None:
                k, v, k_positions = cache.update(k, v, positions)
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # every query head of a group reads its group's key/value head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return get_backend(self.backend)(
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

    def _check_context(self, x: Tensor, context: Tensor, cache: KVCache | None) -> None:
        """Raise a clear error unless ``context`` fits ``x`` (``(b, m, d_model)``, ``x``'s dtype)
        and no cache is given."""
        b = x.shape[0]
        if not isinstance(context, Tensor):
            raise TypeError(f"context must be a torch.Tensor, got {type(context).__name__}")
        if context.ndim != 3 or context.shape[0] != b or context.shape[-1] != self.d_model:
            raise ValueError(
                f"context must have shape (b={b}, m, d_model={self.d_model}), got "
                f"{tuple(context.shape)}"
            )
        if context.dtype != x.dtype:
            raise TypeError(f"context must have x's dtype {x.dtype}, got dtype {context.dtype}")
        if "contextualize" in self.scheme.hooks:
            raise ValueError(
                f"scheme {self.scheme.config.name!r} computes its positions from the layer's own "
                "tokens (contextualize: self-attention only); context= cannot be used with it"
            )
        if cache is not None:
            raise ValueError(
                "cache cannot be combined with context: a cross-attention layer has no keys of "
                "its own to cache; pass the context at every decoding step (with the queries' "
                "positions=) and no cache"
            )

    def extra_repr(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}{kv}, causal={self.causal}, "
            f"backend={self.backend!r}"
        )
