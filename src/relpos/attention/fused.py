"""The ``fused`` backend: the relative schemes and ALiBi in one Triton kernel (FlashAttention-2
with the scheme's relative table read per pair), on CUDA.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` relative
rows.

For a :class:`~relpos.schemes.RelativeScheme` the logit term is ``rel[b, h, i, row(p_j - p_i)]``
with ``rel = relative_logits(q)`` (``(b, h, i, R)``: ``q·Eᵀ`` for Shaw's keys, the Music
Transformer and Transformer-XL; ``(1, h, 1, R)``: T5's buckets) and the value term
``relative_value(mass)`` from the attention mass per row; a key term (DeBERTa's
position-to-content) is ``relk[b, h, j, row(p_j - p_i)]`` with ``relk = relative_key_logits(k)``.
The kernel (:mod:`relpos.kernels.relative_attention`) reads ``rel`` per pair (one load: the
row of a clipped distance is computed, a shared table is read per distance, DeBERTa's tables
are handed read per entry of its clip over plain positions), or, over plain
positions with :func:`~relpos.kernels.relative_attention.keyed_logits` on, takes ``E`` itself
and computes each tile's ``q·Eᵀ`` on the tensor cores (no ``(b, h, i, R)`` logits), accumulates
``mass`` per row and returns both gradients, so nothing ``(b, h, i, j)`` is built, Shaw's value
term included (which ``flex`` cannot express). Padding, packed documents and a KV cache come from
the positions and segments, read per tile. The products ``q·Eᵀ`` and ``mass·E^V`` stay in
PyTorch. A distance bias in closed form (``distance_form``: ALiBi's ``slope_h·δ`` with fixed or
learned slopes, KERPLE's ``-r1·log(1 + r2·|δ|)`` and ``-r1·|δ|^r2``) is computed per pair, no
table, its parameters' gradient summed per query (no atomic adds: deterministic).

What it runs: every relative scheme (a logit term, a key term, a value term or any of them; a
value term with at most :data:`~relpos.kernels.relative_attention.MAX_LOOP_ROWS` rows), ALiBi and
learned ALiBi, KERPLE (in closed form), and the other distance biases (Sandwich, DPB: ``f_h(δ)`` as
one table of every distance the call sees, ``distance_table``, read per pair; its gradient summed
by entry, one atomic add per diagonal of a tile); float32, bfloat16 or float16;
attention dropout in training (the kernel redraws its mask in the backward pass from a seed taken
from PyTorch's CPU generator, so ``torch.manual_seed`` makes it reproducible). Where ``auto``
picks it on CUDA: :func:`.auto.fused_wins_on_cuda` (measured: ``docs/performance.md``, "On a
GPU").

On CPU it runs only where Triton's interpreter is on (``TRITON_INTERPRET=1``): the test suite
checks the kernel that way on machines without a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from ..functional.dtypes import outside_autocast
from ..kernels import triton_available
from ..positions import PAD_SEGMENT, Positions, distance_range
from ..schemes.base import DistanceBiasScheme, LinearBiasScheme, RelativeScheme, Scheme
from .contract import (
    empty_attention,
    is_contiguous_self,
    is_empty,
    pair_segment_ids,
    propagate_nonfinite,
    relative_rows,
    scheme_key,
    validate_attention_inputs,
    zero_padding_keys,
)
from .memo import BoundedCache

__all__ = [
    "FUSED_DTYPES",
    "fused_attention",
    "fused_available",
    "fused_sums_atomically",
    "fused_sums_by_entry",
    "fused_supports",
    "fused_takes_keys",
]

#: The input dtypes the kernel takes.
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_available() -> bool:
    """Whether the ``fused`` backend can run anywhere: ``triton`` is importable."""
    return triton_available()


def _kernels():
    from ..kernels import relative_attention  # imports triton: only when used

    return relative_attention


def _has_form(scheme: Scheme) -> bool:
    """Whether the scheme's bias has a closed form the kernel evaluates per pair
    (``distance_form``): ALiBi's line, fixed or learned, and KERPLE's kernels."""
    return isinstance(scheme, LinearBiasScheme) or (
        isinstance(scheme, DistanceBiasScheme) and scheme.closed_form
    )


def fused_supports(scheme: Scheme, *, device: torch.device | str | None = None) -> bool:
    """Whether :func:`fused_attention` runs ``scheme`` on ``device`` (see the module docstring)."""
    if not fused_available():
        return False
    device = torch.device("cpu") if device is None else torch.device(device)
    kernels = _kernels()
    if device.type != "cuda" and not (device.type == "cpu" and kernels.INTERPRETED):
        return False
    if _has_form(scheme):
        return "value_term" not in scheme.hooks
    if isinstance(scheme, DistanceBiasScheme):
        return True
    if not isinstance(scheme, RelativeScheme):
        return False
    if not scheme.hooks & {"score_bias", "key_bias", "value_term"}:
        return False
    return "value_term" not in scheme.hooks or scheme.num_relative <= kernels.MAX_LOOP_ROWS


def fused_takes_keys(scheme: Scheme) -> bool:
    """Whether ``scheme``'s logit term is ``q·Eᵀ`` (plus a bias per row), so that over plain
    positions with :func:`~relpos.kernels.relative_attention.keyed_logits` on
    :func:`fused_attention` hands the kernels ``E`` instead of the logits (the Music
    Transformer, Transformer-XL, Shaw's keys, DeBERTa's content-to-position term)."""
    logits = isinstance(scheme, RelativeScheme) and "score_bias" in scheme.hooks
    return logits and scheme.has_relative_keys


def fused_sums_by_entry(scheme: Scheme) -> bool:
    """Whether the kernel reads ``scheme``'s logit term from one table shared by every query
    that may pass :data:`~relpos.kernels.relative_attention.MAX_LOOP_ROWS` rows, its gradient
    then summed per entry (a distance bias with no closed form, Sandwich and DPB: a row per
    distance; T5 past that many buckets)."""
    if isinstance(scheme, DistanceBiasScheme):
        return not scheme.closed_form
    wide = isinstance(scheme, RelativeScheme) and scheme.num_relative > _kernels().MAX_LOOP_ROWS
    return wide and scheme.query_independent and "score_bias" in scheme.hooks


def fused_sums_atomically(scheme: Scheme, q_positions: Positions, k_positions: Positions) -> bool:
    """Whether :func:`fused_attention`'s backward pass sums a relative table's gradient by atomic
    adds for this call (in an order that varies between runs, so deterministic mode refuses it):
    past :data:`~relpos.kernels.relative_attention.MAX_LOOP_ROWS` rows, a logit or key term
    unless over plain positions with a shifted clip or read per entry (each query's and each
    key's rows are then its own: the Music Transformer, Transformer-XL, DeBERTa), a distance
    bias's learned table of every distance. The kernel decides it from the same facts;
    ``tests/fused`` checks that the two agree."""
    if _has_form(scheme):
        return False
    if isinstance(scheme, DistanceBiasScheme):  # a table of every distance the call sees
        lo, hi = distance_range(q_positions, k_positions)
        wide = hi - lo + 1 > _kernels().MAX_LOOP_ROWS
        return wide and any(p.requires_grad for p in scheme.parameters())
    if not isinstance(scheme, RelativeScheme):
        return False
    if scheme.num_relative <= _kernels().MAX_LOOP_ROWS:
        return False
    plain = is_contiguous_self(q_positions, k_positions)
    clip = scheme.distance_clip
    if (plain and clip is not None and clip.shifted) or _reads_entries(scheme, plain):
        return False  # each query's and each key's rows are its own (row_base)
    return bool(scheme.hooks & {"score_bias", "key_bias"})


def _reads_entries(scheme: Scheme, plain: bool) -> bool:
    """Whether a call reads ``scheme``'s tables per entry of its clip rather than per row:
    over plain positions, a table per query (per key) of more than
    :data:`~relpos.kernels.relative_attention.MAX_LOOP_ROWS` rows that are not the clip's
    distances shifted (DeBERTa's log buckets). The tables' columns are then expanded to the
    clip's ``E`` entries (``rel[..., lut]``, ``(b, h, i|j, E)``), so that, as for the Music
    Transformer's shifted clip, each query's and each key's rows are its own pairs' and their
    gradients are stored, not summed by atomic adds (deterministic), and a pair's term is one
    load, not a row then its entry; ``E`` is at most the clip's ``2·reach + 1`` (1,029 for
    DeBERTa's default 512 rows)."""
    if not plain or not isinstance(scheme, RelativeScheme):
        return False
    clip = scheme.distance_clip
    if clip is None or clip.shifted or scheme.num_relative <= _kernels().MAX_LOOP_ROWS:
        return False
    per_query = "score_bias" in scheme.hooks and not scheme.query_independent
    return per_query or "key_bias" in scheme.hooks


#: Per ``(n, device)``: int32 ``0..n-1`` and zeros, ``(1, n)``, what the kernels are handed for
#: plain positions (which they read from indices), and ALiBi's one-entry ``lut``: values of the
#: geometry alone, built once instead of converted on every call.
_GEOMETRY = BoundedCache(32, cost=lambda _: 1)


def _plain_positions(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    def build() -> tuple[Tensor, Tensor]:
        pos = torch.arange(n, dtype=torch.int32, device=device)[None]
        return pos, torch.zeros_like(pos)

    return _GEOMETRY.get_or_build(("positions", n, device), build)


def _one_row_lut(device: torch.device) -> Tensor:
    def build() -> Tensor:
        return torch.zeros(1, dtype=torch.int32, device=device)

    return _GEOMETRY.get_or_build(("lut", device), build)


def _with_runs(lut: Callable[[], Tensor], key: tuple | None) -> Tensor:
    """int32 ``(2, n)``: the table ``lut()`` gives with its runs (``lut_with_runs``), kept under
    ``key`` (a function of the geometry and the scheme's build alone; ``lut`` is not called on a
    hit), or built now where ``key`` is None."""

    def build() -> Tensor:
        return _kernels().lut_with_runs(lut().to(torch.int32))

    return build() if key is None else _GEOMETRY.get_or_build(key, build)


def _identity_lut(n: int, device: torch.device) -> Tensor:
    """int32 ``(2, n)``: a table whose entry ``e`` is row ``e`` (a table of every distance, or
    one read per entry), with its runs, kept per ``(n, device)``."""
    return _with_runs(functools.partial(torch.arange, n, device=device), ("identity", n, device))


def _kernel_positions(q_positions: Positions, k_positions: Positions) -> tuple[Tensor, ...]:
    """int32 ``q_pos, q_seg (b|1, i), k_pos, k_seg (b|1, j)`` for the kernel (each pair of one
    shape: one stride reads both). Plain positions: ``0..n-1`` in one segment, kept between
    calls (:data:`_GEOMETRY`; the kernels read indices). Otherwise kept while the positions
    live (:meth:`~relpos.Positions.derived`: once a step for a model's layers).

    Otherwise both are renumbered per row, queries and keys together, keeping their order, so
    that int64 values (document ids, offsets past ``2**31``) neither wrap in int32 nor pass the
    block ranges' sentinels (``2**30``): segment ids become ``0, 1, …`` (padding stays ``-1``),
    positions count from the row's first real one (padding stays 0); distances are unchanged.
    """
    if is_contiguous_self(q_positions, k_positions):
        pos, seg = _plain_positions(len(q_positions), q_positions.pos.device)
        return pos, seg, pos, seg

    def build() -> tuple[Tensor, ...]:
        b = max(q_positions.batch, k_positions.batch)
        q, k = q_positions.expand(b), k_positions.expand(b)
        seg, pos = torch.cat([q.seg, k.seg], 1), torch.cat([q.pos, k.pos], 1)
        real = seg != PAD_SEGMENT
        dense = pair_segment_ids(q_positions, k_positions)
        dense = torch.where(real, dense, PAD_SEGMENT).to(torch.int32)
        first = torch.where(real, pos, torch.iinfo(torch.int64).max).amin(1, keepdim=True)
        pos = torch.where(real, pos - first, 0).to(torch.int32)
        i = len(q_positions)
        return pos[:, :i], dense[:, :i], pos[:, i:], dense[:, i:]

    return q_positions.derived(k_positions, "fused kernel positions", build)


@outside_autocast
def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scheme: Scheme,
    q_positions: Positions,
    k_positions: Positions,
    *,
    causal: bool,
    dropout_p: float = 0.0,
    training: bool = False,
) -> Tensor:
    """Attention for a relative scheme or ALiBi through the fused Triton kernel.

    Shapes:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)`` (already rotated); returns ``(b, h, i, d)`` in
        ``q``'s dtype. Queries that may attend to no key get 0.

    Raises:
        ValueError: an unsupported scheme, device or dtype (:func:`fused_supports`).
    """
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    if not fused_available():
        raise ValueError("the fused backend needs triton (it ships with CUDA builds of PyTorch)")
    if not fused_supports(scheme, device=q.device):
        raise ValueError(
            f"the fused backend does not support scheme {type(scheme).__name__} on "
            f"{q.device.type} (a relative scheme or ALiBi, on CUDA)"
        )
    if q.dtype not in FUSED_DTYPES:
        raise ValueError(f"the fused backend takes float32, bfloat16 or float16, got {q.dtype}")
    k, v = zero_padding_keys(k, v, k_positions)
    if is_empty(q, k):
        return empty_attention(q, k, v)
    form = scheme.distance_form() if _has_form(scheme) else None
    plain = is_contiguous_self(q_positions, k_positions)
    row_base = rel = relk = keys = row_bias = None
    if form is not None:  # computed per pair, no table: one row
        lut, offset, rows = _one_row_lut(q.device), 0, 1
    elif isinstance(scheme, DistanceBiasScheme):  # one table of every distance, for every query
        lo, table = scheme.distance_table(q_positions, k_positions)
        rows, offset = table.shape[-1], -lo
        lut = _identity_lut(rows, q.device)
        rel = table.float()[None, :, None]
    else:
        rows_of, offset = relative_rows(scheme, q_positions, k_positions, q.device, clipped=True)
        key = scheme_key(scheme)
        key = None if key is None else (*key, offset, len(rows_of), q.device)
        lut = _with_runs(lambda: rows_of, key)
        clip = scheme.distance_clip
        if clip is not None and clip.shifted:  # lut[x] = x - offset - clip.lo: no table to read
            row_base = -offset - clip.lo
        rows = scheme.num_relative
        if plain and _kernels().keyed_logits() and fused_takes_keys(scheme):  # q·Eᵀ + c, per tile
            keys = scheme.relative_keys(q.dtype)
            row_bias = scheme.relative_row_bias(keys)
        elif "score_bias" in scheme.hooks:
            rel = scheme.relative_logits(q)
        relk = scheme.relative_key_logits(k) if "key_bias" in scheme.hooks else None
        if _reads_entries(scheme, plain):  # entry e's row is rows_of[e]: read per entry
            at = rows_of.long()
            rel, relk = (None if t is None else t.index_select(-1, at) for t in (rel, relk))
            keys = None if keys is None else keys.index_select(-2, at)
            row_bias = None if row_bias is None else row_bias.index_select(-1, at)
            rows, row_base = len(at), 0
            lut = _identity_lut(rows, q.device)
    value = "value_term" in scheme.hooks
    drop = dropout_p if training else 0.0
    seed = torch.randint(2**31 - 1, (), device=q.device) if drop > 0 else 0  # no sync
    q_pos, q_seg, k_pos, k_seg = _kernel_positions(q_positions, k_positions)
    out, mass = _kernels().relative_flash_attention(
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        None if rel is None else rel.float(),
        lut,
        offset,
        q_pos,
        q_seg,
        k_pos,
        k_seg,
        rows=rows,
        causal=causal,
        plain=plain,
        mass=value,
        dropout_p=drop,
        seed=seed,
        distance_form=form,
        relk=relk,
        row_base=row_base,
        keys=keys,
        row_bias=row_bias,
        memo=functools.partial(q_positions.derived, k_positions),
    )
    if value:
        out = out + scheme.relative_value(mass).float()
    return propagate_nonfinite(out, q, k, scheme, q_positions, k_positions, causal).to(q.dtype)
