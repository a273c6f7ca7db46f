"""FIRE: functional interpolation for relative positions (Li et al., ICLR 2024, §3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..functional.fire import fire_bias, fire_pairs
from ..functional.pair_bias import PairBias
from ..positions import Positions
from ..spec.fire import FireConfig
from .base import PAIRWISE_QUERIES, PairBiasScheme, register
from .heads import head_selection, select_heads

__all__ = ["Fire", "FireConfig"]

#: Where :func:`_key_positions` puts padding keys: past any query (``p_i - p_j`` stays in int64).
PAST_EVERY_QUERY = 2**62


@register
class Fire(PairBiasScheme):
    """FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long
    Context Transformers"): for causal attention, head ``h`` adds to the logit of query ``i`` and
    key ``j``

        ``f_θ(ψ(p_i - p_j) / ψ(max(L, p_i)))_h``,  ``ψ(x) = log(c·x + 1)``,

    with ``f_θ`` = ``Linear(1, hidden)``, ReLU, ``Linear(hidden, num_heads)``, and ``c`` and the
    threshold ``L = |s|·init_threshold`` learned (``s``: ``threshold_scale``, starting at 1; ``|c|``
    is used), as in the paper's reference code (which also adds ``1e-6`` to the normaliser).
    ``p`` are the tokens' positions in their own sequences, so padded, packed and cached batches
    get the bias of each sequence alone.

    The bias depends on the query's position, not just the distance: it is evaluated per pair by
    :func:`~relpos.functional.fire_bias`, which reads the MLP as the piecewise-linear function it
    is (``O(pairs·h)``, no ``(pairs, hidden)`` tensor). In float32 on the CPU a C kernel does the
    per-pair work, and ``chunked`` runs it tile by tile through :meth:`pair_bias`, reducing its
    gradient inside the kernel (:class:`~relpos.functional.fire.FirePairs`). ``flex`` does not run
    it.

    Causal only: the paper defines the normalised distance for ``p_j <= p_i`` (it lies in
    ``[0, 1]``); building FIRE for bidirectional attention raises ``ValueError``.

    Shapes:
        ``score_bias`` returns ``(b|1, h, i, j)`` in at least float32.
    """

    config_class = FireConfig
    hooks = frozenset({"score_bias"})
    #: Refuses bidirectional attention (tests read it).

    def __init__(self, config: FireConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)  # refuses causal=False (the config's causal_only)
        c = self.config
        self.mlp = nn.Sequential(
            nn.Linear(1, c.hidden), nn.ReLU(), nn.Linear(c.hidden, self.num_heads)
        )
        self.c = nn.Parameter(torch.tensor(float(c.init_c)))
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))  # L = |scale|·init_threshold
        self.register_buffer(
            "bias_heads", head_selection(c.heads, self.num_heads), persistent=False
        )

    def _arguments(self) -> tuple[Tensor, ...]:
        """``(c, L, w1, b1, w2, b2)`` for :func:`~relpos.functional.fire_bias`, in the compute
        dtype (heads left out of ``heads`` output 0)."""
        dtype = compute_dtype(self.c.dtype)
        first, last = self.mlp[0], self.mlp[2]
        return (
            self.c.to(dtype),
            self.threshold_scale.to(dtype) * self.config.init_threshold,
            first.weight.to(dtype),
            first.bias.to(dtype),
            select_heads(last.weight.to(dtype), self.bias_heads),
            select_heads(last.bias.to(dtype), self.bias_heads),
        )

    def score_bias(self, q: Tensor, q_positions: Positions, k_positions: Positions) -> Tensor:
        few = len(q_positions) <= PAIRWISE_QUERIES  # decoding: per pair, no device value read
        return fire_bias(
            q_positions.pos, _key_positions(k_positions), *self._arguments(), by_distance=not few
        )

    def pair_bias(
        self, q: Tensor, q_positions: Positions, k_positions: Positions
    ) -> PairBias | None:
        if compute_dtype(q.dtype) != torch.float32:
            return None
        return fire_pairs(q_positions.pos, _key_positions(k_positions), *self._arguments())


def _key_positions(k_positions: Positions) -> Tensor:
    """Key positions with padding (masked) moved past every query, so that its pairs read
    distance 0: the tables over distances then span the real tokens', not ``p_i - 0`` at any
    offset."""
    return torch.where(k_positions.valid, k_positions.pos, PAST_EVERY_QUERY)
