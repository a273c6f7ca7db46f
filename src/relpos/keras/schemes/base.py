"""The Keras schemes' base: the registry, the :class:`AttentionScheme` contract, the
:class:`DistanceBiasScheme` family and :func:`make_attention_scheme`."""

from __future__ import annotations

from typing import Any, ClassVar

import keras
from keras import ops

from ...spec import CONFIGS, SchemeConfig, config_from_dict
from ...spec import scheme_config as shared_scheme_config
from ...spec.base import ABSOLUTE_SCHEMES, check_causal, check_registrable, head_mask
from ..ops import gather_relative, relative_distance
from ..positions import Positions, distance_range, holds_values, sequence_length

__all__ = [
    "KERAS_SCHEMES",
    "AttentionScheme",
    "DistanceBiasScheme",
    "bias_heads",
    "make_attention_scheme",
    "register",
    "scheme_config",
    "zero_left_out",
]


#: Keras attention schemes by name (the names of :data:`relpos.SCHEMES` that act in attention).
KERAS_SCHEMES: dict[str, type[AttentionScheme]] = {}


def register(cls):
    """Class decorator: register a Keras scheme under its ``scheme_name`` (once: a second class
    of the same name is refused, as the PyTorch registry does)."""
    name = cls.scheme_name
    owner = f"{cls.__name__}.scheme_name"
    check_registrable(KERAS_SCHEMES, name, cls, kind="Keras scheme name", owner=owner)
    KERAS_SCHEMES[name] = cls
    return cls


def bias_heads(config: SchemeConfig, num_heads: int) -> tuple[bool, ...] | None:
    """The config's ``heads`` as one flag per head (True: gets the bias), or None for all."""
    mask = head_mask(getattr(config, "heads", None), num_heads)
    return None if mask is None else tuple(bool(x) for x in mask)


def zero_left_out(values, bias_heads: tuple[bool, ...] | None, *, axis: int):
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
        self.bias_heads = bias_heads(config, self.num_heads)  # None: every head

    def distance_bias(self, distance):
        """The bias of each distance for each head: float32 ``(h, N)`` for int32 ``(N,)``."""
        raise NotImplementedError

    def _bias_of(self, distance):
        """``distance (bb, ...)`` → float32 ``(bb, h, ...)``, 0 for the heads left out."""
        shape = ops.shape(distance)
        values = self.distance_bias(ops.reshape(distance, (-1,)))  # (h, N)
        values = zero_left_out(values, self.bias_heads, axis=0)
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
