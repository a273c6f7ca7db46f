"""The math of every scheme in ``keras.ops``: stateless, backend-agnostic, jit-friendly.

These mirror :mod:`relpos.functional` (same formulas, same papers) so a Keras layer and its
PyTorch module give the same numbers. Angles, biases and logits run in float32.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``n`` tokens, ``d`` head dim,
``R`` rows of a relative table.
"""

from __future__ import annotations

import fractions
import functools
import math
from typing import Any

import keras
import numpy as np
from keras import ops

from ..spec.rope import rope_frequencies as spec_rope_frequencies
from ..spec.rope_scaling import ntk_power

__all__ = [
    "alibi_bias",
    "apply_rope",
    "clipped_relative_index",
    "fire_mlp",
    "gather_relative",
    "kerple_bias",
    "relative_distance",
    "rope_angles",
    "rope_frequencies",
    "sandwich_bias",
    "scatter_relative",
    "sequence_rope_frequencies",
    "sinusoidal_table",
    "t5_buckets",
    "xpos_scale",
]


def relative_distance(q_pos, k_pos):
    """``k_pos - q_pos`` for every pair: ``(b, i)``, ``(b, j)`` → ``(b, i, j)`` int32."""
    return ops.expand_dims(k_pos, 1) - ops.expand_dims(q_pos, 2)


def clipped_relative_index(distance, k: int):
    """Row of a ``2k+1``-row table: ``clip(distance, -k, k) + k`` (Shaw et al., 2018, §3.2)."""
    return ops.clip(distance, -k, k) + k


def sinusoidal_table(pos, dim: int, *, base: float = 10000.0, interleaved: bool = True):
    """``PE[p, 2k] = sin(p·ω_k)``, ``PE[p, 2k+1] = cos(p·ω_k)``, ``ω_k = base^(-2k/dim)``
    (Vaswani et al., 2017, §3.5); ``interleaved=False`` gives ``[sin…, cos…]`` halves.

    Shapes: pos ``(...)`` integers → float32 ``(..., dim)``.
    """
    freqs = ops.power(base, -ops.arange(0, dim, 2, dtype="float32") / dim)
    angles = ops.expand_dims(ops.cast(pos, "float32"), -1) * freqs
    sin, cos = ops.sin(angles), ops.cos(angles)
    if interleaved:
        stacked = ops.stack([sin, cos], axis=-1)
        return ops.reshape(stacked, (*ops.shape(angles)[:-1], dim))
    return ops.concatenate([sin, cos], axis=-1)


def rope_frequencies(rotary_dim: int, theta: float = 10000.0):
    """Inverse frequencies ``theta^(-2k/r)``, float32 ``(r/2,)`` (Su et al., 2021, §3.4): the
    spec's table (:func:`relpos.spec.rope.rope_frequencies`) as a tensor."""
    return ops.convert_to_tensor(spec_rope_frequencies(rotary_dim, theta), dtype="float32")


#: A position splits into three pieces of 11 bits, ``p = p2·2²² + p1·2¹¹ + p0``.
_PIECE_BITS = 11


@functools.lru_cache(maxsize=64)
def _turn_pieces(ladder: tuple[float, ...]) -> np.ndarray:
    """float32 ``(3, 3, r/2)``: entry ``[k, j]`` is the ``j``-th 12-bit piece (at ``2^-12``,
    ``2^-24``, ``2^-36``) of ``frac(2^(11k)·ω/2π)``, computed exactly (rationals) from the float32
    ``ω`` and the float64 ``2π`` (the PyTorch side's modulus)."""
    two_pi = fractions.Fraction(2 * math.pi)
    out = np.zeros((3, 3, len(ladder)), dtype=np.float32)
    for m, w in enumerate(ladder):
        turns = fractions.Fraction(float(np.float32(w))) / two_pi
        for k in range(3):
            rest = (turns * 2 ** (_PIECE_BITS * k)) % 1
            for j in range(3):
                scale = 2 ** (12 * (j + 1))
                piece = fractions.Fraction(math.floor(rest * scale), scale)
                out[k, j, m], rest = float(piece), rest - piece
    return out


def rope_angles(pos, inv_freq):
    """``pos · ω_k`` per token and pair: ``(b, n)`` → float32 ``(b, n, r/2)``.

    ``inv_freq``: host values ``(r/2,)`` (a tuple or numpy array: a fixed ladder), a tensor
    ``(r/2,)`` (learned frequencies), or per token ``(b, n, r/2)`` (length-dependent scalings).

    Integer positions with a fixed ladder give the angle modulo ``2π`` to about ``10⁻⁶`` at any
    int32 position, in float32 alone (JAX has no float64 by default): in turns, each 11-bit piece
    of the position times each 12-bit piece of ``ω/2π`` (exact rationals from the host) is
    exact in float32, and so is its fractional part, so RoPE keeps its relative property at any
    offset (a float32 ``p·ω`` is off by tens of radians at position ``10⁹``). A tensor ``ω`` and
    float positions get the plain float32 product, whose rounding grows with ``p``."""
    integer = not keras.backend.is_float_dtype(keras.backend.standardize_dtype(pos.dtype))
    if not (integer and isinstance(inv_freq, tuple | list | np.ndarray)):
        return ops.expand_dims(ops.cast(pos, "float32"), -1) * ops.cast(inv_freq, "float32")
    pieces = _turn_pieces(tuple(float(w) for w in np.asarray(inv_freq).reshape(-1)))
    pos = ops.cast(pos, "int32")
    step = 2**_PIECE_BITS
    p2 = ops.floor_divide(pos, step * step)
    rest = pos - p2 * (step * step)
    p1 = ops.floor_divide(rest, step)
    parts = [ops.expand_dims(ops.cast(t, "float32"), -1) for t in (rest - p1 * step, p1, p2)]
    turns = None
    for j in range(3):  # the coarsest pieces first: their fractional parts sum exactly
        s = None
        for k, part in enumerate(parts):
            x = part * ops.convert_to_tensor(pieces[k, j])
            x = x - ops.floor(x)
            s = x if s is None else s + x
        turns = s if turns is None else turns + s
        turns = turns - ops.floor(turns)
    return turns * (2 * math.pi)


def sequence_rope_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any], lengths):
    """Per-token inverse frequencies of a length-dependent scaling (``dynamic``, ``longrope``)
    from the length of each token's own sequence: :func:`relpos.functional.
    sequence_rope_frequencies` in float32 ``keras.ops``.

    ``dynamic``: for ``n > L``, ``ω_m = exp(-(2m/r)·(ln θ + r/(r-2)·ln(factor·n/L - factor + 1)))``,
    else ``θ^(-2m/r)``. ``longrope``: ``θ^(-2m/r) / long_factor[m]`` for ``n > L``, else
    ``/ short_factor[m]``. ``L`` is ``original_max_position_embeddings``.

    Args:
        scaling: a dict normalised by :func:`relpos.spec.rope_scaling.check_rope_scaling`.
        lengths: ``(b, n)`` int, the length of each token's sequence
            (:func:`relpos.keras.positions.sequence_lengths`).

    Returns:
        float32 ``(b, n, r/2)``.
    """
    kind = scaling["rope_type"]
    original = scaling["original_max_position_embeddings"]
    n = ops.expand_dims(ops.cast(lengths, "float32"), -1)  # (b, n, 1)
    long = n > original
    ladder = rope_frequencies(rotary_dim, theta)
    if kind == "dynamic":
        factor = scaling["factor"]
        # ln θ' = ln θ + r/(r-2)·ln(factor·n/L - factor + 1), for n > L (the argument is > 1)
        growth = ops.log(factor * ops.maximum(n, float(original)) / original - factor + 1)
        exponent = ops.arange(0, rotary_dim, 2, dtype="float32") / rotary_dim
        scaled = ops.exp(-exponent * (math.log(theta) + ntk_power(rotary_dim) * growth))
        return ops.where(long, scaled, ladder)
    if kind == "longrope":
        short_f = ops.convert_to_tensor(scaling["short_factor"], dtype="float32")
        long_f = ops.convert_to_tensor(scaling["long_factor"], dtype="float32")
        return ladder / ops.where(long, long_f, short_f)
    raise ValueError(f"rope_type {kind!r} does not depend on the sequence length")


def xpos_scale(pos, decay, scale_base: float, *, inverse: bool = False):
    """xPos (Sun et al., 2022, §3.2): ``ζ_m^(p/γ)`` (queries) or ``ζ_m^(-p/γ)`` (keys,
    ``inverse=True``), ``γ`` = ``scale_base``.

    Shapes: pos ``(b, n)`` integers; decay ``ζ`` ``(r/2,)`` → float32 ``(b, n, r/2)``.
    """
    exponent = ops.expand_dims(ops.cast(pos, "float32"), -1) / scale_base
    log = ops.log(ops.convert_to_tensor(decay, dtype="float32"))
    return ops.exp(exponent * (-log if inverse else log))


def apply_rope(x, angles, *, interleaved: bool = False, scale=None):
    """Rotate feature pairs of ``x`` by ``angles``; features past ``2·angles.shape[-1]`` pass.

    ``interleaved=False`` pairs ``(x[k], x[k + r/2])`` (GPT-NeoX, Llama, keras-hub);
    ``interleaved=True`` pairs ``(x[2k], x[2k+1])`` (RoFormer, GPT-J). ``scale`` (xPos's decay)
    multiplies both features of each rotated pair.

    Shapes:
        x: ``(b, n, ..., d)`` (Keras' layout, e.g. ``(b, n, h, d)``); angles, scale:
        ``(b|1, n, r/2)``; returns ``x``'s shape and dtype, rotated in float32.
    """
    half = angles.shape[-1]
    d = x.shape[-1]
    if 2 * half > d:
        raise ValueError(f"rotary dim {2 * half} exceeds the feature dim {d}")
    cos, sin = ops.cos(angles), ops.sin(angles)
    if scale is not None:  # s·R: the transpose s·Rᵀ is the rotation by -angles, scaled alike
        cos, sin = cos * scale, sin * scale
    for _ in range(len(x.shape) - 3):  # broadcast over the axes between tokens and features
        cos, sin = ops.expand_dims(cos, 2), ops.expand_dims(sin, 2)
    xf = ops.cast(x, "float32")
    rot, rest = xf[..., : 2 * half], xf[..., 2 * half :]
    if interleaved:
        pairs = ops.reshape(rot, (*ops.shape(rot)[:-1], half, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
        y = ops.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        y = ops.reshape(y, ops.shape(rot))
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        y = ops.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    if 2 * half < d:
        y = ops.concatenate([y, rest], axis=-1)
    return ops.cast(y, x.dtype)


def alibi_bias(slopes, distance, *, causal: bool):
    """``slope_h·(p_j - p_i)`` (causal) or ``-slope_h·|p_j - p_i|`` (Press et al., 2022, §3).

    Shapes: slopes ``(h,)``; distance ``(b, i, j)`` → float32 ``(b, h, i, j)``.
    """
    d = ops.expand_dims(ops.cast(distance, "float32"), 1)
    d = d if causal else -ops.abs(d)
    return ops.reshape(ops.cast(slopes, "float32"), (1, -1, 1, 1)) * d


def kerple_bias(distance, r1, r2, *, variant: str = "log"):
    """KERPLE (Chi et al., 2022, §4): ``-r1·log(1 + r2·|Δ|)`` (``"log"``) or ``-r1·|Δ|^r2``
    (``"power"``) per head; :func:`relpos.functional.kerple_bias` in ``keras.ops``.

    Shapes: distance ``(D,)`` integers; r1, r2 ``(h,)`` in range (the caller clamps) →
    float32 ``(h, D)``.
    """
    d = ops.expand_dims(ops.abs(ops.cast(distance, "float32")), 0)  # (1, D)
    r1, r2 = ops.expand_dims(r1, -1), ops.expand_dims(r2, -1)  # (h, 1)
    if variant == "log":
        return -r1 * ops.log1p(r2 * d)
    return -r1 * ops.power(d, r2)


def sandwich_bias(distance, scales, *, dim: int = 128, base: float = 10000.0, dtype="float32"):
    """Sandwich (Chi et al., 2023, §5): ``(Σ_{k=1}^{d̄/2} cos(Δ·base^{-2k/d̄}) - d̄/2) / scale_h``,
    the inner product of two sinusoidal embeddings of width ``d̄`` shifted to 0 at ``Δ = 0``;
    :func:`relpos.functional.sandwich_bias` in ``keras.ops``.

    The ``d̄/2`` cosines of large angles cancel closely, so the angles and the sum run in
    ``dtype``: float64 where the backend has it keeps the PyTorch function's precision (it sums
    in float64 always); float32 loses about ``Δ·10^-7`` per cosine at large ``|Δ|``.

    Shapes: distance ``(D,)`` integers; scales ``(h,)`` per-head divisors
    (:func:`relpos.functional.sandwich_head_scales`) → float32 ``(h, D)``.
    """
    if dim < 2 or dim % 2:
        raise ValueError(f"dim must be an even int >= 2, got {dim}")
    inv_freq = [base ** (-2.0 * k / dim) for k in range(1, dim // 2 + 1)]  # float64, (d̄/2,)
    inv_freq = ops.convert_to_tensor(inv_freq, dtype=dtype)
    angles = ops.expand_dims(ops.cast(distance, dtype), -1) * inv_freq  # (D, d̄/2)
    inner = ops.sum(ops.cos(angles), axis=-1) - dim / 2  # (D,)
    scales = ops.expand_dims(ops.cast(scales, dtype), -1)  # (h, 1)
    return ops.cast(ops.expand_dims(inner, 0) / scales, "float32")


def fire_mlp(x, w1, b1, w2, b2):
    """FIRE's MLP ``relu(x·w1 + b1)·w2 + b2`` on every element of ``x``, read as the
    piecewise-linear function it is (:mod:`relpos.functional.fire`): each element's segment
    between the sorted kinks ``-b1_k / w1_k`` (``searchsorted``) picks one slope and one intercept
    per head, so no ``(..., hidden)`` tensor is made. Which units are active on a segment comes
    from the kinks' ranks; the tables are differentiable in the weights, the segment choice is
    not (the function is continuous across kinks).

    Shapes: x ``(...)`` float32; w1, b1 ``(w,)``; w2 ``(w, h)``; b2 ``(h,)`` → ``(..., h)``.
    """
    sloped = ops.not_equal(w1, 0.0)
    safe = ops.where(sloped, w1, 1.0)
    kinks = ops.where(sloped, -b1 / safe, 3.0e38)  # a flat unit's kink: past every input
    order = ops.argsort(kinks)
    rank = ops.expand_dims(ops.argsort(order), 1)  # (w, 1): each unit's place among the kinks
    seg = ops.expand_dims(ops.arange(ops.shape(w1)[0] + 1), 0)  # (1, w + 1)
    active = ops.where(
        ops.expand_dims(w1 > 0, 1),
        seg > rank,
        ops.where(ops.expand_dims(w1 < 0, 1), seg <= rank, ops.expand_dims(b1 > 0, 1)),
    )
    active = ops.stop_gradient(ops.cast(active, "float32"))  # (w, w + 1)
    slope = ops.matmul(ops.transpose(active * ops.expand_dims(w1, 1)), w2)  # (w + 1, h)
    intercept = ops.matmul(ops.transpose(active * ops.expand_dims(b1, 1)), w2) + b2
    shape = ops.shape(x)
    flat = ops.reshape(x, (-1,))
    index = ops.searchsorted(ops.take(kinks, order), flat, side="right")
    out = ops.take(slope, index, axis=0) * ops.expand_dims(flat, 1)
    out = out + ops.take(intercept, index, axis=0)
    return ops.reshape(out, (*shape, ops.shape(w2)[1]))


def t5_buckets(distance, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128):
    """Bucket of every distance ``k_pos - q_pos`` (Raffel et al., 2020, §2.1), int32, same shape.

    Half of the buckets (per direction) are exact distances, the rest log-spaced up to
    ``max_distance``; causal bucketing maps keys after the query to bucket 0.
    """
    n = -ops.cast(distance, "int32")
    buckets = ops.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + ops.cast(n < 0, "int32") * num_buckets
        n = ops.abs(n)
    else:
        n = ops.maximum(n, 0)
    max_exact = num_buckets // 2
    n_f = ops.maximum(ops.cast(n, "float32"), 1.0)
    log_ratio = ops.log(n_f / max_exact) / math.log(max_distance / max_exact)
    far = max_exact + ops.cast(log_ratio * (num_buckets - max_exact), "int32")
    far = ops.minimum(far, num_buckets - 1)
    return buckets + ops.where(n < max_exact, n, far)


def gather_relative(rel_logits, index):
    """``out[b, h, i, j] = rel[b, h, i, index[b, i, j]]``.

    Shapes: rel_logits ``(b|1, h, i|1, R)``; index ``(b|1, i, j)`` → ``(b, h, i, j)``.
    """
    rel_shape, idx_shape = ops.shape(rel_logits), ops.shape(index)
    b = idx_shape[0] if rel_logits.shape[0] == 1 else rel_shape[0]
    h, i, j, rows = rel_shape[1], idx_shape[1], idx_shape[2], rel_shape[-1]
    rel = ops.broadcast_to(rel_logits, (b, h, i, rows))
    idx = ops.broadcast_to(ops.expand_dims(index, 1), (b, h, i, j))
    return ops.take_along_axis(rel, idx, axis=-1)


def scatter_relative(probs, index, rows: int):
    """The adjoint of :func:`gather_relative`: ``mass[b, h, i, r] = Σ_j p[b, h, i, j]·[index = r]``
    (the attention mass per relative row, Shaw's value term), as one segment sum.

    Shapes: probs ``(b, h, i, j)``; index ``(b|1, 1|h, i, j)`` int in ``[0, rows)`` →
    ``(b, h, i, rows)``.
    """
    shape = ops.shape(probs)
    count = shape[0] * shape[1] * shape[2]
    row = ops.reshape(ops.arange(count, dtype="int32"), (shape[0], shape[1], shape[2], 1))
    ids = ops.reshape(row * rows + ops.cast(index, "int32"), (-1,))
    mass = ops.segment_sum(ops.reshape(probs, (-1,)), ids, num_segments=count * rows)
    return ops.reshape(mass, (shape[0], shape[1], shape[2], rows))
