"""Contextual Position Encoding, CoPE (Golovneva et al., 2024, "Contextual Position Encoding:
Learning to Count What's Important", §3)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ..functional.cope import cope_logits
from ..positions import Positions
from ..spec.cope import CoPEConfig
from .base import Scheme, register

__all__ = ["CoPE", "CoPEConfig"]


@register
class CoPE(Scheme):
    """Contextual positions: query ``i`` counts the keys it sees with gates
    ``g_it = σ(q_i·k_t/√d)``, key ``j`` is at ``p_ij = min(Σ_{t=j}^{i} g_it, npos_max - 1)``
    (fractional), and the logit gets ``q_i·e[p_ij]`` from a learned table ``e`` read between its
    integer rows: ``(1 - w)·q_i·e[⌊p⌋] + w·q_i·e[⌈p⌉]``, ``w = p - ⌊p⌋``
    (:func:`~relpos.functional.cope_logits`).

    As in the paper's listing, the gates read the scaled logits ``q·k/√d`` and the position term is
    added to them unscaled; the authors' training code also divides the position term by ``√d``
    by default, which is this scheme with the table divided by ``√d``. The table starts at zero,
    as theirs.

    Positions are per row and per document: the gates are masked with ``allowed`` (same segment,
    neither token padding, ``k_pos <= q_pos``), so padding and other documents of a packed row
    count nothing and the count restarts at each document. The reverse sum runs along the key
    axis, which relies on a segment's keys lying in increasing position order there — every
    :class:`~relpos.Positions` constructor, ``continued`` and the :class:`~relpos.KVCache` keep
    that; hand-built positions must too. ``key_bias`` reads every key of the call, cached ones
    included, so decoding with a cache equals the full forward pass without extra state (a cache
    with ``max_len`` counts only the keys it kept).

    **Causal only.** The paper counts the keys between a key and its query going back in time and
    defines no bidirectional form; building the scheme with ``causal=False`` raises.

    **Cost.** The gates and positions are ``(b, h, i, j)`` (plus ``O(b·h·i·npos_max)`` for
    ``q·eᵀ``), computed in at least float32, and ``q·kᵀ`` is computed a second time for the gates.
    The term depends on all keys at once, so it has no relative form: it runs on ``eager`` and
    ``sdpa`` (``auto`` takes ``sdpa``), and ``chunked`` and ``flex`` refuse it. Memory is
    ``O(i·j)`` per head, like any materialised bias.

    Shapes:
        ``key_bias`` returns float32 (float64 for float64 inputs) ``(b, h, i, j)``; the table
        ``e`` is ``(npos_max, head_dim)``, or ``(num_heads, npos_max, head_dim)`` with
        ``per_head``.
    """

    config_class = CoPEConfig
    hooks: ClassVar[frozenset[str]] = frozenset({"key_bias"})
    #: Defined for causal attention only (the test suites read this).

    def __init__(self, config: CoPEConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)  # refuses causal=False (the config's causal_only)
        c = self.config
        shape = (self.num_heads,) if c.per_head else ()
        self.pos_emb = nn.Parameter(torch.zeros(*shape, c.npos_max, self.head_dim))

    def key_bias(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor:
        table = self.pos_emb if self.config.per_head else self.pos_emb.unsqueeze(0)
        allowed = q_positions.allowed(k_positions, causal=True)
        return cope_logits(q, k, allowed, table)
