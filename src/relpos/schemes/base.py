"""The scheme contract: a frozen config, a thin module, six optional hooks, one registry.

A scheme contributes to a transformer through at most six hooks (every default does nothing):

===========================  =================================================================
hook                         contract
===========================  =================================================================
``embed(positions)``         ``(b|1, n, d_model)`` encoding the caller adds to token embeddings
``rotate(q, k, qp, kp)``     rotated ``(q, k)``, applied before keys enter the KV cache (after,
                             to every key, when ``rotates_cached_keys``)
``score_bias(q, qp, kp)``    float32 ``(b|1, h|1, i, j)`` added to the *scaled* logits
                             ``q·k/√d``
``key_bias(q, k, qp, kp)``   float32 ``(b, h, i, j)`` added to the scaled logits, reading the
                             keys' content too: ``k`` as attention sees it (rotated, cached keys
                             included, key/value heads repeated to ``h``); DeBERTa's
                             position-to-content term, CoPE's gates
``value_term(p, qp, kp)``    float32 ``(b, h, i, d)`` added to the attention output ``p·v``
``contextualize(x, p, c)``   the :class:`~relpos.Positions` ``p`` of ``x``'s tokens with values
                             computed from the layer's input ``x (b, n, d_model)`` (a
                             *contextual position*: ``log_decay``), continuing the KV cache's
                             positions ``c``; called by self-attention before ``rotate``; the
                             Forgetting Transformer's gates
===========================  =================================================================

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``n`` tokens.
``qp``/``kp`` are the :class:`~relpos.Positions` of queries and keys; every hook reads positions
from them and never from array indices.

Two declared refinements tell the fast backends what else a scheme offers:

* :class:`RelativeScheme` — the logit and value terms are functions of a *relative row* per pair
  (a clipped distance or a bucket): ``num_relative``, ``relative_index``, ``relative_logits``,
  ``relative_keys``, ``relative_value``, ``relative_key_logits`` (a key-content term per key and
  row, gathered with the transposed index: DeBERTa's p2c) and the class flag
  ``query_independent``. ``chunked`` and ``flex`` gather those rows themselves and never build
  ``(i, j)``.
* :class:`LinearBiasScheme` — the logit term is ``slope_h·(p_j - p_i)`` (causal) or
  ``-slope_h·|p_j - p_i|`` (bidirectional) with fixed per-head ``slopes``: ALiBi.
* :class:`DistanceBiasScheme` — the logit term is any per-head function of the signed distance
  (KERPLE), evaluated once per distinct distance and gathered; the class flag ``linear`` with
  ``linear_slopes`` declares ALiBi's form with trained slopes (``chunked`` then runs ALiBi's
  fused parts and returns the slopes' gradient), and ``closed_form`` with ``distance_form`` a
  formula of one or two parameters per head (ALiBi's line, KERPLE's kernels) that ``fused``
  evaluates per pair instead of reading a table.
* :class:`PairBiasScheme` — the logit term has a per-pair kernel that also reduces its own
  gradient (:class:`~relpos.functional.pair_bias.PairBias`; FIRE): ``chunked`` adds it tile by
  tile and differentiates it once per call instead of once per tile.
* :class:`DecayBiasScheme` — the logit term is ``c_i,h - c_j,h``, the difference of the tokens'
  cumulative log decay (``Positions.log_decay``, set by ``contextualize`` from per-token gates):
  the Forgetting Transformer. Causal only; ``flex`` reads the per-token values in a
  ``score_mod``.

A scheme that makes sense only for causal attention says so with the class flag ``causal_only``
(building it with ``causal=False`` raises a ``ValueError``).
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from ..functional.alibi import alibi_bias
from ..functional.distance_form import DistanceForm, linear_form
from ..functional.dtypes import compute_dtype
from ..functional.pair_bias import PairBias
from ..functional.relative import table_rows
from ..functional.skew import gather_relative, scatter_relative
from ..positions import Positions, distance_range, promised_distance_range
from ..spec.base import (
    SchemeConfig,
    check_causal,
    check_causal_only,
    check_heads,
    check_int,
    check_positive_float,
    check_registrable,
    config_class,
    config_from_dict,
    register_config,
    scheme_config,
)
from .heads import head_selection, select_heads

__all__ = [
    "LOGIT_HOOKS",
    "PAIRWISE_QUERIES",
    "SCHEMES",
    "DecayBiasScheme",
    "DistanceBiasScheme",
    "DistanceClip",
    "LinearBiasScheme",
    "PairBiasScheme",
    "RelativeScheme",
    "Scheme",
    "SchemeConfig",
    "check_heads",
    "check_int",
    "check_positive_float",
    "config_from_dict",
    "make_scheme",
    "register",
    "scheme_config",
]

#: Registered scheme modules by name.
SCHEMES: dict[str, type[Scheme]] = {}

#: The hooks that add a term to the logits: a scheme with either needs a biased kernel.
LOGIT_HOOKS = frozenset({"score_bias", "key_bias"})


class Scheme(nn.Module):
    """A positional scheme: parameters and caches, hooks that call the functional core."""

    config_class: ClassVar[type[SchemeConfig]] = SchemeConfig
    #: The hooks this scheme implements, for backends and docs.
    hooks: ClassVar[frozenset[str]] = frozenset()
    #: Whether a key's rotation depends on the other keys (e.g. on its sequence's current length:
    #: dynamic NTK, LongRoPE). Then keys enter the KV cache unrotated and ``rotate`` receives every
    #: key, cached ones included, at every call. Set per instance by the scheme.
    rotates_cached_keys: bool = False
    #: Whether the scheme exists only for causal attention (``causal=False`` is refused); true
    #: for every scheme whose config declares it.
    causal_only: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.config_class.causal_only:
            cls.causal_only = True

    def __init__(
        self, config: SchemeConfig | None = None, *, d_model: int, num_heads: int, causal: bool
    ) -> None:
        super().__init__()
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, "
                f"got {type(config).__name__}"
            )
        check_heads(d_model, num_heads)
        # Every check of the config against this geometry, shared with the Keras schemes.
        config.check_dims(num_heads=num_heads, head_dim=d_model // num_heads, causal=causal)
        # nn.Module is no ABC, so the contract's abstract members are enforced here.
        missing = sorted(
            name
            for name in dir(type(self))
            if getattr(getattr(type(self), name, None), "__isabstractmethod__", False)
        )
        if missing:
            raise TypeError(
                f"{type(self).__name__} does not implement the abstract member(s) {missing}"
            )
        self.config = config
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.causal = bool(causal)
        if self.causal_only:  # a contract flag (DecayBiasScheme's) besides the config's
            check_causal_only(config.name, self.causal)

    # ---------------------------------------------------------------- hooks (defaults: no-ops)
    def embed(self, positions: Positions) -> Tensor | None:
        """Absolute encoding ``(b|1, n, d_model)`` to add to token embeddings, or None."""
        return None

    def contextualize(
        self, x: Tensor, positions: Positions, cached: Positions | None = None
    ) -> Positions:
        """The positions of ``x``'s tokens with per-token values computed from ``x`` (the layer's
        input, ``(b, n, d_model)``), continuing ``cached`` (the KV cache's positions, or None).

        Self-attention calls it before :meth:`rotate` when ``"contextualize"`` is in
        :attr:`hooks`; what it returns goes to every other hook, the backends and the cache.
        Default: the positions unchanged."""
        return positions

    def rotate(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> tuple[Tensor, Tensor]:
        """Rotate ``q (b, h, i, d)`` and keys ``k (b, h, j, d)`` by their positions: the new keys,
        or every key when :attr:`rotates_cached_keys`."""
        return q, k

    def score_bias(
        self, q: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        """Float32 term ``(b|1, h|1, i, j)`` added to the scaled logits, or None."""
        return None

    def key_bias(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        """Float32 term ``(b, h, i, j)`` added to the scaled logits that reads the keys' content,
        or None.

        ``q`` and ``k`` are what the kernel multiplies (after :meth:`rotate`; every key of the
        call, cached ones included, with key/value heads repeated to ``h``), and the term may
        depend on all of them (a cumulative gate over keys, as CoPE's). ``eager`` and ``sdpa`` add
        it as it is; ``chunked`` and ``flex`` run it only in a declared form
        (:meth:`RelativeScheme.relative_key_logits`).
        """
        return None

    def value_term(
        self, probs: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        """Float32 term ``(b, h, i, d)`` added to the attention output, or None."""
        return None

    # ---------------------------------------------------------------- config round trip
    def get_config(self) -> dict[str, Any]:
        return self.config.to_dict()

    def extra_repr(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.config).items())
        return (
            f"{fields}, num_heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}"
        )


class DistanceClip(NamedTuple):
    """Where a :class:`RelativeScheme`'s rows stop changing with the distance ``δ = p_j - p_i``:
    every ``δ < lo`` reads ``lo``'s row and every ``δ > hi`` reads ``hi``'s. With ``shifted``,
    the row of ``δ`` in ``[lo, hi]`` is ``δ - lo`` itself (a clipped distance: Shaw's, the Music
    Transformer's, Transformer-XL's), so a kernel computes it instead of looking it up."""

    lo: int
    hi: int
    shifted: bool = False

    def rows(self, distance: Tensor) -> Tensor:
        """The rows of a ``shifted`` clip: each distance clamped to ``[lo, hi]``, minus ``lo``."""
        return distance.clamp(self.lo, self.hi) - self.lo


class RelativeScheme(Scheme):
    """A scheme whose terms depend on each pair only through its *relative row* ``r`` in
    ``[0, R)`` (a clipped distance, a bucket): the contract of the fast backends.

    Subclasses implement :attr:`num_relative` and :meth:`relative_index`, and the forms their
    terms take: :meth:`relative_logits` for a logit term, :meth:`relative_keys` when that term is
    ``q·Eᵀ``, :meth:`relative_value` for a value term. Defaults: no such term (``None``). The
    hooks follow from them (a scheme may override them with a faster equal form):

    * ``score_bias = gather_relative(relative_logits(q), relative_index(qp, kp))``;
    * ``key_bias[.., i, j] = relative_key_logits(k)[.., j, relative_index(qp, kp)[i, j]]``: a term
      read from key ``j``'s content at the pair's row (the transposed gather);
    * ``value_term = relative_value(mass)``, ``mass[b, h, i, r] = Σ_j p[b, h, i, j]·[index = r]``
      (:func:`~relpos.functional.scatter_relative`).

    A subclass that lists ``key_bias`` in its hooks must keep that form (it may override
    ``key_bias`` only with an equal, faster one): ``chunked`` and ``flex`` compute the term from
    ``relative_key_logits`` themselves.

    ``relative_index`` must depend on the positions, the config and ``causal`` only (backends
    cache geometry derived from it per config).
    """

    #: Whether :meth:`relative_logits` is the same for every query, shape ``(1|b, h, 1, R)``
    #: (T5); declared per class so backends never probe it at call time.
    query_independent: ClassVar[bool] = False

    @property
    @abstractmethod
    def num_relative(self) -> int:
        """``R``, the number of relative rows."""

    @abstractmethod
    def relative_index(self, q_positions: Positions, k_positions: Positions) -> Tensor:
        """Relative row of every pair, ``(b|1, i, j)`` int64 in ``[0, R)``."""

    @property
    def distance_clip(self) -> DistanceClip | None:
        """The distances past which the rows repeat (:class:`DistanceClip`), or None where not
        declared. The ``fused`` kernel then keeps a table of at most ``hi - lo + 1`` distances
        (it clamps the rest to the ends), and with ``shifted`` reads no table at all."""
        return None

    def rows_by_distance(
        self, lo: int, hi: int, device: torch.device | str | None = None
    ) -> Tensor:
        """The relative row of each distance ``lo..hi``: ``(hi - lo + 1,)`` int64, the row of
        ``p_j - p_i = δ`` at ``δ - lo`` (the kernels' lookup table from distance to row). A
        function of what the scheme was built from (its class, config, ``d_model``,
        ``num_heads``, ``causal``), never of its weights: the backends keep it between calls."""
        zero = torch.zeros(1, 1, dtype=torch.long, device=device)
        dist = torch.arange(lo, hi + 1, device=device).view(1, -1)
        keys = Positions(dist, torch.zeros_like(dist))
        return self.relative_index(Positions(zero, zero), keys)[0, 0]

    def relative_logits(self, q: Tensor) -> Tensor | None:
        """Logit term per query and row, float32 ``(b, h, i, R)`` (``(1|b, h, 1, R)`` when
        :attr:`query_independent`), or None without a logit term."""
        keys = self.relative_keys(q.dtype)
        if keys is None:
            return None
        logits = torch.matmul(q.to(keys.dtype), keys.transpose(-1, -2))
        row_bias = self.relative_row_bias(keys)
        return logits if row_bias is None else logits + row_bias.unsqueeze(-2)

    def relative_keys(self, dtype: torch.dtype = torch.float32) -> Tensor | None:
        """``E`` of shape ``(h|1, R, d)`` in ``dtype``'s compute dtype, already scaled, with
        ``relative_logits(q) = q·Eᵀ`` (plus :meth:`relative_row_bias`); None when the logit term
        is not of that form."""
        return None

    def relative_keys_at(
        self, rows: slice | Tensor | list[int], dtype: torch.dtype = torch.float32
    ) -> Tensor | None:
        """``relative_keys(dtype)[..., rows, :]``: the keys of some rows only (a scheme whose keys
        cost a product per row, Transformer-XL's, computes just those)."""
        keys = self.relative_keys(dtype)
        return None if keys is None else table_rows(keys, rows, -2)

    def relative_row_bias(self, keys: Tensor) -> Tensor | None:
        """``c (h|1, r)``, a constant per head and row added to ``q·Eᵀ`` (Transformer-XL's global
        position bias), for the rows whose keys ``(h|1, r, d)`` are given (all of
        ``relative_keys()``, or those of ``relative_keys_at``): row by row; None (the default)
        for none."""
        return None

    def relative_value(self, mass: Tensor) -> Tensor | None:
        """Value term ``(b, h, i, d)`` from the attention mass per row ``(b, h, i, R)``, or None."""
        return None

    def relative_key_logits(self, k: Tensor) -> Tensor | None:
        """Logit term per key and row, float32 ``(b, h, j, R)``, read by every query at its pair's
        row (``key_bias``); None without a key term (the default)."""
        return None

    @property
    def has_relative_keys(self) -> bool:
        """Whether the logit term is ``q·relative_keys()ᵀ`` (plus ``relative_row_bias``)."""
        return self.relative_keys() is not None

    def score_bias(
        self, q: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        rel = self.relative_logits(q)
        if rel is None:
            return None
        return gather_relative(rel, self.relative_index(q_positions, k_positions))

    def key_bias(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        rel = self.relative_key_logits(k)
        if rel is None:
            return None
        index = self.relative_index(q_positions, k_positions).transpose(-1, -2)  # (b|1, j, i)
        return gather_relative(rel, index).transpose(-1, -2)

    def value_term(
        self, probs: Tensor, q_positions: Positions, k_positions: Positions
    ) -> Tensor | None:
        if "value_term" not in self.hooks:
            return None
        dtype = compute_dtype(probs.dtype)
        index = self.relative_index(q_positions, k_positions)
        mass = probs.new_zeros(*probs.shape[:-1], self.num_relative, dtype=dtype)
        scatter_relative(mass, index, probs.to(dtype))
        return self.relative_value(mass)


#: The most queries for which a bias that is a function of the distance (or, for FIRE, of the
#: pair's positions) is evaluated at each pair where a table over the call's distances would
#: first read the positions' values from the device (a sync, which stalls the host until the
#: GPU drains): decoding's one token, or a few. Its ``i·j`` evaluations then cost no more than
#: a table of the ``i + j`` distances.
PAIRWISE_QUERIES = 4


class DistanceBiasScheme(Scheme):
    """A scheme whose logit term is a per-head function of the signed distance only,
    ``f_h(p_j - p_i)`` (KERPLE; the distance-function biases).

    Subclasses implement :meth:`distance_bias`. ``score_bias`` evaluates it once per distance the
    call can see (``D <= max(p) - min(p)`` over queries and keys, so ``O(h·D)`` work, never
    ``O(h·i·j)`` evaluations of the function) and gathers the table by each pair's distance.
    Where the positions promise that range (self-attention: :attr:`Positions.span`) it costs
    nothing; queries and keys of two ``Positions`` (a KV cache) promise none, and reading it
    would cost a device sync per call, so there the function is evaluated at each pair's
    distance instead: always for a :attr:`closed_form` (a few ops per pair, as the gather), and
    for up to :data:`PAIRWISE_QUERIES` queries. A config field ``heads`` (head indices, or None
    for all) zeroes the bias of the heads left out.
    """

    hooks: ClassVar[frozenset[str]] = frozenset({"score_bias"})
    #: Whether ``distance_bias`` is ALiBi's ``slope_h·δ`` (causal) / ``-slope_h·|δ|``
    #: (bidirectional) with the slopes of :meth:`linear_slopes`; declared per class.
    linear: ClassVar[bool] = False
    #: Whether :meth:`distance_form` gives the bias in closed form (every :attr:`linear` scheme,
    #: KERPLE); declared per class, checked by the conformance tests.
    closed_form: ClassVar[bool] = False

    def __init__(self, config: SchemeConfig | None = None, **dims: Any) -> None:
        super().__init__(config, **dims)
        # Per-head control: the config's ``heads`` (None: every head gets the bias).
        selection = head_selection(getattr(self.config, "heads", None), self.num_heads)
        self.register_buffer("bias_heads", selection, persistent=False)

    @abstractmethod
    def distance_bias(self, distance: Tensor) -> Tensor:
        """The bias of each distance for each head: ``(h, D)`` float32 for ``(D,)`` int64."""

    def linear_slopes(self) -> Tensor:
        """The ``(h,)`` slopes in use, float32 or wider, with their graph to the parameters
        (heads left out of ``heads`` get 0); only for a :attr:`linear` scheme."""
        raise NotImplementedError(f"{type(self).__name__} is not a linear bias (linear=False)")

    def distance_form(self) -> DistanceForm | None:
        """The bias in closed form, which a kernel evaluates per pair (``fused``: no table, and
        the parameters' gradient summed with no atomic adds), or None where it is a table only.
        A :attr:`linear` scheme's is ALiBi's line with :meth:`linear_slopes`; others declare
        theirs by overriding this (KERPLE). It must equal :meth:`distance_bias` with the
        heads left out of ``heads`` at 0."""
        if self.linear:
            return linear_form(self.linear_slopes(), causal=self.causal)
        return None

    def distance_table(self, q_positions: Positions, k_positions: Positions) -> tuple[int, Tensor]:
        """``(lo, table)``: the bias of distance ``δ`` for head ``h`` is ``table[h, δ - lo]``, for
        every distance between real tokens of these queries and keys (a pair with padding may
        fall outside: clamp its index); ``table`` is ``(h, D)`` float32."""
        lo, hi = distance_range(q_positions, k_positions)
        return lo, self._bias_of(torch.arange(lo, hi + 1, device=q_positions.device))

    def _bias_of(self, distance: Tensor) -> Tensor:
        """:meth:`distance_bias` of ``distance`` ``(D,)`` with the heads left out of ``heads`` at
        0, in its compute dtype: ``(h, D)``."""
        values = select_heads(self.distance_bias(distance), self.bias_heads)
        return values.to(compute_dtype(values.dtype))

    def score_bias(self, q: Tensor, q_positions: Positions, k_positions: Positions) -> Tensor:
        dist = q_positions.distance(k_positions)  # (b|1, i, j)
        if dist.numel() == 0:
            shape = (dist.shape[0], self.num_heads, *dist.shape[1:])
            return dist.new_zeros(shape, dtype=torch.float32)
        if promised_distance_range(q_positions, k_positions) is None and (
            self.closed_form or len(q_positions) <= PAIRWISE_QUERIES
        ):
            return self.pairwise_bias(dist)
        lo, table = self.distance_table(q_positions, k_positions)
        index = (dist - lo).clamp_(0, table.shape[-1] - 1)  # pairs with padding: masked
        return gather_relative(table.unsqueeze(0).unsqueeze(2), index)

    def pairwise_bias(self, dist: Tensor) -> Tensor:
        """The bias evaluated at each pair's distance, with no range read: ``(b|1, h, i, j)``
        for ``dist`` ``(b|1, i, j)`` (``score_bias``'s numbers, as its table gives them)."""
        values = self._bias_of(dist.reshape(-1))  # (h, N)
        return values.reshape(self.num_heads, *dist.shape).movedim(0, 1)


class PairBiasScheme(Scheme):
    """A scheme whose logit term is evaluated per pair by a kernel that reduces its own gradient
    (FIRE: the bias depends on the query's position as well as the distance).

    Subclasses implement ``score_bias`` (every backend's form) and :meth:`pair_bias` (the same
    numbers as a :class:`~relpos.functional.pair_bias.PairBias`, which ``chunked``'s tiles use).
    """

    hooks: ClassVar[frozenset[str]] = frozenset({"score_bias"})

    @abstractmethod
    def pair_bias(
        self, q: Tensor, q_positions: Positions, k_positions: Positions
    ) -> PairBias | None:
        """The bias of these queries and keys for logits in ``q``'s compute dtype, or None where
        no kernel runs (another dtype or device; ``score_bias`` is used instead)."""


class LinearBiasScheme(Scheme):
    """A fixed linear bias on distance per head (ALiBi, Press et al., 2022):
    ``slope_h·(p_j - p_i)`` when causal, ``-slope_h·|p_j - p_i|`` when bidirectional.

    Subclasses provide ``slopes``, a float32 ``(h,)`` tensor without gradient; ``chunked`` splits
    such a bias into per-key rows plus per-query constants and runs the stock fused kernel.
    """

    slopes: Tensor
    hooks: ClassVar[frozenset[str]] = frozenset({"score_bias"})

    def linear_slopes(self) -> Tensor:
        """The ``(h,)`` slopes (no gradient), as a linear :class:`DistanceBiasScheme` gives
        its trained ones."""
        return self.slopes

    def distance_form(self) -> DistanceForm:
        """The line as a :class:`~relpos.functional.distance_form.DistanceForm` (what a
        kernel evaluates per pair)."""
        return linear_form(self.slopes, causal=self.causal)

    def score_bias(self, q: Tensor, q_positions: Positions, k_positions: Positions) -> Tensor:
        return alibi_bias(self.slopes, q_positions.distance(k_positions), causal=self.causal)


class DecayBiasScheme(Scheme):
    """A causal logit term from per-token decays: ``D_ij,h = Σ_{l=j+1}^{i} log f_l,h`` over the
    tokens between key ``j`` and query ``i`` of one sequence, with ``f_l,h`` in ``(0, 1]``
    computed from each token's layer input (the Forgetting Transformer's forget gates, Lin et
    al., 2025).

    Subclasses implement :meth:`token_log_decay`, ``log f`` per token and head. ``contextualize``
    turns it into each token's cumulative sum over its own segment, ``c_t = Σ_{l <= t} log f_l``
    (:meth:`Positions.with_log_decay`: restarting at every document, skipping padding, continuing
    the KV cache's values), and ``score_bias`` is ``c_i - c_j`` (the difference taken in float64).
    Backends see only the positions: ``chunked`` slices them per tile, ``flex`` reads ``c`` per
    query and key in a ``score_mod``; gradients reach the gates through ``log_decay``.
    """

    hooks: ClassVar[frozenset[str]] = frozenset({"contextualize", "score_bias"})
    causal_only: ClassVar[bool] = True

    @abstractmethod
    def token_log_decay(self, x: Tensor) -> Tensor:
        """``log f`` of every token and head, ``(b, n, h)`` float (at least float32), from the
        layer input ``x (b, n, d_model)``."""

    def contextualize(
        self, x: Tensor, positions: Positions, cached: Positions | None = None
    ) -> Positions:
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (b, n, d_model={self.d_model}), got {shape}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating tensor, got dtype {x.dtype}")
        if not isinstance(positions, Positions):
            raise TypeError(f"positions must be a Positions, got {type(positions).__name__}")
        if len(positions) != x.shape[1] or positions.batch not in (1, x.shape[0]):
            raise ValueError(
                f"positions have shape (b, n) = {tuple(positions.pos.shape)}; expected "
                f"({x.shape[0]}, {x.shape[1]}) or (1, {x.shape[1]}) for x of shape "
                f"{tuple(x.shape)}"
            )
        if cached is not None and not isinstance(cached, Positions):
            raise TypeError(f"cached must be a Positions or None, got {type(cached).__name__}")
        return positions.with_log_decay(self.token_log_decay(x), cached=cached)

    def decays(self, q_positions: Positions, k_positions: Positions) -> tuple[Tensor, Tensor]:
        """``(c_q (b|1, h, i), c_k (b|1, h, j))``: the queries' and keys' cumulative log decay
        per head (``log_decay``, transposed); a clear error when ``contextualize`` did not set
        them."""
        for name, p in (("q_positions", q_positions), ("k_positions", k_positions)):
            if p.log_decay is None or p.log_decay.shape[-1] != self.num_heads:
                width = None if p.log_decay is None else p.log_decay.shape[-1]
                raise ValueError(
                    f"{type(self).__name__} needs {name} with a log_decay of {self.num_heads} "
                    f"heads (got {width}), set by contextualize: MultiheadAttention calls it "
                    "with its input"
                )
        return q_positions.log_decay.transpose(1, 2), k_positions.log_decay.transpose(1, 2)

    def score_bias(self, q: Tensor, q_positions: Positions, k_positions: Positions) -> Tensor:
        cq, ck = self.decays(q_positions, k_positions)
        return (cq.unsqueeze(-1) - ck.unsqueeze(-2)).to(compute_dtype(q.dtype))


def register(cls: type[Scheme]) -> type[Scheme]:
    """Class decorator: register a scheme module under its config's name (and the config, when
    it is new, in :data:`relpos.spec.CONFIGS`, so names and dicts build it)."""
    name = cls.config_class.name
    owner = f"{cls.__name__}.config_class"
    check_registrable(SCHEMES, name, cls, kind="scheme name", owner=owner)
    register_config(cls.config_class)
    SCHEMES[name] = cls
    return cls


def _lookup(name: Any) -> type[Scheme]:
    config_class(name)  # a clear error for a wrong type or an unknown name
    if name not in SCHEMES:
        raise ValueError(f"scheme {name!r} has no PyTorch module; registered: {sorted(SCHEMES)}")
    return SCHEMES[name]


def make_scheme(
    spec: str | dict[str, Any] | SchemeConfig | Scheme | None,
    *,
    d_model: int,
    num_heads: int,
    causal: bool,
) -> Scheme:
    """Build a scheme from a name, a config dict, a config, or pass a built module through.

    ``None`` means no positional information (``"nope"``); ``causal`` must be a bool.
    """
    causal = check_causal(causal)
    if isinstance(spec, Scheme):
        if spec.d_model != d_model or spec.num_heads != num_heads:
            raise ValueError(
                f"scheme was built for d_model={spec.d_model}, num_heads={spec.num_heads}; "
                f"the layer has d_model={d_model}, num_heads={num_heads}"
            )
        if spec.causal != causal:
            raise ValueError(f"scheme was built with causal={spec.causal}; the layer has {causal}")
        return spec
    if spec is not None and not isinstance(spec, str | dict | SchemeConfig):
        raise TypeError(
            "scheme must be a name, a config dict, a SchemeConfig or a Scheme, "
            f"got {type(spec).__name__}"
        )
    config = scheme_config(spec)
    return _lookup(config.name)(config, d_model=d_model, num_heads=num_heads, causal=causal)
