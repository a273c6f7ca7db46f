"""Attention schemes as Keras layers: the same hooks and configs as :mod:`relpos.schemes`.

A scheme is built from the framework-neutral config (:mod:`relpos.spec`, which validates names,
fields and the fields against the layer's geometry for both frameworks), so a config dict means
the same thing, and is refused with the same message, in both. It holds its tables as Keras
weights and contributes through at most three hooks (every default does nothing):

===========================  =================================================================
hook                         contract (Keras layout: heads after tokens)
===========================  =================================================================
``rotate(q, k, qp, kp)``     rotated ``q (b, i, h, d)`` and ``k (b, j, h, d)``
``score_bias(q, qp, kp)``    float32 ``(b|1, h|1, i, j)`` added to the *scaled* logits
``key_bias(q, k, qp, kp)``   float32 ``(b, h, i, j)`` added to the scaled logits, reading the
                             keys too: every key of the call (cached ones included, rotated,
                             key/value heads repeated to ``h``); DeBERTa's p2c, CoPE's gates
``value_term(p, qp, kp)``    float32 ``(b, i, h, d)`` added to the output, from probs
                             ``(b, h, i, j)``
``token_log_decay(x)``       (``contextual`` schemes) ``log f (b, n, h)`` of every token from the
                             layer input ``x``; the attention layer turns it into the positions'
                             ``log_decay`` (per-document cumulative sums, continued through the
                             cache): the Forgetting Transformer's gates
===========================  =================================================================

``qp``/``kp`` are :class:`~relpos.keras.positions.Positions`; no hook reads array indices. A
scheme whose key rotation depends on the other keys (a length-dependent RoPE scaling) declares
``rotates_cached_keys``: keys then enter the cache raw and ``rotate`` gets every cached key. A
scheme defined for causal attention only declares ``causal_only`` (``causal=False`` raises, with
the PyTorch side's message).
Absolute schemes (``sinusoidal``, ``learned``) act at the input: see
:class:`~relpos.keras.embeddings.TokenAndPositionEmbedding`.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

import keras
from keras import ops

from ..spec import CONFIGS, SchemeConfig, config_from_dict
from ..spec import scheme_config as shared_scheme_config
from ..spec.base import ABSOLUTE_SCHEMES, check_causal, head_mask
from ..spec.fire import FIRE_EPS
from ..spec.kerple import KERPLE_EPS
from ..spec.rope import check_xpos_position, xpos_decay
from ..spec.sandwich import sandwich_head_scales
from .ops import (
    alibi_bias,
    apply_rope,
    clipped_relative_index,
    fire_mlp,
    gather_relative,
    kerple_bias,
    relative_distance,
    rope_angles,
    sandwich_bias,
    scatter_relative,
    sequence_rope_frequencies,
    t5_buckets,
    xpos_scale,
)
from .positions import (
    Positions,
    accumulation_dtype,
    allowed_pairs,
    distance_range,
    holds_values,
    sequence_length,
    sequence_lengths,
)

__all__ = [
    "KERAS_SCHEMES",
    "AttentionScheme",
    "CoPEScheme",
    "DebertaScheme",
    "DistanceBiasScheme",
    "FireScheme",
    "ForgetGateScheme",
    "SandwichScheme",
    "make_attention_scheme",
    "scheme_config",
]

#: Keras attention schemes by name (the names of :data:`relpos.SCHEMES` that act in attention).
KERAS_SCHEMES: dict[str, type[AttentionScheme]] = {}


def _register(cls):
    KERAS_SCHEMES[cls.scheme_name] = cls
    return cls


def _bias_heads(config: SchemeConfig, num_heads: int) -> tuple[bool, ...] | None:
    """The config's ``heads`` as one flag per head (True: gets the bias), or None for all."""
    mask = head_mask(getattr(config, "heads", None), num_heads)
    return None if mask is None else tuple(bool(x) for x in mask)


def _zero_left_out(values, bias_heads: tuple[bool, ...] | None, *, axis: int):
    """``values`` with exact zeros (and zero gradients) for the heads left out along ``axis``
    (``relpos.schemes.heads.select_heads`` in ``keras.ops``)."""
    if bias_heads is None:
        return values
    shape = [1] * len(values.shape)
    shape[axis] = len(bias_heads)
    keep = ops.reshape(ops.convert_to_tensor(bias_heads, dtype="bool"), shape)
    return ops.where(keep, values, 0.0)


class AttentionScheme(keras.layers.Layer):
    """Base of every Keras attention scheme: geometry, config and three no-op hooks.

    Args:
        config: the scheme's :class:`~relpos.spec.SchemeConfig` (the PyTorch side's too); its
            :meth:`~relpos.spec.SchemeConfig.check_dims` checks it against this geometry.
        num_heads: heads ``h``.
        head_dim: head dim ``d``.
        causal: whether the attention is causal (T5 buckets, Music Transformer table size).
    """

    #: The name this scheme is registered under (that of its config).
    scheme_name: ClassVar[str] = ""
    #: Whether :meth:`score_bias` or :meth:`value_term` add a term (else the fused kernel runs).
    adds_terms: ClassVar[bool] = False
    #: Whether :meth:`value_term` adds a term (its head dim is then ``head_dim``).
    has_value_term: bool = False
    #: Whether a key's rotation depends on the other keys (its sequence's current length: dynamic
    #: NTK, LongRoPE). Then the cache holds raw keys and :meth:`rotate` receives every cached key
    #: at every call (the PyTorch side's ``Scheme.rotates_cached_keys``).
    rotates_cached_keys: bool = False
    #: Whether the scheme computes per-token values from the layer's input
    #: (:meth:`token_log_decay`): self-attention only, and its cache carries them.
    contextual: ClassVar[bool] = False

    def __init__(
        self, config: SchemeConfig, *, num_heads: int, head_dim: int, causal: bool, **kwargs
    ) -> None:
        # Every check of the config against this geometry, the PyTorch schemes' own.
        config.check_dims(num_heads=num_heads, head_dim=head_dim, causal=causal)
        super().__init__(**kwargs)
        self.config = config
        self.num_heads, self.head_dim, self.causal = num_heads, head_dim, bool(causal)

    @property
    def causal_only(self) -> bool:
        """Whether the scheme exists only for causal attention (its config's flag)."""
        return self.config.causal_only

    def build(self, input_shape=None) -> None:
        self.built = True

    def rotate(self, q, k, q_positions: Positions, k_positions: Positions):
        """Rotate ``q (b, i, h, d)`` and keys ``k (b, j, h_kv, d)`` by their positions: the new
        keys, or every cached key when :attr:`rotates_cached_keys`."""
        return q, k

    def score_bias(self, q, q_positions: Positions, k_positions: Positions):
        return None

    def key_bias(self, q, k, q_positions: Positions, k_positions: Positions):
        """Float32 ``(b, h, i, j)`` term from the queries ``(b, i, h, d)`` and every key ``(b, j,
        h, d)`` of the call, or None."""
        return None

    def value_term(self, probs, q_positions: Positions, k_positions: Positions):
        return None

    def token_log_decay(self, x):
        """``contextual`` schemes: ``log f`` per token and head, float32 ``(b, n, h)``, from the
        layer input ``x (b, n, D)``."""
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            scheme=self.config.to_dict(),
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            causal=self.causal,
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["config"] = config_from_dict(config.pop("scheme"))
        return cls(**config)


@_register
class NoPositions(AttentionScheme):
    """NoPE: no positional term; with a causal mask a decoder still infers order."""

    scheme_name = "nope"


@_register
class RotaryScheme(AttentionScheme):
    """RoPE (Su et al., 2021): rotates queries and keys by ``p·ω_m`` from each token's own
    position; ``ω`` with the config's long-context scaling (the PyTorch side's frequencies), and
    YaRN's or LongRoPE's attention factor on q and k.

    * Plain RoPE and static scalings (linear, NTK, YaRN, Llama 3) rotate keys once, before they
      enter the cache.
    * Dynamic NTK and LongRoPE take ``ω`` from the length of each token's own sequence
      (:func:`~relpos.keras.positions.sequence_lengths`): keys enter the cache raw and are
      rotated at every call with their sequence's current length (``rotates_cached_keys``), so
      decoding step ``t`` equals the forward over the row's first ``t`` tokens.
    * xPos (``xpos_scale_base`` ``γ``, causal only) scales pair ``m`` of a query at ``p`` by
      ``ζ_m^(p/γ)`` and of a key by ``ζ_m^(-p/γ)``. A position beyond
      :func:`~relpos.functional.xpos.xpos_max_position` for q's dtype is a ``ValueError`` when the
      positions hold values (eager); under ``jit`` / ``tf.function`` they are not checked.
    * ``learned_freq``: ``ω`` is a trainable float32 weight ``inv_freq (r/2,)`` initialised to
      the (scaled) ladder.

    Multi-axis coordinates are PyTorch-only: Keras positions have one axis, so with ``sections``
    every section reads ``pos`` (M-RoPE is then plain RoPE; axial RoPE keeps its ladders).
    """

    scheme_name = "rope"

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        r = self.rotary_dim = config.rotated(self.head_dim)
        self.rotates_cached_keys = config.length_dependent
        inv_freq, self.attention_factor = config.frequencies(self.head_dim)
        self.ladder = tuple(inv_freq.tolist())  # fixed ω, or the learned weight's initial value
        self.xpos_decay = None if config.xpos_scale_base is None else tuple(xpos_decay(r).tolist())
        self.inv_freq = None

    def build(self, input_shape=None) -> None:
        if self.config.learned_freq:
            self.inv_freq = self.add_weight(
                name="inv_freq",
                shape=(len(self.ladder),),
                initializer=lambda shape, dtype: ops.convert_to_tensor(self.ladder, dtype),
                dtype="float32",
            )
        self.built = True

    def _angles(self, positions: Positions, lengths):
        if lengths is not None:
            c = self.config
            inv = sequence_rope_frequencies(self.rotary_dim, c.theta, c.scaling_dict, lengths)
        elif self.inv_freq is not None:
            inv = ops.cast(self.inv_freq, "float32")
        else:
            inv = ops.convert_to_tensor(self.ladder, dtype="float32")
        return rope_angles(positions.pos, inv)

    def _xpos(self, positions: Positions, dtype, *, key: bool):
        base = self.config.xpos_scale_base
        if base is None:
            return None
        if holds_values(positions.pos):  # traced (jit, tf.function): no data-dependent check
            largest = int(ops.convert_to_numpy(ops.max(ops.abs(positions.pos))))
            check_xpos_position(largest, keras.backend.standardize_dtype(dtype), base)
        return xpos_scale(positions.pos, self.xpos_decay, base, inverse=key)

    def rotate(self, q, k, q_positions, k_positions):
        q_len = k_len = None
        if self.rotates_cached_keys:
            if q_positions is k_positions:
                (q_len,) = sequence_lengths(q_positions)
                k_len = q_len
            else:
                q_len, k_len = sequence_lengths(q_positions, k_positions)
        il = self.config.interleaved
        q_scale = self._xpos(q_positions, q.dtype, key=False)
        k_scale = self._xpos(k_positions, k.dtype, key=True)
        q = apply_rope(q, self._angles(q_positions, q_len), interleaved=il, scale=q_scale)
        k = apply_rope(k, self._angles(k_positions, k_len), interleaved=il, scale=k_scale)
        if self.attention_factor != 1.0:
            q = ops.cast(ops.cast(q, "float32") * self.attention_factor, q.dtype)
            k = ops.cast(ops.cast(k, "float32") * self.attention_factor, k.dtype)
        return q, k


@_register
class AlibiScheme(AttentionScheme):
    """ALiBi (Press et al., 2022): ``slope_h·(p_j - p_i)`` causal, ``-slope_h·|p_j - p_i|``
    bidirectional. Builds one ``(b|1, h, i, j)`` bias."""

    scheme_name = "alibi"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        # fixed: computed once (the config's per-head slopes, or the paper's); 0 for the heads
        # left out of ``heads``
        self.slopes = tuple(config.head_slopes(self.num_heads).tolist())

    def score_bias(self, q, q_positions, k_positions):
        slopes = ops.convert_to_tensor(self.slopes, dtype="float32")
        distance = relative_distance(q_positions.pos, k_positions.pos)
        return alibi_bias(slopes, distance, causal=self.causal)


@_register
class T5Scheme(AttentionScheme):
    """T5 (Raffel et al., 2020): a learned scalar per (bucket, head), ``table (R, h)``.

    Materialises two ``(b|1, i, j)``-sized tensors per head: the gathered ``(b|1, i, j, h)`` values
    and their transpose, the ``(b|1, h, i, j)`` bias (plus one ``(b|1, i, j)`` bucket index)."""

    scheme_name = "t5"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)  # bucket checks: T5Config.validate_dims
        # per-head control: 1 for the heads that get the bias, 0 for the others
        mask = head_mask(config.heads, self.num_heads)
        self.head_scale = None if mask is None else tuple(float(x) for x in mask)

    def build(self, input_shape=None) -> None:
        self.table = self.add_weight(
            name="table",
            shape=(self.config.num_buckets, self.num_heads),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype="float32",
        )
        self.built = True

    def score_bias(self, q, q_positions, k_positions):
        c = self.config
        buckets = t5_buckets(
            relative_distance(q_positions.pos, k_positions.pos),
            bidirectional=not self.causal,
            num_buckets=c.num_buckets,
            max_distance=c.max_distance,
        )
        table = ops.cast(self.table, "float32")
        if self.head_scale is not None:
            table = table * ops.convert_to_tensor(self.head_scale, dtype="float32")
        values = ops.take(table, buckets, axis=0)  # (b, i, j, h)
        return ops.transpose(values, (0, 3, 1, 2))


@_register
class ShawScheme(AttentionScheme):
    """Shaw et al. (2018): ``e_ij = q_i·(k_j + a^K_ij)/√d``, ``z_i = Σ_j α_ij (v_j + a^V_ij)``,
    ``a_ij`` from ``2k+1``-row tables by clipped distance.

    The key term is ``q·Wᵀ`` ``(b, h, i, 2k+1)`` gathered into a ``(b, h, i, j)`` bias, through a
    ``(b, h, i, j)`` int32 index (``take_along_axis`` wants it full size). The value term sums the
    probabilities per table row with one segment sum (another ``(b, h, i, j)`` index), then
    multiplies by the table. So up to three ``(b, h, i, j)`` tensors beside the logits; never an
    ``(i, j, d)`` one.
    """

    scheme_name = "shaw"

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.adds_terms = config.keys or config.values
        self.has_value_term = config.values
        self.rows = 2 * config.max_distance + 1

    def build(self, input_shape=None) -> None:
        c = self.config
        shape = (
            (self.num_heads, self.rows, self.head_dim) if c.per_head else (self.rows, self.head_dim)
        )

        # A fresh initializer per table: one instance would draw the same values for both.
        def init():
            return keras.initializers.RandomNormal(stddev=self.head_dim**-0.5)

        self.key_table = (
            self.add_weight(name="key_table", shape=shape, initializer=init(), dtype="float32")
            if c.keys
            else None
        )
        self.value_table = (
            self.add_weight(name="value_table", shape=shape, initializer=init(), dtype="float32")
            if c.values
            else None
        )
        self.built = True

    def _index(self, q_positions, k_positions):
        distance = relative_distance(q_positions.pos, k_positions.pos)
        return clipped_relative_index(distance, self.config.max_distance)

    def score_bias(self, q, q_positions, k_positions):
        if self.key_table is None:
            return None
        table = ops.cast(self.key_table, "float32") / math.sqrt(self.head_dim)
        qf = ops.cast(q, "float32")
        if self.config.per_head:
            rel = ops.einsum("bihd,hrd->bhir", qf, table)
        else:
            rel = ops.einsum("bihd,rd->bhir", qf, table)
        return gather_relative(rel, self._index(q_positions, k_positions))

    def value_term(self, probs, q_positions, k_positions):
        if self.value_table is None:
            return None
        index = ops.expand_dims(self._index(q_positions, k_positions), 1)  # (b|1, 1, i, j)
        mass = scatter_relative(ops.cast(probs, "float32"), index, self.rows)  # (b, h, i, R)
        table = ops.cast(self.value_table, "float32")
        if self.config.per_head:
            return ops.einsum("bhir,hrd->bihd", mass, table)
        return ops.einsum("bhir,rd->bihd", mass, table)


@_register
class MusicScheme(AttentionScheme):
    """The Music Transformer (Huang et al., 2018): ``S_rel[i, j] = q_i·Er[clip(p_j - p_i)]/√d``
    with a per-head table ``Er`` (``M+1`` rows causal, ``2M+1`` bidirectional).

    ``q·Erᵀ`` over the rows the batch can reach (sliced to the sequence length when it is
    static), gathered by clipped distance into a ``(b, h, i, j)`` bias through a ``(b, h, i, j)``
    int32 index: two ``(b, h, i, j)`` tensors beside the logits.
    """

    scheme_name = "music"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        m = config.max_distance
        self.rows = m + 1 if self.causal else 2 * m + 1

    def build(self, input_shape=None) -> None:
        self.table = self.add_weight(
            name="table",
            shape=(self.num_heads, self.rows, self.head_dim),
            initializer=keras.initializers.RandomNormal(stddev=self.head_dim**-0.5),
            dtype="float32",
        )
        self.built = True

    def score_bias(self, q, q_positions, k_positions):
        m = self.config.max_distance
        distance = relative_distance(q_positions.pos, k_positions.pos)
        index = ops.clip(distance, -m, 0 if self.causal else m) + m
        keys = ops.cast(self.table, "float32") / math.sqrt(self.head_dim)
        n = k_positions.pos.shape[1]
        if q_positions is k_positions and n is not None and n - 1 < m:
            # Self-attention: positions are ranks inside a row, so |distance| <= n - 1 and only
            # rows M-(n-1) .. M(+n-1) can be read; multiply q by those rows only.
            lo, hi = m - (n - 1), m + (0 if self.causal else n - 1)
            keys, index = keys[:, lo : hi + 1], ops.clip(index, lo, hi) - lo
        rel = ops.einsum("bihd,hrd->bhir", ops.cast(q, "float32"), keys)
        return gather_relative(rel, index)


class DistanceBiasScheme(AttentionScheme):
    """A scheme whose logit term is a per-head function of the signed distance only,
    ``f_h(p_j - p_i)``: the Keras twin of :class:`relpos.schemes.DistanceBiasScheme` (KERPLE,
    learned ALiBi, the dynamic position bias).

    Subclasses implement :meth:`distance_bias`. ``score_bias`` evaluates it once per distance of
    a window per row and gathers: the window starts at the row's smallest distance between real
    tokens (:func:`~relpos.keras.positions.distance_range`) and holds ``i + j - 1`` distances,
    every distance positions counted inside rows can reach (a mask, segments, a start index, a
    cache). So ``O(b·h·(i + j))`` evaluations, never ``O(h·i·j)``, and a static size under
    ``jit``. Positions counted inside rows (``Positions.compact``) always fit it, so the window is
    taken with no branch: what XLA compiles on TensorFlow, whose ``jit_compile`` cannot
    differentiate a ``cond`` once a sequence length is dynamic. Only explicit ``positions=`` may
    overflow; for those, a row whose distances overflow the window (gaps) makes the call evaluate
    the function per pair instead, ``(b, h, i, j)`` evaluations: the same numbers
    (``keras.ops.cond`` when traced, a Python branch otherwise).

    A config field ``heads`` (head indices, or None for all) gives the heads left out exact
    zeros, with zero gradients, wherever :meth:`distance_bias` is evaluated, as the PyTorch
    scheme zeroes their rows of its table.
    """

    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.bias_heads = _bias_heads(config, self.num_heads)  # None: every head

    def distance_bias(self, distance):
        """The bias of each distance for each head: float32 ``(h, N)`` for int32 ``(N,)``."""
        raise NotImplementedError

    def _bias_of(self, distance):
        """``distance (bb, ...)`` → float32 ``(bb, h, ...)``, 0 for the heads left out."""
        shape = ops.shape(distance)
        values = self.distance_bias(ops.reshape(distance, (-1,)))  # (h, N)
        values = _zero_left_out(values, self.bias_heads, axis=0)
        values = ops.reshape(values, (self.num_heads, *shape))
        return ops.moveaxis(values, 0, 1)

    def score_bias(self, q, q_positions, k_positions):
        dist = relative_distance(q_positions.pos, k_positions.pos)  # (bb, i, j)
        lo, hi = distance_range(q_positions, k_positions)  # (bb,)
        size = sequence_length(q_positions.pos) + sequence_length(k_positions.pos) - 1
        if isinstance(size, int):
            size = max(size, 1)

        def window():
            offsets = ops.expand_dims(ops.arange(size, dtype="int32"), 0)
            table = self._bias_of(ops.expand_dims(lo, 1) + offsets)  # (bb, h, D)
            index = ops.clip(dist - ops.reshape(lo, (-1, 1, 1)), 0, size - 1)
            return gather_relative(ops.expand_dims(table, 2), index)

        def per_pair():
            return self._bias_of(dist)

        if q_positions.compact and k_positions.compact:
            return window()
        fits = ops.all(hi - lo < size)
        if holds_values(fits) and keras.backend.backend() != "torch":
            return window() if bool(ops.convert_to_numpy(fits)) else per_pair()
        return ops.cond(fits, window, per_pair)  # torch: a Python branch (meta tensors: window)


@_register
class KerpleScheme(DistanceBiasScheme):
    """KERPLE (Chi et al., 2022, §4): ``-r1·log(1 + r2·|Δ|)`` (``variant="log"``) or
    ``-r1·|Δ|^r2`` (``"power"``) with ``r1, r2`` learned per head (float32 weights ``(h,)``,
    initialised ``U(0, 2)`` and ``U(0, 1)`` plus 0.01), clamped into range at use (``>= 0.01``;
    ``r2 <= 2`` for the power variant), as the PyTorch scheme."""

    scheme_name = "kerple"

    def build(self, input_shape=None) -> None:
        uniform = keras.initializers.RandomUniform
        for name, top in (("r1", 2.0), ("r2", 1.0)):
            weight = self.add_weight(
                name=name,
                shape=(self.num_heads,),
                initializer=uniform(KERPLE_EPS, top + KERPLE_EPS),
                dtype="float32",
            )
            setattr(self, name, weight)
        self.built = True

    def distance_bias(self, distance):
        power = self.config.variant == "power"
        r1 = ops.maximum(ops.cast(self.r1, "float32"), KERPLE_EPS)
        r2 = ops.clip(ops.cast(self.r2, "float32"), KERPLE_EPS, 2.0 if power else 3.0e38)
        return kerple_bias(distance, r1, r2, variant=self.config.variant)


@_register
class LearnedAlibiScheme(DistanceBiasScheme):
    """ALiBi with trained slopes: ``slope_h·(p_j - p_i)`` (causal) or ``-slope_h·|p_j - p_i|``
    (bidirectional); ``slopes`` a float32 weight ``(h,)`` initialised to ALiBi's (or the
    config's) and kept ``>= 0`` at use."""

    scheme_name = "learned_alibi"

    def build(self, input_shape=None) -> None:
        initial = tuple(self.config.initial_slopes(self.num_heads).tolist())
        self.slopes = self.add_weight(
            name="slopes",
            shape=(self.num_heads,),
            initializer=lambda shape, dtype: ops.convert_to_tensor(initial, dtype),
            dtype="float32",
        )
        self.built = True

    def distance_bias(self, distance):
        slopes = ops.expand_dims(ops.maximum(ops.cast(self.slopes, "float32"), 0.0), -1)
        d = ops.expand_dims(ops.cast(distance, "float32"), 0)
        return slopes * (d if self.causal else -ops.abs(d))


@_register
class DynamicPositionBiasScheme(DistanceBiasScheme):
    """The dynamic position bias (Wang et al., 2021, CrossFormer §3.3): an MLP maps each distance
    ``Δ`` (``|Δ|`` when causal; ``sign(Δ)·log(1 + |Δ|)`` with ``log_distance``) to one bias per
    head: ``Dense(hidden)``, ``depth`` blocks of ``LayerNorm, ReLU, Dense(hidden)``, then
    ``LayerNorm, ReLU, Dense(h)``; float32 weights, initialised as PyTorch's ``nn.Linear`` and
    ``nn.LayerNorm``. The MLP runs once per distance of the window
    (:class:`DistanceBiasScheme`). Weights: ``dense_{l}_kernel (in, out)``, ``dense_{l}_bias``
    for the ``depth + 2`` dense layers, ``norm_{l}_gamma``, ``norm_{l}_beta`` for the
    ``depth + 1`` norms."""

    scheme_name = "dpb"

    def build(self, input_shape=None) -> None:
        c = self.config
        widths = [1] + [c.hidden] * (c.depth + 1) + [self.num_heads]
        self.kernels, self.biases, self.gammas, self.betas = [], [], [], []
        for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            bound = fan_in**-0.5  # nn.Linear's U(±1/√fan_in), kernel and bias
            for store, name, shape in (
                (self.kernels, "kernel", (fan_in, fan_out)),
                (self.biases, "bias", (fan_out,)),
            ):
                # A fresh initializer per weight: one instance draws the same values twice.
                init = keras.initializers.RandomUniform(-bound, bound)
                weight = self.add_weight(
                    name=f"dense_{layer}_{name}", shape=shape, initializer=init, dtype="float32"
                )
                store.append(weight)
        norms = ((self.gammas, "gamma", "ones"), (self.betas, "beta", "zeros"))
        for layer in range(c.depth + 1):
            for store, name, init in norms:
                label = f"norm_{layer}_{name}"
                weight = self.add_weight(
                    name=label, shape=(c.hidden,), initializer=init, dtype="float32"
                )
                store.append(weight)
        self.built = True

    def distance_bias(self, distance):
        x = ops.cast(distance, "float32")
        if self.causal:
            x = ops.abs(x)
        if self.config.log_distance:
            x = ops.sign(x) * ops.log1p(ops.abs(x))
        x = ops.expand_dims(x, -1)  # (N, 1)
        f32 = lambda w: ops.cast(w, "float32")  # noqa: E731
        x = ops.matmul(x, f32(self.kernels[0])) + f32(self.biases[0])
        for gamma, beta, kernel, bias in zip(
            self.gammas, self.betas, self.kernels[1:], self.biases[1:], strict=True
        ):
            mean = ops.mean(x, axis=-1, keepdims=True)
            var = ops.mean(ops.square(x - mean), axis=-1, keepdims=True)
            x = (x - mean) * ops.rsqrt(var + 1e-5) * f32(gamma) + f32(beta)  # nn.LayerNorm
            x = ops.matmul(ops.relu(x), f32(kernel)) + f32(bias)
        return ops.transpose(x)  # (N, h) -> (h, N)


@_register
class SandwichScheme(DistanceBiasScheme):
    """Sandwich (Chi et al., 2023, "Dissecting Transformer Length Extrapolation via the Lens of
    Receptive Field Analysis", §5), as :class:`relpos.schemes.Sandwich`: the logit of query ``i``
    and key ``j`` gets

        ``b_h(Δ) = (Σ_{k=1}^{d̄/2} cos(Δ / base^{2k/d̄}) - d̄/2) / (8h/H)``, ``Δ = p_j - p_i``,

    for head ``h = 1..H``: the inner product of two sinusoidal embeddings of width ``d̄``
    (``dim``), shifted to 0 at distance 0 and compressed per head (ALiBi's ratios). No weights;
    even in ``Δ``, so the same for causal and bidirectional attention. Evaluated once per
    distance of the window (:class:`DistanceBiasScheme`) by :func:`~relpos.keras.ops.
    sandwich_bias`, whose cosines are summed in float64 where the backend has it
    (:func:`~relpos.keras.positions.accumulation_dtype`: TensorFlow, PyTorch, JAX with
    ``jax_enable_x64``), as the PyTorch function always does.
    """

    scheme_name = "sandwich"

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.scales = tuple(sandwich_head_scales(self.num_heads).tolist())  # 8h/H, exact

    def distance_bias(self, distance):
        c, dtype = self.config, accumulation_dtype()
        scales = ops.convert_to_tensor(self.scales, dtype=dtype)
        return sandwich_bias(distance, scales, dim=c.dim, base=c.base, dtype=dtype)


@_register
class TransformerXLScheme(AttentionScheme):
    """Transformer-XL (Dai et al., 2019, §3.3): logits
    ``(q_i·k_j + q_i·W_R R_δ + u·k_j + v·W_R R_δ) / √d``, ``δ = clip(p_i - p_j)`` at
    ``max_distance``, ``R`` the sinusoidal encoding (halves ``[sin, cos]``, width ``h·d``),
    ``W_R`` a float32 weight ``position_kernel (h·d, h, d)`` (``nn.Linear``'s initialisation),
    ``u``, ``v`` float32 ``content_bias``, ``position_bias`` ``(h, d)`` starting at 0.

    ``rotate`` adds ``u`` to the queries (the content logits then carry ``u·k``);
    ``score_bias`` is ``(q - u + v)·(W_R R)ᵀ/√d`` over the table's rows (``max_distance + 1``
    causal, ``2·max_distance + 1`` otherwise; in self-attention only the rows the length can
    reach), gathered by each pair's clipped distance through a ``(b, h, i, j)`` int32 index: two
    ``(b, h, i, j)`` tensors beside the logits, never an ``(i, j, d)`` one.
    """

    scheme_name = "transformer_xl"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        # R_{p_i - p_j}: the PyTorch scheme's table, from the same spec (even width: checked)
        width = self.num_heads * self.head_dim
        self.encodings = config.encodings(width, causal=self.causal)

    def build(self, input_shape=None) -> None:
        h, d = self.num_heads, self.head_dim
        bound = (h * d) ** -0.5
        self.position_kernel = self.add_weight(
            name="position_kernel",
            shape=(h * d, h, d),
            initializer=keras.initializers.RandomUniform(-bound, bound),
            dtype="float32",
        )
        for name in ("content_bias", "position_bias"):
            weight = self.add_weight(name=name, shape=(h, d), initializer="zeros", dtype="float32")
            setattr(self, name, weight)
        self.built = True

    def rotate(self, q, k, q_positions, k_positions):
        return q + ops.cast(self.content_bias, q.dtype), k

    def score_bias(self, q, q_positions, k_positions):
        m = self.config.max_distance
        distance = relative_distance(q_positions.pos, k_positions.pos)
        index = ops.clip(distance, -m, 0 if self.causal else m) + m
        rows = self.encodings
        n = k_positions.pos.shape[1]
        if q_positions is k_positions and n is not None and n - 1 < m:
            # Self-attention: |distance| <= n - 1, so only rows M-(n-1) .. M(+n-1) are read.
            lo, hi = m - (n - 1), m + (0 if self.causal else n - 1)
            rows, index = rows[lo : hi + 1], ops.clip(index, lo, hi) - lo
        kernel = ops.cast(self.position_kernel, "float32")
        keys = ops.einsum("rw,whd->hrd", ops.convert_to_tensor(rows), kernel)
        shift = ops.cast(self.position_bias, "float32") - ops.cast(self.content_bias, "float32")
        rel = ops.einsum("bihd,hrd->bhir", ops.cast(q, "float32") + shift, keys)
        return gather_relative(rel / math.sqrt(self.head_dim), index)


@_register
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


@_register
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


@_register
class ForgetGateScheme(AttentionScheme):
    """The Forgetting Transformer's forget gate (Lin et al., 2025), as
    :class:`relpos.schemes.ForgetGate`: a scalar gate per head and token ``f_t = σ(w_h·x_t +
    b_h)`` from the attention layer's input, and logits ``q_i·k_j/√d + c_i - c_j`` with ``c_t =
    Σ log f_l`` over the real tokens ``l`` of ``t``'s own document up to ``t``.

    Weights: ``gate_kernel (D, h)`` (``N(0, 0.02²)``), ``gate_bias (h,)`` (0), float32; ``D`` is
    the layer input's width. ``token_log_decay`` is ``log σ`` in float32; the attention layer
    sums it per document (:func:`~relpos.keras.positions.with_log_decay`; with a cache, a running
    sum over the cache's slots of the per-token values it stores beside the keys and values) in
    float64 where the backend has it (TensorFlow, PyTorch, JAX with ``jax_enable_x64``; else
    float32, whose ``c`` loses absolute precision as it grows: ``10^-3`` at ``|c| = 10^4``), and
    ``score_bias`` is ``c_i - c_j`` in that dtype, cast to float32: one ``(b, h, i, j)`` bias.

    **Causal only** (``causal=False`` raises) and **self-attention only** (the gates are the
    layer's own tokens'). Its cache is a pair (see
    :meth:`~relpos.keras.RelativeMultiHeadAttention.empty_cache`).
    """

    scheme_name = "forgetting"
    adds_terms = True
    contextual = True

    def build(self, input_shape=None) -> None:
        if input_shape is None:
            raise ValueError("the forget gate's kernel needs the layer input's shape (b, n, D)")
        width = int(input_shape[-1])
        self.gate_kernel = self.add_weight(
            name="gate_kernel",
            shape=(width, self.num_heads),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype="float32",
        )
        self.gate_bias = self.add_weight(
            name="gate_bias", shape=(self.num_heads,), initializer="zeros", dtype="float32"
        )
        self.built = True

    def token_log_decay(self, x):
        logits = ops.matmul(ops.cast(x, "float32"), ops.cast(self.gate_kernel, "float32"))
        return ops.log_sigmoid(logits + ops.cast(self.gate_bias, "float32"))

    def score_bias(self, q, q_positions, k_positions):
        for name, p in (("q_positions", q_positions), ("k_positions", k_positions)):
            if p.log_decay is None:
                raise ValueError(
                    f"{type(self).__name__} needs {name} with a log_decay (set from the layer "
                    "input by RelativeMultiHeadAttention)"
                )
        cq = ops.expand_dims(q_positions.log_decay, 2)  # (b, i, 1, h)
        ck = ops.expand_dims(k_positions.log_decay, 1)  # (b, 1, j, h)
        return ops.transpose(ops.cast(cq - ck, "float32"), (0, 3, 1, 2))


@_register
class FireScheme(AttentionScheme):
    """FIRE (Li et al., ICLR 2024, "Functional Interpolation for Relative Positions Improves Long
    Context Transformers", §3), as :class:`relpos.schemes.Fire`: head ``h`` adds to the logit of
    query ``i`` and key ``j``

        ``f_θ(ψ(p_i - p_j) / (ψ(max(L, p_i)) + ε))_h``,  ``ψ(x) = log(|c|·x + 1)``,

    with ``f_θ`` = ``Dense(hidden)``, ReLU, ``Dense(h)``, ``L = |s|·init_threshold`` and ``ε =
    1e-6`` (the paper's reference code). Keys after the query (``p_j > p_i``, masked anyway) read
    distance 0. ``p`` are the tokens' positions in their own sequences (padding, packed
    documents, the cache's slots), so each sequence gets the bias it has alone.

    Weights (float32, named after the PyTorch state dict's ``mlp.0``, ``mlp.2``, ``c``,
    ``threshold_scale``): ``mlp_0_kernel (1, hidden)``, ``mlp_0_bias (hidden,)``,
    ``mlp_2_kernel (hidden, h)``, ``mlp_2_bias (h,)`` (``nn.Linear``'s initialisation), ``c``
    (scalar, ``init_c``), ``threshold_scale`` (scalar, 1). With ``heads``, the output layer's
    columns of the heads left out are zeroed at use (exact 0 bias, no gradient), as in PyTorch.

    The bias depends on the query's position as well as the distance, so it is evaluated per
    pair: ``score_bias`` builds the ``(b, i, j)`` inputs and the ``(b, h, i, j)`` bias, float32,
    reading the MLP as a piecewise-linear function (:func:`~relpos.keras.ops.fire_mlp`, as the
    PyTorch side does), so no ``(b, i, j, hidden)`` tensor is made. The output bias adds one
    constant per head to every key of a query, which softmax ignores: it gets no gradient, as in
    PyTorch. **Causal only** (``causal=False``
    raises).
    """

    scheme_name = "fire"
    adds_terms = True

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.bias_heads = _bias_heads(config, self.num_heads)  # None: every head

    def build(self, input_shape=None) -> None:
        c = self.config
        for index, (fan_in, fan_out) in ((0, (1, c.hidden)), (2, (c.hidden, self.num_heads))):
            bound = fan_in**-0.5  # nn.Linear's U(±1/√fan_in), kernel and bias
            for part, shape in (("kernel", (fan_in, fan_out)), ("bias", (fan_out,))):
                # A fresh initializer per weight: one instance draws the same values twice.
                init = keras.initializers.RandomUniform(-bound, bound)
                name = f"mlp_{index}_{part}"
                weight = self.add_weight(name=name, shape=shape, initializer=init, dtype="float32")
                setattr(self, name, weight)
        for name, value in (("c", float(c.init_c)), ("threshold_scale", 1.0)):
            init = keras.initializers.Constant(value)
            weight = self.add_weight(name=name, shape=(), initializer=init, dtype="float32")
            setattr(self, name, weight)
        self.built = True

    def score_bias(self, q, q_positions, k_positions):
        f32 = lambda w: ops.cast(w, "float32")  # noqa: E731
        c = ops.abs(f32(self.c))
        threshold = ops.abs(f32(self.threshold_scale) * self.config.init_threshold)
        pi, pj = f32(q_positions.pos), f32(k_positions.pos)  # (bb, i), (bb, j)
        delta = ops.maximum(ops.expand_dims(pi, 2) - ops.expand_dims(pj, 1), 0.0)  # (bb, i, j)
        norm = ops.log1p(c * ops.maximum(pi, threshold)) + FIRE_EPS  # (bb, i)
        x = ops.log1p(c * delta) / ops.expand_dims(norm, 2)
        # heads left out: zero output columns
        kernel = _zero_left_out(f32(self.mlp_2_kernel), self.bias_heads, axis=1)
        bias = _zero_left_out(f32(self.mlp_2_bias), self.bias_heads, axis=0)
        w1, b1 = f32(self.mlp_0_kernel)[0], f32(self.mlp_0_bias)
        out = fire_mlp(x, w1, b1, kernel, bias)  # (bb, i, j, h)
        return ops.transpose(out, (0, 3, 1, 2))


def scheme_config(spec: str | dict[str, Any] | SchemeConfig | None) -> SchemeConfig:
    """:func:`relpos.schemes.scheme_config`, with the Keras schemes listed for an unknown name."""
    if isinstance(spec, str) and spec not in CONFIGS:
        raise ValueError(
            f"unknown scheme {spec!r}; Keras attention schemes: {sorted(KERAS_SCHEMES)}"
        )
    return shared_scheme_config(spec)


def make_attention_scheme(
    spec: str | dict[str, Any] | SchemeConfig | None,
    *,
    num_heads: int,
    head_dim: int,
    causal: bool,
    name: str = "position_scheme",
    dtype=None,
) -> AttentionScheme:
    """Build the Keras scheme for ``spec``; absolute schemes are refused with where they go.

    Checked in :func:`relpos.make_scheme`'s order (``causal``, the config, then the config against
    the geometry), so a bad spec gets the PyTorch side's message."""
    check_causal(causal)
    config = scheme_config(spec)
    if config.name not in KERAS_SCHEMES:
        if config.name in ABSOLUTE_SCHEMES:
            raise ValueError(
                f"scheme {config.name!r} is absolute: it acts at the input, not in attention; "
                "use relpos.keras.TokenAndPositionEmbedding (or PositionEmbedding / "
                "SinePositionEncoding) and scheme='nope' here"
            )
        raise ValueError(
            f"scheme {config.name!r} has no Keras layer yet; Keras attention schemes: "
            f"{sorted(KERAS_SCHEMES)}"
        )
    return KERAS_SCHEMES[config.name](
        config, num_heads=num_heads, head_dim=head_dim, causal=causal, name=name, dtype=dtype
    )
