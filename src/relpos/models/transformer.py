"""A small reference transformer (pre-LayerNorm) that takes any registered scheme.

Read top to bottom: :class:`TransformerConfig` → :class:`Block` (attention + MLP) →
:class:`Transformer` (embedding, blocks, head). Positions are resolved once per forward and handed
to every layer; absolute schemes act at the input, relative ones inside every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import KVCache, MultiheadAttention
from ..attention.backends import get_backend
from ..embedding import TokenPositionEmbedding
from ..functional.dropout import Dropout
from ..positions import Positions, resolve_positions
from ..schemes.base import Scheme, make_scheme
from ..spec.model import ModelConfig

__all__ = ["Block", "Transformer", "TransformerConfig"]


@dataclass(frozen=True)
class TransformerConfig(ModelConfig):
    """Size and scheme of a :class:`Transformer`; round-trips through ``to_dict``/``from_dict``.

    The fields and their checks are :class:`relpos.spec.model.ModelConfig`'s (shared with the
    Keras :class:`relpos.keras.Transformer`); here ``backend`` must also name an attention
    backend (see :class:`~relpos.attention.MultiheadAttention`).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        get_backend(self.backend)  # fail early on an unknown name


class Block(nn.Module):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: TransformerConfig, scheme: dict[str, Any] | Scheme | None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = MultiheadAttention(
            cfg.d_model,
            cfg.num_heads,
            scheme,
            causal=cfg.causal,
            dropout=cfg.dropout,
            backend=cfg.backend,
            num_kv_heads=cfg.num_kv_heads,
        )
        self.ln2 = nn.LayerNorm(cfg.d_model)
        d_ff = cfg.d_ff or 4 * cfg.d_model
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, d_ff), nn.GELU(), nn.Linear(d_ff, cfg.d_model)
        )
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, positions: Positions, cache: KVCache | None) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x), positions, cache=cache))
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(nn.Module):
    """Token embedding (+ absolute positions), ``num_layers`` blocks, final LayerNorm, LM head.

    Shapes:
        tokens: ``(b, n)`` int; returns logits ``(b, n, vocab_size)``.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # A scheme whose only hook is `embed` acts at the input; any other acts in every layer.
        probe = make_scheme(
            cfg.scheme, d_model=cfg.d_model, num_heads=cfg.num_heads, causal=cfg.causal
        )
        absolute = probe.hooks == frozenset({"embed"})
        self.embed = TokenPositionEmbedding(
            cfg.vocab_size, cfg.d_model, cfg.scheme if absolute else None
        )
        self.drop = Dropout(cfg.dropout)
        specs = cfg.layer_schemes or [None if absolute else cfg.scheme] * cfg.num_layers
        if cfg.share_relative:  # one module, so one set of tables, in every layer
            shared = make_scheme(
                specs[0], d_model=cfg.d_model, num_heads=cfg.num_heads, causal=cfg.causal
            )
            specs = [shared] * cfg.num_layers
        self.blocks = nn.ModuleList(Block(cfg, spec) for spec in specs)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def new_cache(self) -> list[KVCache]:
        """One empty :class:`KVCache` per layer, for incremental decoding."""
        return [KVCache() for _ in self.blocks]

    def new_memory(self, mem_len: int) -> list[KVCache]:
        """Transformer-XL's segment-level recurrence (Dai et al., 2019, §3.2): one memory per
        layer holding the keys and values of the last ``mem_len`` tokens, without gradient.

        Feed consecutive segments with ``cache=memory``: each attends to the memory and to itself,
        at positions that continue across segments. While the memory covers every earlier token,
        a segment's outputs equal one forward over all the segments; beyond, each layer sees
        ``mem_len`` tokens back (and deeper layers further, through the earlier layers' memory).
        """
        return [KVCache(max_len=mem_len, detach=True) for _ in self.blocks]

    def forward(
        self,
        tokens: Tensor,
        positions: Positions | None = None,
        *,
        padding_mask: Tensor | None = None,
        segment_ids: Tensor | None = None,
        cache: list[KVCache] | None = None,
    ) -> Tensor:
        if not isinstance(tokens, Tensor) or tokens.ndim != 2:
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must have shape (b, n), got {shape}")
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(
                f"cache must hold {len(self.blocks)} KVCache objects, got {len(cache)}"
            )
        b, n = tokens.shape
        positions = resolve_positions(
            b,
            n,
            positions=positions,
            padding_mask=padding_mask,
            segment_ids=segment_ids,
            cached=None if cache is None else cache[0].positions,
            device=tokens.device,
        )
        x = self.drop(self.embed(tokens, positions))
        for i, block in enumerate(self.blocks):
            x = block(x, positions, None if cache is None else cache[i])
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
