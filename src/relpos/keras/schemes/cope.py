"""CoPE, contextual position encoding, in Keras."""

from __future__ import annotations

import math

from keras import ops

from ..positions import allowed_pairs
from .base import AttentionScheme, register

__all__ = ["CoPEScheme"]


@register
class CoPEScheme(AttentionScheme):
    """CoPE (Golovneva et al., 2024, §3), as :class:`relpos.schemes.CoPE`: query ``i`` counts the
    keys it may attend to with gates ``g_it = σ(q_i·k_t/√d)``; key ``j`` sits at ``p_ij =
    min(Σ_{t=j}^{i} g_it, npos_max - 1)`` and adds ``q_i·e[p_ij]``, read between the integer rows
    of a learned table ``e`` (``pos_emb``, float32 ``(npos_max, d)`` or ``(h, npos_max, d)`` with
    ``per_head``, starting at 0).

    ``key_bias`` reads every key of the call (cached ones included), so cached decoding needs no
    extra state. The gates are masked to the allowed pairs (same document, real tokens,
    ``k_pos <= q_pos``), so counts restart at every document and skip padding; the reverse sum
    runs along the key axis, where each document's keys lie in position order (masks, segments,
    the cache's slots). **Causal only** (``causal=False`` raises). **Cost** ``O(i·j)`` per head:
    the gates, positions and interpolated term are ``(b, h, i, j)`` float32, ``q·kᵀ`` is computed
    a second time for the gates, plus ``O(b·h·i·npos_max)`` for ``q·eᵀ``.
    """

    scheme_name = "cope"
    adds_terms = True

    def build(self, input_shape=None) -> None:
        c = self.config
        shape = (self.num_heads,) if c.per_head else ()
        self.pos_emb = self.add_weight(
            name="pos_emb",
            shape=(*shape, c.npos_max, self.head_dim),
            initializer="zeros",
            dtype="float32",
        )
        self.built = True

    def key_bias(self, q, k, q_positions, k_positions):
        qf, kf = ops.cast(q, "float32"), ops.cast(k, "float32")
        logits = ops.einsum("bihd,bjhd->bhij", qf, kf) / math.sqrt(q.shape[-1])
        allowed = ops.expand_dims(allowed_pairs(q_positions, k_positions, causal=True), 1)
        gates = ops.where(allowed, ops.sigmoid(logits), 0.0)  # where: NaN-free at masked pairs
        positions = ops.flip(ops.cumsum(ops.flip(gates, -1), axis=-1), -1)  # Σ_{t >= j}
        positions = ops.minimum(positions, float(self.config.npos_max - 1))
        table = ops.cast(self.pos_emb, "float32")
        if self.config.per_head:
            z = ops.einsum("bihd,hnd->bhin", qf, table)
        else:
            z = ops.einsum("bihd,nd->bhin", qf, table)  # z_i[n] = q_i·e[n]
        floor = ops.stop_gradient(ops.floor(positions))
        ceil = ops.stop_gradient(ops.ceil(positions))
        w = positions - floor
        low = ops.take_along_axis(z, ops.cast(floor, "int32"), axis=-1)
        high = ops.take_along_axis(z, ops.cast(ceil, "int32"), axis=-1)
        return low + w * (high - low)
