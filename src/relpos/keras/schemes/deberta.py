"""DeBERTa's disentangled attention in Keras."""

from __future__ import annotations

import math

import keras
from keras import ops

from ..ops import gather_relative, relative_distance
from .base import AttentionScheme, register

__all__ = ["DebertaScheme"]


@register
class DebertaScheme(AttentionScheme):
    """DeBERTa's disentangled attention (He et al., 2021, §3.1; v2/v3 log buckets): logits
    ``(q_i·k_j + q_i·K_r[δ(i, j)] + k_j·Q_r[δ(i, j)]) / √(s·d)``, content-to-position (``c2p``)
    and position-to-content (``p2c``), ``s = 1 +`` the number of position terms, as
    :class:`relpos.schemes.DeBERTa` (same config, same numbers).

    Weights (float32): ``rel_embeddings`` ``P (2·span, h·d)`` (``N(0, 0.02²)``), with
    ``norm_rel_ebd="layer_norm"`` its ``layer_norm_gamma``, ``layer_norm_beta`` ``(h·d,)``, and
    per term a projection ``{name}_kernel (h·d, h·d)`` (input, output), ``{name}_bias (h·d,)``
    (``nn.Linear``'s initialisation), ``name`` ``key_proj`` / ``query_proj`` with
    ``share_att_key`` (HF's names; the scheme holds its own copies) or ``pos_key_proj`` /
    ``pos_query_proj``.

    ``δ(i, j)`` comes from a constant table of rows for every relative position up to where it
    saturates (:meth:`relpos.spec.DebertaConfig.index_table`, the PyTorch scheme's table too:
    the same float32 bucket edges on every backend). ``rotate`` scales the queries by ``1/√s``;
    ``score_bias`` (c2p) is ``q·(K_r/√d)ᵀ`` ``(b, h, i, R)`` gathered per pair; ``key_bias``
    (p2c) is ``k·Q_rᵀ/√(s·d)`` ``(b, h, j, R)`` over every key of the call, cached ones included,
    gathered with the transposed index. In self-attention of a static length only the rows the
    length reaches are projected (when that spares half of them). Beside the logits: up to two
    ``(b, h, i, j)`` terms and the ``(b|1, i, j)`` int32 index; never an ``(i, j, d)`` tensor.
    The c2p projection's bias adds ``q_i·b`` to every key of query ``i``, which softmax ignores:
    it gets no gradient (as in HF's model).
    """

    scheme_name = "deberta"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        c = config
        self.terms = 1 + len(c.pos_att_type)  # s
        self.width = self.num_heads * self.head_dim
        self.rows = 2 * c.span
        shared = c.share_att_key
        #: Projection name of each term (HF's, with and without share_att_key).
        self.projection_names = {
            "c2p": "key_proj" if shared else "pos_key_proj",
            "p2c": "query_proj" if shared else "pos_query_proj",
        }
        # Row of every relative position p_i - p_j in [-reach, reach], constant beyond (the
        # PyTorch scheme's table, from the same spec).
        self.reach = c.reach
        self.index_table = tuple(c.index_table().tolist())

    def build(self, input_shape=None) -> None:
        c, width = self.config, self.width
        self.rel_embeddings = self.add_weight(
            name="rel_embeddings",
            shape=(self.rows, width),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype="float32",
        )
        if c.norm_rel_ebd == "layer_norm":
            for name, init in (("layer_norm_gamma", "ones"), ("layer_norm_beta", "zeros")):
                weight = self.add_weight(
                    name=name, shape=(width,), initializer=init, dtype="float32"
                )
                setattr(self, name, weight)
        bound = width**-0.5  # nn.Linear's U(±1/√fan_in), kernel and bias
        for term in c.pos_att_type:
            name = self.projection_names[term]
            for part, shape in (("kernel", (width, width)), ("bias", (width,))):
                # A fresh initializer per weight: one instance draws the same values twice.
                init = keras.initializers.RandomUniform(-bound, bound)
                weight = self.add_weight(
                    name=f"{name}_{part}", shape=shape, initializer=init, dtype="float32"
                )
                setattr(self, f"{name}_{part}", weight)
        self.built = True

    def rotate(self, q, k, q_positions, k_positions):
        return q * ops.cast(1.0 / math.sqrt(self.terms), q.dtype), k

    def _index(self, q_positions, k_positions):
        """``δ(i, j)`` ``(b|1, i, j)`` int32, and the rows ``lo .. hi`` it can reach."""
        rel = -relative_distance(q_positions.pos, k_positions.pos)  # p_i - p_j
        reach = self.reach
        table = ops.convert_to_tensor(self.index_table, dtype="int32")
        index = ops.take(table, ops.clip(rel, -reach, reach) + reach, axis=0)
        lo, hi = 0, self.rows - 1
        n = k_positions.pos.shape[1]
        if q_positions is k_positions and n is not None and n - 1 < reach:
            # Self-attention: |p_i - p_j| <= n - 1, and the rows grow with the relative position.
            # Projected only when that spares half the rows (else one shape for every length).
            low, high = self.index_table[reach - (n - 1)], self.index_table[reach + n - 1]
            if high - low + 1 <= self.rows // 2:
                lo, hi = low, high
                index = ops.clip(index, lo, hi) - lo
        return index, lo, hi

    def _states(self, term: str, lo: int, hi: int):
        """``W·P + b`` of one term's projection over rows ``lo .. hi``: float32 ``(h, R', d)``."""
        table = ops.cast(self.rel_embeddings, "float32")[lo : hi + 1]
        if self.config.norm_rel_ebd == "layer_norm":
            mean = ops.mean(table, axis=-1, keepdims=True)
            var = ops.mean(ops.square(table - mean), axis=-1, keepdims=True)
            table = (table - mean) * ops.rsqrt(var + self.config.layer_norm_eps)
            table = table * ops.cast(self.layer_norm_gamma, "float32")
            table = table + ops.cast(self.layer_norm_beta, "float32")
        name = self.projection_names[term]
        kernel = ops.cast(getattr(self, f"{name}_kernel"), "float32")
        bias = ops.cast(getattr(self, f"{name}_bias"), "float32")
        states = ops.matmul(table, kernel) + bias  # (R', h·d)
        states = ops.reshape(states, (-1, self.num_heads, self.head_dim))
        return ops.transpose(states, (1, 0, 2))

    def score_bias(self, q, q_positions, k_positions):
        if "c2p" not in self.config.pos_att_type:
            return None
        index, lo, hi = self._index(q_positions, k_positions)
        keys = self._states("c2p", lo, hi) / math.sqrt(self.head_dim)
        rel = ops.einsum("bihd,hrd->bhir", ops.cast(q, "float32"), keys)
        return gather_relative(rel, index)

    def key_bias(self, q, k, q_positions, k_positions):
        if "p2c" not in self.config.pos_att_type:
            return None
        index, lo, hi = self._index(q_positions, k_positions)
        queries = self._states("p2c", lo, hi) / math.sqrt(self.terms * self.head_dim)
        rel = ops.einsum("bjhd,hrd->bhjr", ops.cast(k, "float32"), queries)
        out = gather_relative(rel, ops.transpose(index, (0, 2, 1)))  # (b, h, j, i)
        return ops.transpose(out, (0, 1, 3, 2))
