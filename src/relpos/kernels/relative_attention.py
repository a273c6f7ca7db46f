"""Fused relative attention in Triton: FlashAttention-2 with a relative table read per pair.

For the queries ``i`` and keys ``j`` of one batch row and head, with positions ``p`` and segments
``s`` (:class:`~relpos.Positions`):

.. code-block:: text

    row[i, j]  = lut[p_j - p_i + offset]                 the pair's relative row, in [0, R)
    S[i, j]    = q_i·k_j · scale + rel[i, row[i, j]]     rel: (b|1, h, i|1, R), float32
                 (+ relk[j, row[i, j]])                  a key term (DeBERTa's p2c), optional
                 (+ f_h(δ), δ = p_j - p_i)               a distance function, optional
    P          = softmax of S over the allowed keys      same segment, real tokens, p_j <= p_i
                                                         when causal; no key: P = 0
    out[i]     = Σ_j P[i, j] v_j
    mass[i, r] = Σ_j P[i, j] [row[i, j] = r]             (optional) attention mass per row

and the gradients of ``q``, ``k``, ``v``, ``rel``, ``relk`` and ``f``'s parameters from those of
``out`` and ``mass``. Nothing ``(i, j)`` is stored: each tile's logits are rebuilt in the
backward pass from ``lse``. Attention dropout multiplies ``P`` by a keep mask drawn per pair
from a seed and the pair's index (Philox, ``tl.rand``), so the backward pass redraws the same
mask instead of storing it.

This is the form of every :class:`~relpos.schemes.RelativeScheme` and distance bias (Sandwich,
DPB: ``rel`` its table of every distance, shared by every query): ``rel`` is the scheme's
``relative_logits(q)`` (``q·Eᵀ`` for Shaw's keys and the Music Transformer, a bucket table for
T5), ``relk`` its ``relative_key_logits(k)`` (DeBERTa) and ``mass`` what Shaw's value term reads
(``relative_value(mass)``). A distance bias in closed form
(:class:`~relpos.functional.distance_form.DistanceForm`: ALiBi's line with fixed or learned
slopes, KERPLE's logarithmic and power kernels) is computed per pair from one or two
parameters per head, no table read; their gradient is a per-query sum of ``dS·∂f/∂a`` (and
``dS·∂f/∂b``), stored per query and summed by the caller (deterministic). The backend around it is
:mod:`relpos.attention.fused`.

How each row-indexed reduction runs (``mass`` forward; ``d rel`` per query, ``d relk`` per key,
backward):

* ``R`` up to :data:`MAX_LOOP_ROWS` (Shaw's ``2k + 1``, T5's buckets): an ``(i, R)``
  (``(j, R)``) register accumulator, updated once per row present among the tile's allowed pairs
  (one row for a tile past the clipping distance, at most ``BM + BN - 1`` near the diagonal); no
  atomics.
* More rows, over plain positions, whose rows are the clip's distances shifted (``row_base``:
  the Music Transformer's and Transformer-XL's ``d rel``; DeBERTa's ``d rel`` and ``d relk``,
  whose caller hands the tables read per entry of the clip, so that its log buckets become
  such rows): no atomics. For one query each key is at another distance, and for one key each
  query, so each row inside the clip is one pair's: stored; the clip's two end rows sum per
  query (key) in registers.
* More rows of a table shared by every query (a distance bias's table of every distance, T5
  past 128 buckets): its gradient by entry, ``(h, n)``, by atomic adds: one per diagonal of a
  tile where its pairs lie on diagonals (``p_j - p_i = j - i + c``: plain, padded, packed or
  cached positions), one per pair otherwise (:func:`_add_by_entry`).
* More rows otherwise (packed, padded or cached positions, a table per query or key): atomic
  adds at each pair's ``(i, row)`` (``(j, row)``) from the program that owns query
  block ``i`` (key block ``j``), so no two programs contend; one add per query (key) where the
  whole tile reads one row.

A pair's logit term is one load where the table allows it: the rows of clipped distances (Shaw,
the Music Transformer, Transformer-XL: ``row_base``) are computed from the distance, and a table
shared by every query (T5) is read per distance; otherwise the row comes from ``lut`` and then its
entry, two dependent loads (which the profile on an H100 found the table schemes bound by).
``lut`` stops where the scheme's rows stop changing, so it is short whatever the length.

The keys' backward computes its products keys-major (``k·qᵀ``, ``v·d outᵀ``), so the tile's
probabilities and ``dS`` go straight into ``d v`` and ``d k`` as the left operands, with no
transpose through shared memory; ``d out`` is cast to the inputs' dtype once (if it is not in it),
before the backward kernels read it. The queries' backward runs first and computes each query's
``Σ_d d out·out`` as it loads its block, which the keys' backward then reads (no pass of its own
over ``out``); the output and the gradients are stored in the inputs' dtype, with no float32
copy to convert.

Plain positions (one contiguous sequence per batch row, queries = keys) read ``p_j - p_i`` as
``j - i`` and skip the causal future's tiles; with unmasked tiles (``tile_options``: on where a
table is read in half precision) the tiles every pair of which may attend run in a loop of their
own that checks nothing per pair. The
softmax runs in base 2 (``exp2``; the logits times ``log2(e)``).

The launches are two PyTorch operators, ``relpos::relative_flash_forward`` and
``relpos::relative_flash_backward`` (``torch.library.custom_op``, with their shapes and autograd
registered), so ``torch.compile`` takes a call whole, in one graph, and compiles the ops around
them. Outside ``torch.compile`` the forward op is entered below autograd (:class:`_FlashCall`,
the same autograd), which spares the host PyTorch's per-call handling of a custom op's 29
arguments. The dropout seed is a tensor on the device that the kernels load, so a compiled graph
draws a new one each call and a replayed CUDA graph reads the one drawn for it.

With ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter on CPU tensors (slowly: the
test suite checks them so on machines without a GPU).

Reference: Dao (2023), "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (the forward and backward loops); Shaw et al. (2018), Huang et al. (2018), Raffel et
al. (2020) for the relative terms.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..determinism import alert_atomic_sums
from ..functional.distance_form import DISTANCE_FORMS, LINEAR_FORMS, DistanceForm
from . import interpreted

__all__ = [
    "INTERPRETED",
    "KEYED_CANDIDATES",
    "LAUNCH_CANDIDATES",
    "MAX_LOOP_ROWS",
    "SHARED_BUDGET",
    "KernelTiles",
    "Launch",
    "Tiles",
    "block_ranges",
    "dropout_keep",
    "keyed_logits",
    "launch_config",
    "lut_with_runs",
    "parse_launches",
    "recorded_launches",
    "relative_flash_attention",
    "shared_budget",
    "tile_options",
    "tile_size",
    "warp_count",
]

#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when ``triton`` was
#: first imported): on CPU tensors, slowly; the test suite sets it where there is no GPU.
INTERPRETED = interpreted()

#: The most relative rows a register accumulator holds (padded to a power of two); a ``mass``
#: output or a query-independent ``rel`` needs ``R`` within it.
MAX_LOOP_ROWS = 128
#: The shared memory (bytes) any of the kernels needs at most, per square tile size and dtype
#: class: compiled for sm_80 and sm_90 by Triton 3.6 and 3.9 (``python -m relpos.kernels.aot``;
#: ``tests/fused/test_compile.py`` keeps every variant within it).
SHARED_BUDGET = {(64, "half"): 120 * 1024, (32, "half"): 48 * 1024, (32, "float32"): 60 * 1024}
#: Tiles in the interpreter: test shapes span several; fewer, larger ones cost it less time.
_INTERPRETED_BLOCK = 32
#: The kernels' softmax runs in base 2 (``exp2``, the GPU's native exponential): logits times
#: ``log2(e)``, folded into the products' scale and each added term.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def _cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` on the host (Triton's own is a constexpr function, a few µs a call)."""
    return -(-n // d)


def _next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``), on the host."""
    return 1 << (n - 1).bit_length()


def tile_size(dtype: torch.dtype, shared: int | None, head_dim: int = 64) -> int:
    """The kernels' square tile (``BM = BN``) for inputs of ``dtype`` and ``head_dim`` on a device
    with ``shared`` bytes of shared memory per block (None: Triton's interpreter).

    64 for half precision where the device holds it (A100, H100: 164–228 KiB at head dim 64);
    32 otherwise: GPUs with about 100 KiB (RTX 30/40, L4, L40) would refuse the larger tiles'
    launch, and float32's exact products (no tensor cores) spill about 10 KB of registers per
    thread at 64. :data:`SHARED_BUDGET` holds for head dims up to 64; past it the need is taken
    to grow in proportion to the padded head dim, an upper bound (T5's, the Music Transformer's
    and ALiBi's kernels compiled for sm_90 in bf16 at 64×64: at most 145 KiB at d=128 and 273
    KiB at d=256, against 240 and 480 so reckoned), so that an H100 (227 KiB) takes 32×32 tiles
    at d=128 and 256 rather than a launch it would refuse; and 16×16 where even 32×32 would not
    fit so reckoned (a GPU of about 100 KiB at d=256, whose 32×32 kernels ask for up to 101 KiB
    in bf16: ``aot --tile 32 --head-dim 256``).
    """
    if shared is None:
        return _INTERPRETED_BLOCK
    kind = "half" if dtype in (torch.bfloat16, torch.float16) else "float32"
    if kind == "half" and shared >= shared_budget(64, kind, head_dim):
        return 64
    return 32 if shared >= shared_budget(32, kind, head_dim) else 16


def shared_budget(tile: int, kind: str, head_dim: int = 64) -> int | None:
    """:data:`SHARED_BUDGET` of a ``tile``-square tile in ``kind`` (``"half"``, ``"float32"``)
    at ``head_dim``: taken to grow in proportion to the padded head dim past 64
    (:func:`tile_size`); None for a pair the kernels never take by default."""
    budget = SHARED_BUDGET.get((tile, kind))
    scale = max(1, _next_power_of_2(max(head_dim, 1)) // 64)
    return None if budget is None else budget * scale


def warp_count(dtype: torch.dtype) -> int:
    """Warps per program (Triton's ``num_warps``) for inputs of ``dtype``.

    8 for float32: its exact products (no tensor cores) need more registers than 4 warps' threads
    have: Shaw's value-term kernels spill 1.4-3.3 KB per thread at 4 warps, at most 120 bytes at 8
    (``python -m relpos.kernels.aot --tile 32 --dtype float32 --warps 4,8``).
    4 for half precision: on an H100 at 64×64 tiles, 4 warps beat 8 for ALiBi, T5, Shaw and the
    Music Transformer (``benchmarks/fused_tiles.py``; ``docs/performance.md``, "On a GPU").
    """
    return 8 if dtype == torch.float32 else 4


class Tiles(NamedTuple):
    """One kernel's launch: tiles of ``bm`` queries by ``bn`` keys, ``warps`` warps per program
    and ``stages`` stages of Triton's software pipeline (``num_stages``; None: Triton's default,
    3 on an H100)."""

    bm: int
    bn: int
    warps: int
    stages: int | None = None

    def checked(self, name: str) -> Tiles:
        """This launch, or a ``ValueError`` naming ``name`` and what it allows."""
        if self.bm not in _TILE_SIDES or self.bn not in _TILE_SIDES:
            sides = f"{self.bm}x{self.bn}"
            raise ValueError(f"{name}: tiles must be 16, 32, 64 or 128 a side, got {sides}")
        if self.warps not in _WARPS:
            raise ValueError(f"{name}: warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if self.stages is not None and not 1 <= self.stages <= 8:
            raise ValueError(f"{name}: stages must be 1 to 8 or None, got {self.stages}")
        return self


class KernelTiles(NamedTuple):
    """The launches of one call's three kernels: the forward pass (a program per ``bm`` queries),
    the keys' backward (``d k``, ``d v``, ``d relk``: a program per ``bn`` keys, stepping over
    ``bm`` queries) and the queries' backward (``d q``, ``d rel``, the slopes: a program per
    ``bm`` queries)."""

    forward: Tiles
    keys: Tiles
    queries: Tiles


_TILE_SIDES = (16, 32, 64, 128)
_WARPS = (1, 2, 4, 8, 16)


#: Per-kernel launches for a GPU session to time against the square default (``FORWARD/KEYS/
#: QUERIES``, :func:`parse_launches`; ``benchmarks/fused_tiles.py`` takes them by default): the
#: backward kernels' tiles halved (or quartered) on the side they step over, and the forward's
#: queries doubled at 8 warps or its keys halved, which compile for sm_90 with no spilled register
#: where the 64×64 kernels spill (Triton 3.6: ``benchmarks/results/2026-11-28-aot-launches``).
#: Not yet timed.
LAUNCH_CANDIDATES = (
    "64x32w8/32x64w8/64x32w8s1",  # the queries' backward unpipelined: one-row tiles with the mass
    "64x64w4/32x64w4/64x32w4",
    "128x64w8/32x64w4/64x32w4",
    "128x64w8/32x128w8/128x32w8",
    "64x32w4/16x64w4/64x16w4",
)
#: The same for :func:`keyed_logits` (its product of the queries with a window of keys holds
#: another ``(BM, 2·BN)`` float32 accumulator): at 64×64 and 4 warps its kernels spill 430-950
#: bytes per thread on sm_90, these at most 64 (``benchmarks/results/2026-11-28-host-ops``).
KEYED_CANDIDATES = ("64x32w8/32x64w8/64x32w8", "32x32w4/32x32w4/32x32w4")


def parse_launches(text: str) -> KernelTiles:
    """The three kernels' launches from ``FORWARD/KEYS/QUERIES``, each ``BMxBNwWARPS[sSTAGES]``
    (e.g. ``128x64w8s3/32x128w4/128x32w8``: :class:`KernelTiles`, for :func:`launch_config`), as
    ``benchmarks/fused_tiles.py`` and ``python -m relpos.kernels.aot`` take them.

    Raises:
        ValueError: text of another form, or a launch the kernels do not take (named).
    """
    parts = text.split("/")
    form = re.compile(r"(\d+)x(\d+)w(\d+)(?:s(\d+))?")
    found = [form.fullmatch(part) for part in parts]
    if len(parts) != 3 or not all(found):
        raise ValueError(
            "launches are FORWARD/KEYS/QUERIES, each BMxBNwWARPS[sSTAGES] "
            f"(e.g. 128x64w8s3/32x128w4/128x32w8), got {text!r}"
        )
    return KernelTiles(*(
        Tiles(*(int(g) if g else None for g in m.groups())).checked(name)
        for name, m in zip(KernelTiles._fields, found, strict=True)
    ))  # fmt: skip


class Launch(NamedTuple):
    """One kernel launch as :func:`recorded_launches` keeps it."""

    kernel: triton.runtime.JITFunction
    args: tuple
    constexprs: dict
    options: dict  # Triton's launch options: ``num_warps``, ``enable_fp_fusion``


_recording: list[Launch] | None = None
_config: dict = {
    "tile": None, "num_warps": None, "one_row": None, "lut_only": False, "unmasked": None,
    "forward": None, "keys": None, "queries": None, "keyed": None,
}  # fmt: skip


@contextlib.contextmanager
def launch_config(
    tile: int | None = None,
    num_warps: int | None = None,
    *,
    forward: Tiles | tuple | None = None,
    keys: Tiles | tuple | None = None,
    queries: Tiles | tuple | None = None,
    one_row: bool | None = None,
    lut_only: bool = False,
    unmasked: bool | None = None,
    keyed: bool | None = None,
) -> Iterator[None]:
    """Within it the kernels use ``tile``-square tiles and ``num_warps`` warps whatever the
    device (None keeps the default: :func:`tile_size`, :func:`warp_count`), and ``forward``,
    ``keys``, ``queries`` (:class:`Tiles`, or a tuple of its fields) set one kernel's launch
    whole, tiles need not be square (:class:`KernelTiles`); with ``one_row``
    they read a tile whose distances share one relative row once (:func:`_one_row`), with
    ``unmasked`` they run the tiles every pair of which may attend (plain positions) in a loop
    of their own that checks nothing per pair (:func:`_pairs`), and with ``lut_only`` they read
    every pair's row from ``lut`` and then its logit (two dependent loads) even where
    :func:`relative_flash_attention` has a one-load form (``row_base``, a shared table): for
    benchmarks and :mod:`relpos.kernels.aot` to compare them. ``one_row`` and ``unmasked`` left
    None take the measured defaults (:func:`tile_options`); ``one_row`` applies to a call with a
    value term only where the queries' backward runs unpipelined (``stages`` 1). With ``keyed``
    the ``fused`` backend hands the kernels a table's keys instead of its logits where it may
    (:func:`keyed_logits`; None: the default, off until a GPU times it). Not thread-safe."""
    if tile is not None and tile not in _TILE_SIDES:
        raise ValueError(f"tile must be 16, 32, 64 or 128, got {tile}")
    if num_warps is not None and num_warps not in _WARPS:
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    kernels = {"forward": forward, "keys": keys, "queries": queries}
    kernels = {k: None if t is None else Tiles(*t).checked(k) for k, t in kernels.items()}
    before = dict(_config)
    _config.update(
        tile=tile, num_warps=num_warps, one_row=one_row if one_row is None else bool(one_row),
        lut_only=bool(lut_only), unmasked=unmasked if unmasked is None else bool(unmasked),
        keyed=keyed if keyed is None else bool(keyed), **kernels,
    )  # fmt: skip
    try:
        yield
    finally:
        _config.update(before)


def tile_options(
    has_table: bool, mass: bool, dtype: torch.dtype, queries: Tiles | None = None
) -> tuple[bool, bool]:
    """``(one_row, unmasked)`` for one call: :func:`launch_config`'s where it sets them, else the
    defaults an H200 measured (bf16, causal, L=4096, fwd+bwd against flash SDPA;
    ``benchmarks/results/2026-11-28-gpu-h200``): both on where the call reads a relative table in
    half precision (T5 4.2× against 6.2× with neither, the Music Transformer 7.0× against 8.1×,
    Shaw's keys and values 9.3× against 10.6× with ``unmasked``), both off without one (ALiBi
    2.4× against 2.5–2.8× with either) and in float32 (not the fast path: its small tiles were
    not timed). With the attention mass (a value term) ``one_row`` only where the ``queries``'
    backward runs unpipelined (``stages`` 1): Triton 3.6's software pipeliner fails on that
    kernel for sm_90 ("PassManager::run failed"); unpipelined it compiles, and at
    ``64x32w8/32x64w8/64x32w8s1`` no kernel spills (``benchmarks/results/2026-11-28-host-ops``)."""
    measured = has_table and dtype != torch.float32
    one_row = measured if _config["one_row"] is None else _config["one_row"]
    unmasked = measured if _config["unmasked"] is None else _config["unmasked"]
    unpipelined = queries is not None and queries.stages == 1
    return one_row and (not mass or unpipelined), unmasked


def keyed_logits() -> bool:
    """Whether a caller with a table of the form ``q·Eᵀ + c`` over plain positions should hand
    :func:`relative_flash_attention` its keys ``E`` (and row bias ``c``) rather than the logits
    ``rel``: the kernels then compute each tile's logits on the tensor cores
    (:func:`_keyed_logits`) and no ``(b, h, i, R)`` logits are built or kept for the backward
    pass. Off unless :func:`launch_config` turns it on: not yet timed on a GPU."""
    return bool(_config["keyed"])


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within it no kernel runs: each launch is appended to the yielded list, for compiling the
    kernels ahead of time (:mod:`relpos.kernels.aot`; with :func:`launch_config` for the tiles).
    The inputs may be ``meta`` tensors; outputs are left unwritten. Not thread-safe."""
    global _recording
    if _recording is not None:
        raise RuntimeError("recorded_launches does not nest")
    _recording = []
    try:
        yield _recording
    finally:
        _recording = None


def _launch(kernel, grid: tuple, *args, tiles: Tiles, **constexprs) -> None:
    """Launch ``kernel`` (or record it) with ``tiles``' tile shape, warps and stages."""
    # FMA contraction stated, not left to Triton's default (3.9 warns that 3.10 will turn it off).
    options = {"num_warps": tiles.warps, "enable_fp_fusion": True}
    if tiles.stages is not None:
        options["num_stages"] = tiles.stages
    constexprs.update(BM=tiles.bm, BN=tiles.bn)
    if _recording is not None:
        _recording.append(Launch(kernel, args, constexprs, options))
    else:
        kernel[grid](*args, **constexprs, **options)


@triton.jit
def _pairs(
    offs_m, offs_n, m_ok, n_ok, qp, qs, KPOS, KSEG, PLAIN: tl.constexpr, CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """``(delta, allowed, lo, hi)`` of a tile: ``p_j - p_i``, which pairs may attend, and bounds
    of ``delta`` over the tile (every pair's distance lies in ``[lo, hi]``; tokens past the ends
    count as position 0, which can only widen them). Without ``MASKED`` (plain positions, a tile
    every pair of which may attend: :func:`_whole_keys`, :func:`_whole_queries`) ``allowed`` is
    a constant the compiler folds away, so the tile checks nothing per pair."""
    if PLAIN:
        delta = offs_n[None, :] - offs_m[:, None]
        lo = tl.min(offs_n, axis=0) - tl.max(offs_m, axis=0)
        hi = tl.max(offs_n, axis=0) - tl.min(offs_m, axis=0)
        if MASKED:
            allowed = m_ok[:, None] & n_ok[None, :]
        else:
            allowed = tl.full(delta.shape, 1, tl.int1)
    else:
        kp = tl.load(KPOS + offs_n, mask=n_ok, other=0)
        ks = tl.load(KSEG + offs_n, mask=n_ok, other=-1)
        delta = kp[None, :] - qp[:, None]
        allowed = (ks[None, :] == qs[:, None]) & (qs[:, None] != -1) & n_ok[None, :]
        lo = tl.min(kp, axis=0) - tl.max(qp, axis=0)
        hi = tl.max(kp, axis=0) - tl.min(qp, axis=0)
    if CAUSAL and MASKED:
        allowed = allowed & (delta <= 0)
    return delta, allowed, lo, hi


@triton.jit
def _distance_params(scale, PARAMS, h, DIST_FN: tl.constexpr):
    """``(scale2, fa, fb)``: the products' scale times ``log2(e)`` and head ``h``'s parameters
    of the distance function (0 without one; ``PARAMS`` ``(h, 1)`` for ALiBi's line, else
    ``(h, 2)``), ``fa`` scaled so that the bias comes out in base 2 (times ``log2(e)``; KERPLE's
    log form takes its log in base 2 instead)."""
    fa = 0.0
    fb = 0.0
    if DIST_FN == 1 or DIST_FN == 2:
        fa = tl.load(PARAMS + h) * LOG2E
    elif DIST_FN:
        fa = tl.load(PARAMS + 2 * h)
        fb = tl.load(PARAMS + 2 * h + 1)
        if DIST_FN == 4:
            fa = fa * LOG2E
    return scale * LOG2E, fa, fb


@triton.jit
def _power(x, p):
    """``x**p`` for integers ``x >= 0`` and ``p > 0``: 0 at 0."""
    return tl.where(x > 0, tl.exp2(p * tl.log2(tl.maximum(x, 1.0))), 0.0)


@triton.jit
def _distance_bias(delta, fa, fb, DIST_FN: tl.constexpr):
    """Each pair's distance bias in base 2 (``DIST_FN``, :data:`DISTANCE_FORMS` from 1):
    ``fa·δ`` (ALiBi, causal), ``-fa·|δ|`` (bidirectional), ``-fa·log2(1 + fb·|δ|)`` (KERPLE's
    log), ``-fa·|δ|^fb`` (KERPLE's power); ``fa``, ``fb`` from :func:`_distance_params`."""
    dist = delta.to(tl.float32)
    if DIST_FN == 1:
        bias = fa * dist
    elif DIST_FN == 2:
        bias = -fa * tl.abs(dist)
    elif DIST_FN == 3:
        bias = -fa * tl.log2(1.0 + fb * tl.abs(dist))
    else:
        bias = -fa * _power(tl.abs(dist), fb)
    return bias


@triton.jit
def _distance_grads(ds, delta, fa, fb, DIST_FN: tl.constexpr):
    """Per query, ``Σ_j dS·∂bias/∂a`` and ``Σ_j dS·∂bias/∂b`` (0 for ALiBi's line, which has
    no ``b``): the gradients of the head's parameters (natural units) from the tile's ``dS`` (0
    on the pairs that may not attend)."""
    dist = tl.abs(delta.to(tl.float32))
    if DIST_FN == 1:
        ga = tl.sum(ds * delta.to(tl.float32), axis=1)
        gb = tl.zeros_like(ga)
    elif DIST_FN == 2:
        ga = -tl.sum(ds * dist, axis=1)
        gb = tl.zeros_like(ga)
    elif DIST_FN == 3:  # -r1·ln(1 + r2·x): ∂r1 = -ln(1 + r2·x), ∂r2 = -r1·x/(1 + r2·x)
        grow = 1.0 + fb * dist
        ga = -tl.sum(ds * tl.log2(grow), axis=1) * LN2
        gb = -tl.sum(ds * (dist / grow), axis=1) * fa
    else:  # -r1·x^r2: ∂r1 = -x^r2, ∂r2 = -r1·x^r2·ln x (0 at x = 0 and 1)
        pw = _power(dist, fb)
        ga = -tl.sum(ds * pw, axis=1)
        gb = -tl.sum(ds * pw * tl.log2(tl.maximum(dist, 1.0)), axis=1) * (fa * LN2 * LN2)
    return ga, gb


@triton.jit
def _entries(delta, offset, nlut):
    """Each pair's entry of the distance table (distances outside it clamp to its ends)."""
    return tl.minimum(tl.maximum(delta + offset, 0), nlut - 1)


@triton.jit
def _rows(at, LUT, row_base, SHIFTED: tl.constexpr):
    """The relative row of each entry ``at``: ``at + row_base`` where the rows are clipped
    distances (``SHIFTED``: no load), else read from ``LUT``."""
    if SHIFTED:
        row = at + row_base
    else:
        row = tl.load(LUT + at)
    return row


@triton.jit
def _one_row(lo, hi, LUT, offset, nlut):
    """The row every pair of a tile reads when its distances ``[lo, hi]`` lie in one run of equal
    rows (the far field of a clipped table: most tiles of a long sequence), else -1. ``LUT``'s
    second row holds, for each entry, the last entry of its run (:func:`lut_with_runs`)."""
    at_lo = _entries(lo, offset, nlut)
    at_hi = _entries(hi, offset, nlut)
    return tl.where(tl.load(LUT + nlut + at_lo) >= at_hi, tl.load(LUT + at_lo), -1)


@triton.jit
def _add_at_rows(acc, base, row, one, allowed, ok):
    """``acc + base[row]`` on the allowed pairs: for a one-row tile ``base[one]``, one value per
    query (``base`` and ``ok`` of shape ``(BM, 1)``) or key (``(1, BN)``), no gather."""
    if one >= 0:
        acc += tl.load(base + one, mask=ok, other=0.0)
    else:
        acc += tl.load(base + row, mask=allowed, other=0.0)
    return acc


@triton.jit
def _keyed_logits(
    q, keys_base, rowb_base, delta, dlo, one, LUT, offset, nlut, row_base, D, offs_d, d_ok,
    SHIFTED: tl.constexpr, WIN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Each pair's ``q_i·E[row]ᵀ + c[row]`` (float32, ``(BM, BN)``) from the table's keys ``E``
    (``(R, d)`` at ``keys_base``, in ``q``'s dtype) and row bias ``c`` (``(R,)`` float32 at
    ``rowb_base``), instead of ``rel`` read from memory. A one-row tile takes one dot product
    per query. Otherwise the tile's distances span at most ``BM + BN - 1`` consecutive entries
    from the lowest, ``a0``: one product of the queries with those ``WIN`` rows' keys
    ``(BM, d)·(d, WIN)`` on the tensor cores, then each pair's logit gathered from its query's
    row at ``entry - a0`` (the relative-logit skew of Huang et al. 2018, tile by tile)."""
    if one >= 0:
        key = tl.load(keys_base + one * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        dots = tl.sum(q.to(tl.float32) * key[None, :], axis=1) + tl.load(rowb_base + one)
        term = tl.zeros(delta.shape, tl.float32) + dots[:, None]
    else:
        a0 = _entries(dlo, offset, nlut)
        rows = _rows(tl.minimum(a0 + tl.arange(0, WIN), nlut - 1), LUT, row_base, SHIFTED)
        window = tl.load(keys_base + rows[:, None] * D + offs_d[None, :], mask=d_ok[None, :])
        qe = tl.dot(q, tl.trans(window), input_precision=PRECISION)
        qe += tl.load(rowb_base + rows)[None, :]
        term = tl.gather(qe, _entries(delta, offset, nlut) - a0, axis=1)
    return term


@triton.jit
def _relative_logits(
    s, delta, one, allowed, m_ok, n_ok, rel_base, relk_base, dist_base, LUT, offset, nlut,
    row_base, q, keys_base, rowb_base, dlo, D, offs_d, d_ok,
    HAS_REL: tl.constexpr, HAS_KREL: tl.constexpr, SHIFTED: tl.constexpr,
    BY_DISTANCE: tl.constexpr, NEED_ROW: tl.constexpr, REL_KEYS: tl.constexpr,
    WIN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``(s, row)``: the logits (base 2) with the tile's relative terms added (``rel`` per
    query, ``relk`` per key, at each pair's row, times ``log2(e)``) and the pairs' rows: ``one``
    everywhere for a one-row tile, else :func:`_rows`. ``BY_DISTANCE`` (a table shared by every
    query) reads the logit from ``dist_base``, already indexed by entry: one load per pair, not
    a row then its logit; the rows are then read only where ``NEED_ROW`` (a reduction by row
    follows). ``REL_KEYS`` (plain positions): ``rel``'s term computed here from the queries and
    the table's keys (:func:`_keyed_logits`), not read."""
    if REL_KEYS:
        s += _keyed_logits(
            q, keys_base, rowb_base, delta, dlo, one, LUT, offset, nlut, row_base, D, offs_d,
            d_ok, SHIFTED, WIN, PRECISION,
        ) * LOG2E  # fmt: skip
    if one >= 0:
        row = tl.zeros_like(delta) + one
        if HAS_REL and not REL_KEYS:
            s += tl.load(rel_base + one, mask=m_ok[:, None], other=0.0) * LOG2E
        if HAS_KREL:
            s += tl.load(relk_base + one, mask=n_ok[None, :], other=0.0) * LOG2E
    else:
        at = _entries(delta, offset, nlut)
        row = at  # unread where BY_DISTANCE and not NEED_ROW
        if NEED_ROW or not (BY_DISTANCE or REL_KEYS):
            row = _rows(at, LUT, row_base, SHIFTED)
        if BY_DISTANCE:
            s += tl.load(dist_base + at, mask=allowed, other=0.0) * LOG2E
        elif HAS_REL and not REL_KEYS:
            s += tl.load(rel_base + row, mask=allowed, other=0.0) * LOG2E
        if HAS_KREL:
            s += tl.load(relk_base + row, mask=allowed, other=0.0) * LOG2E
    return s, row


@triton.jit
def _allowed_range(x, allowed):
    """The smallest and largest of ``x`` (a row, a distance's offset) among the allowed pairs
    (``2**30, -2**30`` for none: ``lo > hi``)."""
    lo = tl.min(tl.min(tl.where(allowed, x, 1 << 30), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(allowed, x, -(1 << 30)), axis=1), axis=0)
    return lo, hi


@triton.jit
def _add_by_row(acc, x, row, lo, hi, RP: tl.constexpr):
    """``acc[i, r] += Σ_j x[i, j]·[row[i, j] = r]`` for the rows ``lo..hi`` (``x`` is 0 on the
    pairs that may not attend)."""
    cols = tl.arange(0, RP)
    for r in range(RP):
        if (r >= lo) & (r <= hi):
            part = tl.sum(tl.where(row == r, x, 0.0), axis=1)
            acc += tl.where(cols[None, :] == r, part[:, None], 0.0)
    return acc


@triton.jit
def _tile_rows(row, allowed, one):
    """The tile's rows (:func:`_allowed_range`), or ``(one, one)`` for a tile that reads one
    row."""
    lo = one
    hi = one
    if one < 0:
        lo, hi = _allowed_range(row, allowed)
    return lo, hi


@triton.jit
def _sum_by_row(acc, x, row, allowed, one, RP: tl.constexpr):
    """:func:`_add_by_row` over the tile's rows; for a tile that reads one row, one sum."""
    if one >= 0:
        cols = tl.arange(0, RP)
        acc += tl.where(cols[None, :] == one, tl.sum(x, axis=1)[:, None], 0.0)
    else:
        lo, hi = _allowed_range(row, allowed)
        acc = _add_by_row(acc, x, row, lo, hi, RP)
    return acc


@triton.jit
def _own_rows(acc, drel_base, ds, row, allowed, one, first, last, ACROSS: tl.constexpr):
    """``d rel`` (``ACROSS`` 1: per query) or ``d relk`` (0: per key) of one tile where each
    query's (key's) rows inside the clip are one pair's (plain positions, rows that are the
    clip's distances shifted: ``p_j - p_i = j - i`` differs for every key of a query, and every
    query of a key): those are stored, not added, and the clip's end rows ``first`` and
    ``last``, which every farther pair reads, sum per query (key) in ``acc``'s columns 0 and 1
    (``(BM, 2)``, ``(BN, 2)``): the sums run across axis ``ACROSS`` of the ``(BM, BN)`` tile.
    No atomics: each program owns its queries' (keys') rows. ``drel_base`` points at each
    owner's row 0 (``(BM, 1)``, ``(1, BN)``). ``ds`` is 0 on the pairs that may not attend."""
    cols = tl.arange(0, 2)[None, :]
    if one >= 0:  # the whole tile reads one end row
        total = tl.sum(ds, axis=ACROSS)[:, None]
        acc += tl.where(cols == tl.where(one == first, 0, 1), total, 0.0)
    else:
        grad = ds.to(drel_base.dtype.element_ty)  # float32, or q's dtype with the keys
        tl.store(drel_base + row, grad, mask=allowed & (row != first) & (row != last))
        at_first = tl.sum(tl.where(row == first, ds, 0.0), axis=ACROSS)[:, None]
        at_last = tl.sum(tl.where((row == last) & (row != first), ds, 0.0), axis=ACROSS)[:, None]
        acc += tl.where(cols == 0, at_first, at_last)
    return acc


@triton.jit
def _store_end_rows(grad_base, acc, ok, first, last, RP: tl.constexpr):
    """The clip's end rows that :func:`_own_rows` summed per query (key) in ``acc`` (columns 0
    and 1; one row when the clip has one entry), stored at ``grad_base`` (each owner's row 0,
    ``(BM|BN, 1)``) where ``ok``."""
    cols = tl.arange(0, RP)[None, :]
    ends = tl.where(cols == 0, first, last)
    grad = acc.to(grad_base.dtype.element_ty)
    tl.store(grad_base + ends, grad, mask=ok[:, None] & ((cols == 0) | (ends != first)))


@triton.jit
def _add_by_entry(
    dtab_base, ds, delta, allowed, offs_m, offs_n, offset, nlut, BM: tl.constexpr,
    BN: tl.constexpr, WIN: tl.constexpr,
):  # fmt: skip
    """``d table[e] += Σ dS`` over the tile's pairs at entry ``e`` of a table shared by every
    query (a distance bias, T5's buckets past :data:`MAX_LOOP_ROWS`), by atomic adds into the
    ``(nlut,)`` gradient at ``dtab_base``. Where every allowed pair lies at ``j - i`` plus one
    constant (plain positions, padding, packing, a cache), each of the tile's ``BM + BN - 1``
    diagonals is one entry: its sum is gathered (``dS`` skewed so that each diagonal is a
    column) and added once, so a head's entries take one add per diagonal and tile, not one per
    pair; otherwise one add per pair. ``ds`` is 0 on the pairs that may not attend."""
    lo, hi = _allowed_range(delta - (offs_n[None, :] - offs_m[:, None]), allowed)
    if lo == hi:
        diag = tl.arange(0, WIN)
        col = diag[None, :] + tl.arange(0, BM)[:, None] - (BM - 1)  # query's key on a diagonal
        on = (col >= 0) & (col < BN)
        skewed = tl.gather(ds, tl.minimum(tl.maximum(col, 0), BN - 1), axis=1)
        sums = tl.sum(tl.where(on, skewed, 0.0), axis=0)
        first = tl.min(offs_n, axis=0) - tl.max(offs_m, axis=0) + lo  # the first diagonal's δ
        at = _entries(first + diag, offset, nlut)
        tl.atomic_add(dtab_base + at, sums, mask=diag < BM + BN - 1)
    elif lo < hi:
        tl.atomic_add(dtab_base + _entries(delta, offset, nlut), ds, mask=allowed)


@triton.jit
def _dropout_seed(SEED, DROPOUT: tl.constexpr):
    """The dropout mask's seed, loaded from the device (so a replayed CUDA graph reads the one
    drawn for it), or 0 without dropout."""
    if DROPOUT:
        return tl.load(SEED)
    else:
        return 0


@triton.jit
def _dropped(p, seed, row_at, offs_n, NJ, p_drop):
    """``p`` with attention dropout: each pair kept with probability ``1 - p_drop`` (scaled by
    its inverse), drawn by Philox from ``seed`` and the pair's index, so the backward pass and
    :func:`dropout_keep` draw the same mask."""
    draw = tl.rand(seed, row_at[:, None] * NJ + offs_n[None, :])
    return tl.where(draw >= p_drop, p / (1.0 - p_drop), 0.0)


@triton.jit
def _program(H, N, D, BLOCK: tl.constexpr, DP: tl.constexpr):
    """This program's block of ``BLOCK`` tokens (of ``N``) and its batch row and head:
    ``(block, bh, b, h, offs, offs_d, ok, d_ok)``."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements stay exact
    offs = block * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DP)
    return block, bh, bh // H, bh % H, offs, offs_d, offs < N, offs_d < D


@triton.jit
def _key_range(start_m, b, NJ, RANGES, n_ranges, BM: tl.constexpr, PLAIN: tl.constexpr,
               CAUSAL: tl.constexpr):  # fmt: skip
    """The keys query block ``start_m`` visits, ``[begin, end)``: all, or up to the block's end
    for plain causal attention (a tile past ``NJ`` is all masked), or those its segments and
    positions can reach (:func:`block_ranges`)."""
    begin = 0
    end = NJ
    if PLAIN and CAUSAL:
        end = (start_m + 1) * BM
    if not PLAIN:
        begin = tl.load(RANGES + (b * n_ranges + start_m) * 2)
        end = tl.load(RANGES + (b * n_ranges + start_m) * 2 + 1)
    return begin, end


@triton.jit
def _load_queries(Q, QPOS, QSEG, b, h, offs_m, offs_d, m_ok, d_ok, sqb, sqh, sqi, spq):
    """A block's queries ``(BM, DP)`` (zero past the ends), positions and segments (-1 past)."""
    at = Q + b * sqb + h * sqh + offs_m[:, None] * sqi + offs_d[None, :]
    q = tl.load(at, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    qp = tl.load(QPOS + b * spq + offs_m, mask=m_ok, other=0)
    qs = tl.load(QSEG + b * spq + offs_m, mask=m_ok, other=-1)
    return q, qp, qs


@triton.jit
def _load_keys(K, V, b, h, offs_n, offs_d, n_ok, d_ok, skb, skh, skj):
    """A block's keys and values ``(BN, DP)``, zero past the ends."""
    at = b * skb + h * skh + offs_n[:, None] * skj + offs_d[None, :]
    ok = n_ok[:, None] & d_ok[None, :]
    return tl.load(K + at, mask=ok, other=0.0), tl.load(V + at, mask=ok, other=0.0)


@triton.jit
def _load_output_grads(DO, LSE, DLT, row_at, offs_d, m_ok, d_ok, D):
    """A query block's ``d out`` (in the inputs' dtype: the caller casts it), log-sum-exp (base 2,
    as the logits) and ``Σ_j P·dP``."""
    ok = m_ok[:, None] & d_ok[None, :]
    do = tl.load(DO + row_at[:, None] * D + offs_d[None, :], mask=ok, other=0.0)
    lse2 = tl.load(LSE + row_at, mask=m_ok, other=float("inf")) * LOG2E
    dlt = tl.load(DLT + row_at, mask=m_ok, other=0.0)
    return do, lse2, dlt


@triton.jit
def _output_grads_with_delta(
    DO, OUT, LSE, DLT, row_at, offs_d, m_ok, d_ok, D, HAS_MASS: tl.constexpr
):  # fmt: skip
    """:func:`_load_output_grads` for the queries' backward, which runs first and computes
    ``dlt = Σ_d d out·out`` (float32; plus ``Σ_r d mass·mass``, which ``DLT`` holds on entry,
    where ``HAS_MASS``) for its block and stores it for the keys' backward: no pass of its own
    over ``d out`` and ``out`` (FlashAttention-2's preprocessing step)."""
    ok = m_ok[:, None] & d_ok[None, :]
    at = row_at[:, None] * D + offs_d[None, :]
    do = tl.load(DO + at, mask=ok, other=0.0)
    out = tl.load(OUT + at, mask=ok, other=0.0)
    dlt = tl.sum(do.to(tl.float32) * out.to(tl.float32), axis=1)
    if HAS_MASS:
        dlt += tl.load(DLT + row_at, mask=m_ok, other=0.0)
    tl.store(DLT + row_at, dlt, mask=m_ok)
    lse2 = tl.load(LSE + row_at, mask=m_ok, other=float("inf")) * LOG2E
    return do, lse2, dlt


@triton.jit
def _whole_keys(start_m, NI, NJ, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
    """Plain positions: the end of the keys ``[0, end)`` every query of block ``start_m`` may
    attend, in whole key tiles (those before the block's first query when causal), or 0 where
    the block is past the queries' end."""
    end = (NJ // BN) * BN
    if CAUSAL:
        end = (start_m * BM // BN) * BN  # a key tile ends where the queries start, or before
    return tl.where((start_m + 1) * BM <= NI, end, 0)


@triton.jit
def _whole_queries(start_n, NI, NJ, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
    """Plain positions: the queries ``[lo, hi)`` that may attend every key of block ``start_n``,
    in whole tiles (from the block's last key on when causal); empty where the block is past the
    keys' end."""
    lo = 0
    if CAUSAL:
        lo = tl.cdiv((start_n + 1) * BN - 1, BM) * BM
    hi = tl.where((start_n + 1) * BN <= NJ, (NI // BM) * BM, lo)
    return lo, tl.maximum(hi, lo)


@triton.jit
def _forward_tiles(
    acc, l_i, m_i, macc, lo, hi, q, qp, qs, offs_m, m_ok, offs_d, d_ok, rel_base, dist_base,
    row_at, K, V, KPOS, KSEG, RELK, LUT, row_base, b, h, bh, skb, skh, skj, spk,
    NJ, R, nlut, offset, scale2, fa, fb, seed, p_drop, keys_base, rowb_base, D,
    BN: tl.constexpr, RP: tl.constexpr, PLAIN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_REL: tl.constexpr, HAS_MASS: tl.constexpr, HAS_KREL: tl.constexpr,
    DROPOUT: tl.constexpr, DIST_FN: tl.constexpr, PRECISION: tl.constexpr, ONE_ROW: tl.constexpr,
    SHIFTED: tl.constexpr, BY_DISTANCE: tl.constexpr, MASKED: tl.constexpr,
    REL_KEYS: tl.constexpr, WIN: tl.constexpr,
):  # fmt: skip
    """The online softmax over the key tiles ``lo..hi`` of one query block: the running output,
    normaliser, maximum (base 2) and mass, updated. ``MASKED``: see :func:`_pairs`."""
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        n_ok = offs_n < NJ
        k, v = _load_keys(K, V, b, h, offs_n, offs_d, n_ok, d_ok, skb, skh, skj)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        delta, allowed, dlo, dhi = _pairs(
            offs_m, offs_n, m_ok, n_ok, qp, qs, KPOS + b * spk, KSEG + b * spk, PLAIN, CAUSAL,
            MASKED,
        )  # fmt: skip
        one = -1
        if HAS_REL or HAS_MASS or HAS_KREL:
            if ONE_ROW:
                one = _one_row(dlo, dhi, LUT, offset, nlut)
            relk_base = RELK + (bh * NJ + offs_n[None, :]) * R
            s, row = _relative_logits(
                s, delta, one, allowed, m_ok, n_ok, rel_base, relk_base, dist_base, LUT, offset,
                nlut, row_base, q, keys_base, rowb_base, dlo, D, offs_d, d_ok, HAS_REL,
                HAS_KREL, SHIFTED, BY_DISTANCE, HAS_MASS or HAS_KREL, REL_KEYS, WIN, PRECISION,
            )  # fmt: skip
        if DIST_FN:
            s += _distance_bias(delta, fa, fb, DIST_FN)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # the normaliser: before dropout
        if DROPOUT:
            p = _dropped(p, seed, row_at, offs_n, NJ, p_drop)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if HAS_MASS:
            macc = _sum_by_row(macc * alpha[:, None], p, row, allowed, one, RP)
        m_i = m_new
    return acc, l_i, m_i, macc


@triton.jit
def _forward_kernel(
    Q, K, V, QPOS, QSEG, KPOS, KSEG, REL, RELK, PARAMS, KEYS, ROWB, LUT, DIST, row_base, OUT,
    LSE, MASS, sqb, sqh, sqi, skb, skh, skj, spq, spk, srb, srh, sri, seh, sch,
    H, NI, NJ, D, R, nlut, offset, scale, SEED, p_drop, RANGES, n_ranges,
    BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, RP: tl.constexpr,
    PLAIN: tl.constexpr, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, HAS_MASS: tl.constexpr,
    HAS_KREL: tl.constexpr, DROPOUT: tl.constexpr, DIST_FN: tl.constexpr, PRECISION: tl.constexpr,
    ONE_ROW: tl.constexpr, SHIFTED: tl.constexpr, BY_DISTANCE: tl.constexpr,
    UNMASKED: tl.constexpr, REL_KEYS: tl.constexpr, WIN: tl.constexpr,
):  # fmt: skip
    seed = _dropout_seed(SEED, DROPOUT)
    start_m, bh, b, h, offs_m, offs_d, m_ok, d_ok = _program(H, NI, D, BM, DP)
    keys_base = KEYS + h * seh
    rowb_base = ROWB + h * sch
    q, qp, qs = _load_queries(Q, QPOS, QSEG, b, h, offs_m, offs_d, m_ok, d_ok, sqb, sqh, sqi, spq)
    rel_base = REL + b * srb + h * srh + offs_m[:, None] * sri
    dist_base = DIST + h * nlut
    row_at = bh * NI + offs_m
    scale2, fa, fb = _distance_params(scale, PARAMS, h, DIST_FN)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    macc = tl.zeros([BM, RP], tl.float32)
    begin, end = _key_range(start_m, b, NJ, RANGES, n_ranges, BM, PLAIN, CAUSAL)
    if PLAIN and UNMASKED:  # first the tiles every pair of which may attend, unchecked
        split = tl.minimum(tl.maximum(_whole_keys(start_m, NI, NJ, BM, BN, CAUSAL), begin), end)
        acc, l_i, m_i, macc = _forward_tiles(
            acc, l_i, m_i, macc, begin, split, q, qp, qs, offs_m, m_ok, offs_d, d_ok, rel_base,
            dist_base, row_at, K, V, KPOS, KSEG, RELK, LUT, row_base, b, h, bh, skb, skh, skj,
            spk, NJ, R, nlut, offset, scale2, fa, fb, seed, p_drop, keys_base, rowb_base, D,
            BN, RP, PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, PRECISION,
            ONE_ROW, SHIFTED, BY_DISTANCE, False, REL_KEYS, WIN,
        )  # fmt: skip
        begin = split
    acc, l_i, m_i, macc = _forward_tiles(
        acc, l_i, m_i, macc, begin, end, q, qp, qs, offs_m, m_ok, offs_d, d_ok, rel_base,
        dist_base, row_at, K, V, KPOS, KSEG, RELK, LUT, row_base, b, h, bh, skb, skh, skj,
        spk, NJ, R, nlut, offset, scale2, fa, fb, seed, p_drop, keys_base, rowb_base, D,
        BN, RP, PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, PRECISION,
        ONE_ROW, SHIFTED, BY_DISTANCE, True, REL_KEYS, WIN,
    )  # fmt: skip
    has_keys = l_i > 0
    l_use = tl.where(has_keys, l_i, 1.0)
    out_at = row_at[:, None] * D + offs_d[None, :]
    out = (acc / l_use[:, None]).to(OUT.dtype.element_ty)  # q's dtype, or float32 with the mass
    tl.store(OUT + out_at, out, mask=m_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.log2(l_use)) * LN2  # natural log: the backward pass and tests read it so
    tl.store(LSE + row_at, tl.where(has_keys, lse, float("inf")), mask=m_ok)
    if HAS_MASS:
        cols = tl.arange(0, RP)
        tl.store(
            MASS + row_at[:, None] * R + cols[None, :],
            macc / l_use[:, None],
            mask=m_ok[:, None] & (cols[None, :] < R),
        )


@triton.jit
def _probs_and_dp(
    qk, dp, lse2, dlt, offs_m, offs_n, m_ok, n_ok, qp, qs, KPOS, KSEG, rel_base, dmass_base,
    LUT, offset, nlut, scale2, seed, p_drop, row_at, NJ, fa, fb, relk_base, dist_base, row_base,
    q, keys_base, rowb_base, D, offs_d, d_ok,
    PLAIN: tl.constexpr, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, HAS_MASS: tl.constexpr,
    HAS_KREL: tl.constexpr, DROPOUT: tl.constexpr, DIST_FN: tl.constexpr, PRECISION: tl.constexpr,
    ONE_ROW: tl.constexpr, SHIFTED: tl.constexpr, BY_DISTANCE: tl.constexpr,
    NEED_ROW: tl.constexpr, MASKED: tl.constexpr, REL_KEYS: tl.constexpr, WIN: tl.constexpr,
):  # fmt: skip
    """A tile's probabilities as the output used them (rebuilt from ``lse``, dropout applied),
    ``dS = p·(dP - dlt)``, the pairs' rows (where ``NEED_ROW`` or the logits read them), which
    may attend, their distances, and the tile's one row (:func:`_one_row`; -1 if none)."""
    s = qk * scale2
    delta, allowed, dlo, dhi = _pairs(
        offs_m, offs_n, m_ok, n_ok, qp, qs, KPOS, KSEG, PLAIN, CAUSAL, MASKED
    )
    row = delta  # unused without a relative term
    one = -1
    if HAS_REL or HAS_MASS or HAS_KREL:
        if ONE_ROW:
            one = _one_row(dlo, dhi, LUT, offset, nlut)
        s, row = _relative_logits(
            s, delta, one, allowed, m_ok, n_ok, rel_base, relk_base, dist_base, LUT, offset,
            nlut, row_base, q, keys_base, rowb_base, dlo, D, offs_d, d_ok, HAS_REL, HAS_KREL,
            SHIFTED, BY_DISTANCE, NEED_ROW or HAS_MASS, REL_KEYS, WIN, PRECISION,
        )  # fmt: skip
        if HAS_MASS:
            dp = _add_at_rows(dp, dmass_base, row, one, allowed, m_ok[:, None])
    if DIST_FN:
        s += _distance_bias(delta, fa, fb, DIST_FN)
    p = tl.where(allowed, tl.exp2(s - lse2[:, None]), 0.0)
    used = p
    if DROPOUT:  # the output read p·keep/(1 - p_drop): so does its gradient
        used = _dropped(p, seed, row_at, offs_n, NJ, p_drop)
        dp = _dropped(dp, seed, row_at, offs_n, NJ, p_drop)
    ds = p * (dp - dlt[:, None])
    return used, ds, row, allowed, delta, one


@triton.jit
def _kv_tiles(
    dk, dv, dkacc, lo, hi, lo2, hi2, k, v, offs_n, n_ok, offs_d, d_ok, drelk_base,
    Q, DO, LSE, DLT, QPOS, QSEG, KPOS, KSEG, REL, RELK, DIST, LUT, row_base, DMASS,
    b, h, bh, sqb, sqh, sqi, spq, spk, srb, srh, sri, NI, NJ, D, R, nlut, offset, scale2,
    fa, fb, seed, p_drop, keys_base, rowb_base, first, last,
    BM: tl.constexpr, RP: tl.constexpr, PLAIN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_REL: tl.constexpr, HAS_MASS: tl.constexpr, HAS_KREL: tl.constexpr,
    DROPOUT: tl.constexpr, DIST_FN: tl.constexpr, KREL_GRAD: tl.constexpr,
    LOOP_ROWS: tl.constexpr, PRECISION: tl.constexpr, ONE_ROW: tl.constexpr,
    SHIFTED: tl.constexpr, BY_DISTANCE: tl.constexpr, MASKED: tl.constexpr,
    REL_KEYS: tl.constexpr, WIN: tl.constexpr, OWN_ROWS: tl.constexpr,
):  # fmt: skip
    """One key block's gradients, summed over the query tiles ``lo..hi`` and then ``lo2..hi2``
    (``hi - lo`` a multiple of ``BM`` where the second range is not empty). ``MASKED``: see
    :func:`_pairs`; ``OWN_ROWS``, ``first``, ``last``: :func:`_own_rows`, for ``d relk``."""
    span = hi - lo
    for t in range(0, span + hi2 - lo2, BM):
        start_m = tl.where(t < span, lo + t, lo2 + t - span)
        offs_m = start_m + tl.arange(0, BM)
        m_ok = offs_m < NI
        q, qp, qs = _load_queries(
            Q, QPOS, QSEG, b, h, offs_m, offs_d, m_ok, d_ok, sqb, sqh, sqi, spq
        )
        row_at = bh * NI + offs_m
        do, lse2, dlt = _load_output_grads(DO, LSE, DLT, row_at, offs_d, m_ok, d_ok, D)
        # The products come out keys-major, (BN, BM): so the tile's probabilities and dS are
        # already the left operands of dv and dk (no transpose through shared memory).
        qk = tl.trans(tl.dot(k, tl.trans(q), input_precision=PRECISION))
        dp = tl.trans(tl.dot(v, tl.trans(do), input_precision=PRECISION))
        p, ds, row, allowed, _, one = _probs_and_dp(
            qk, dp, lse2, dlt, offs_m, offs_n, m_ok, n_ok, qp, qs, KPOS + b * spk,
            KSEG + b * spk, REL + b * srb + h * srh + offs_m[:, None] * sri,
            DMASS + row_at[:, None] * R, LUT, offset, nlut, scale2, seed, p_drop, row_at, NJ,
            fa, fb, RELK + (bh * NJ + offs_n[None, :]) * R, DIST + h * nlut, row_base,
            q, keys_base, rowb_base, D, offs_d, d_ok,
            PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, PRECISION, ONE_ROW,
            SHIFTED, BY_DISTANCE, KREL_GRAD, MASKED, REL_KEYS, WIN,
        )  # fmt: skip
        dv += tl.dot(tl.trans(p.to(q.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        if KREL_GRAD:  # d relk[j, r] = Σ_i dS[i, j]·[row = r]: this program owns key block j
            if LOOP_ROWS:
                dkacc = _sum_by_row(dkacc, tl.trans(ds), tl.trans(row), tl.trans(allowed), one, RP)
            elif OWN_ROWS:
                dkacc = _own_rows(dkacc, drelk_base, ds, row, allowed, one, first, last, 0)
            else:
                rlo, rhi = _tile_rows(row, allowed, one)
                if rlo == rhi:  # the whole tile reads one row: one add per key
                    tl.atomic_add(drelk_base + rlo, tl.sum(ds, axis=0)[None, :], mask=n_ok[None, :])
                elif rlo < rhi:
                    tl.atomic_add(drelk_base + row, ds, mask=allowed)
    return dk, dv, dkacc


@triton.jit
def _backward_kv_kernel(
    Q, K, V, DO, LSE, DLT, QPOS, QSEG, KPOS, KSEG, REL, RELK, PARAMS, KEYS, ROWB, LUT, DIST,
    row_base, DMASS, DK, DV, DRELK,
    sqb, sqh, sqi, skb, skh, skj, spq, spk, srb, srh, sri, seh, sch,
    H, NI, NJ, D, R, nlut, offset, scale, SEED, p_drop, RANGES, n_ranges,
    BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, RP: tl.constexpr,
    PLAIN: tl.constexpr, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, HAS_MASS: tl.constexpr,
    HAS_KREL: tl.constexpr, DROPOUT: tl.constexpr, DIST_FN: tl.constexpr,
    KREL_GRAD: tl.constexpr, LOOP_ROWS: tl.constexpr, PRECISION: tl.constexpr,
    ONE_ROW: tl.constexpr, SHIFTED: tl.constexpr, BY_DISTANCE: tl.constexpr,
    UNMASKED: tl.constexpr, REL_KEYS: tl.constexpr, WIN: tl.constexpr, OWN_ROWS: tl.constexpr,
):  # fmt: skip
    seed = _dropout_seed(SEED, DROPOUT)
    start_n, bh, b, h, offs_n, offs_d, n_ok, d_ok = _program(H, NJ, D, BN, DP)
    keys_base = KEYS + h * seh
    rowb_base = ROWB + h * sch
    k, v = _load_keys(K, V, b, h, offs_n, offs_d, n_ok, d_ok, skb, skh, skj)
    scale2, fa, fb = _distance_params(scale, PARAMS, h, DIST_FN)
    dk = tl.zeros([BN, DP], tl.float32)
    dv = tl.zeros([BN, DP], tl.float32)
    dkacc = tl.zeros([BN, RP], tl.float32)
    drelk_base = DRELK + (bh * NJ + offs_n[None, :]) * R
    first = 0  # the clip's end rows (OWN_ROWS)
    last = 0
    if OWN_ROWS:
        first = tl.load(LUT)
        last = tl.load(LUT + nlut - 1)
    begin = 0
    end = NI
    if PLAIN and CAUSAL:  # skip the queries before the block
        begin = (start_n * BN // BM) * BM
    if not PLAIN:  # only the queries that can reach this block's keys (block_ranges)
        begin = tl.load(RANGES + (b * n_ranges + start_n) * 2)
        end = tl.load(RANGES + (b * n_ranges + start_n) * 2 + 1)
    lo = end  # the queries [lo, hi) that attend every key: none unless plain and UNMASKED
    hi = end
    if PLAIN and UNMASKED:  # those first, unchecked
        lo, hi = _whole_queries(start_n, NI, NJ, BM, BN, CAUSAL)
        lo = tl.minimum(tl.maximum(lo, begin), end)
        hi = tl.minimum(tl.maximum(hi, lo), end)
        dk, dv, dkacc = _kv_tiles(
            dk, dv, dkacc, lo, hi, hi, hi, k, v, offs_n, n_ok, offs_d, d_ok, drelk_base,
            Q, DO, LSE, DLT, QPOS, QSEG, KPOS, KSEG, REL, RELK, DIST, LUT, row_base, DMASS,
            b, h, bh, sqb, sqh, sqi, spq, spk, srb, srh, sri, NI, NJ, D, R, nlut, offset,
            scale2, fa, fb, seed, p_drop, keys_base, rowb_base, first, last,
            BM, RP, PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, KREL_GRAD,
            LOOP_ROWS, PRECISION, ONE_ROW, SHIFTED, BY_DISTANCE, False, REL_KEYS, WIN, OWN_ROWS,
        )  # fmt: skip
    dk, dv, dkacc = _kv_tiles(  # the rest: [begin, lo) and [hi, end)
        dk, dv, dkacc, begin, lo, hi, end, k, v, offs_n, n_ok, offs_d, d_ok, drelk_base,
        Q, DO, LSE, DLT, QPOS, QSEG, KPOS, KSEG, REL, RELK, DIST, LUT, row_base, DMASS,
        b, h, bh, sqb, sqh, sqi, spq, spk, srb, srh, sri, NI, NJ, D, R, nlut, offset,
        scale2, fa, fb, seed, p_drop, keys_base, rowb_base, first, last,
        BM, RP, PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, KREL_GRAD,
        LOOP_ROWS, PRECISION, ONE_ROW, SHIFTED, BY_DISTANCE, True, REL_KEYS, WIN, OWN_ROWS,
    )  # fmt: skip
    out_at = (bh * NJ + offs_n[:, None]) * D + offs_d[None, :]
    kv_ok = n_ok[:, None] & d_ok[None, :]
    tl.store(DK + out_at, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)  # the inputs' dtype
    tl.store(DV + out_at, dv.to(DV.dtype.element_ty), mask=kv_ok)
    if KREL_GRAD and LOOP_ROWS:
        cols = tl.arange(0, RP)
        keys_at = (bh * NJ + offs_n[:, None]) * R + cols[None, :]
        tl.store(DRELK + keys_at, dkacc, mask=n_ok[:, None] & (cols[None, :] < R))
    if KREL_GRAD and OWN_ROWS:
        _store_end_rows(DRELK + (bh * NJ + offs_n[:, None]) * R, dkacc, n_ok, first, last, RP)


@triton.jit
def _q_tiles(
    dq, dracc, dfa, dfb, lo, hi, q, qp, qs, do, lse2, dlt, offs_m, m_ok, offs_d, d_ok, row_at,
    drel_base, K, V, KPOS, KSEG, REL, RELK, DIST, LUT, row_base, DMASS,
    b, h, bh, skb, skh, skj, spk, srb, srh, sri, NJ, R, nlut, offset, scale2, fa, fb, seed,
    p_drop, first, last, keys_base, rowb_base, D,
    BN: tl.constexpr, RP: tl.constexpr, PLAIN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_REL: tl.constexpr, HAS_MASS: tl.constexpr, HAS_KREL: tl.constexpr,
    DROPOUT: tl.constexpr, DIST_FN: tl.constexpr, REL_GRAD: tl.constexpr,
    LOOP_ROWS: tl.constexpr, PARAM_GRAD: tl.constexpr, PRECISION: tl.constexpr,
    ONE_ROW: tl.constexpr, SHIFTED: tl.constexpr, BY_DISTANCE: tl.constexpr,
    MASKED: tl.constexpr, OWN_ROWS: tl.constexpr, REL_KEYS: tl.constexpr, WIN: tl.constexpr,
    BY_ENTRY: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """One query block's gradients, summed over the key tiles ``lo..hi``. ``MASKED``: see
    :func:`_pairs`; ``OWN_ROWS``, ``first``, ``last``: :func:`_own_rows`; ``BY_ENTRY``:
    :func:`_add_by_entry` (``drel_base`` is then the table's gradient for this head)."""
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        n_ok = offs_n < NJ
        k, v = _load_keys(K, V, b, h, offs_n, offs_d, n_ok, d_ok, skb, skh, skj)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        _, ds, row, allowed, delta, one = _probs_and_dp(
            qk, dp, lse2, dlt, offs_m, offs_n, m_ok, n_ok, qp, qs, KPOS + b * spk,
            KSEG + b * spk, REL + b * srb + h * srh + offs_m[:, None] * sri,
            DMASS + row_at[:, None] * R, LUT, offset, nlut, scale2, seed, p_drop, row_at, NJ,
            fa, fb, RELK + (bh * NJ + offs_n[None, :]) * R, DIST + h * nlut, row_base,
            q, keys_base, rowb_base, D, offs_d, d_ok,
            PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, PRECISION, ONE_ROW,
            SHIFTED, BY_DISTANCE, REL_GRAD, MASKED, REL_KEYS, WIN,
        )  # fmt: skip
        dq += tl.dot(ds.to(q.dtype), k, input_precision=PRECISION)
        if PARAM_GRAD:
            ga, gb = _distance_grads(ds, delta, fa, fb, DIST_FN)
            dfa += ga
            dfb += gb
        if REL_GRAD:
            if LOOP_ROWS:
                dracc = _sum_by_row(dracc, ds, row, allowed, one, RP)
            elif BY_ENTRY:
                _add_by_entry(
                    drel_base, ds, delta, allowed, offs_m, offs_n, offset, nlut, BM, BN, WIN
                )
            elif OWN_ROWS:
                dracc = _own_rows(dracc, drel_base, ds, row, allowed, one, first, last, 1)
            else:
                rlo, rhi = _tile_rows(row, allowed, one)
                if rlo == rhi:  # the whole tile reads one row: one add per query
                    tl.atomic_add(drel_base + rlo, tl.sum(ds, axis=1)[:, None], mask=m_ok[:, None])
                elif rlo < rhi:
                    tl.atomic_add(drel_base + row, ds, mask=allowed)
    return dq, dracc, dfa, dfb


@triton.jit
def _backward_q_kernel(
    Q, K, V, DO, LSE, DLT, OUT, QPOS, QSEG, KPOS, KSEG, REL, RELK, PARAMS, KEYS, ROWB, LUT, DIST,
    row_base, DMASS, DQ, DREL, DPARAMS,
    sqb, sqh, sqi, skb, skh, skj, spq, spk, srb, srh, sri, seh, sch,
    H, NI, NJ, D, R, nlut, offset, scale, SEED, p_drop, RANGES, n_ranges,
    BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, RP: tl.constexpr,
    PLAIN: tl.constexpr, CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, HAS_MASS: tl.constexpr,
    HAS_KREL: tl.constexpr, DROPOUT: tl.constexpr, DIST_FN: tl.constexpr, REL_GRAD: tl.constexpr,
    LOOP_ROWS: tl.constexpr, PARAM_GRAD: tl.constexpr, PRECISION: tl.constexpr,
    ONE_ROW: tl.constexpr, SHIFTED: tl.constexpr, BY_DISTANCE: tl.constexpr,
    UNMASKED: tl.constexpr, OWN_ROWS: tl.constexpr, REL_KEYS: tl.constexpr, WIN: tl.constexpr,
    BY_ENTRY: tl.constexpr,
):  # fmt: skip
    seed = _dropout_seed(SEED, DROPOUT)
    start_m, bh, b, h, offs_m, offs_d, m_ok, d_ok = _program(H, NI, D, BM, DP)
    keys_base = KEYS + h * seh
    rowb_base = ROWB + h * sch
    q, qp, qs = _load_queries(Q, QPOS, QSEG, b, h, offs_m, offs_d, m_ok, d_ok, sqb, sqh, sqi, spq)
    row_at = bh * NI + offs_m
    do, lse2, dlt = _output_grads_with_delta(
        DO, OUT, LSE, DLT, row_at, offs_d, m_ok, d_ok, D, HAS_MASS
    )
    scale2, fa, fb = _distance_params(scale, PARAMS, h, DIST_FN)
    dq = tl.zeros([BM, DP], tl.float32)
    dracc = tl.zeros([BM, RP], tl.float32)
    dfa = tl.zeros([BM], tl.float32)
    dfb = tl.zeros([BM], tl.float32)
    if BY_ENTRY:  # the shared table's gradient by lut entry, (h, nlut)
        drel_base = DREL + h * nlut
    else:
        drel_base = DREL + row_at[:, None] * R
    first = 0  # the clip's end rows (OWN_ROWS)
    last = 0
    if OWN_ROWS:
        first = tl.load(LUT)
        last = tl.load(LUT + nlut - 1)
    begin, end = _key_range(start_m, b, NJ, RANGES, n_ranges, BM, PLAIN, CAUSAL)
    if PLAIN and UNMASKED:  # first the tiles every pair of which may attend, unchecked
        split = tl.minimum(tl.maximum(_whole_keys(start_m, NI, NJ, BM, BN, CAUSAL), begin), end)
        dq, dracc, dfa, dfb = _q_tiles(
            dq, dracc, dfa, dfb, begin, split, q, qp, qs, do, lse2, dlt, offs_m, m_ok, offs_d,
            d_ok, row_at, drel_base, K, V, KPOS, KSEG, REL, RELK, DIST, LUT, row_base, DMASS,
            b, h, bh, skb, skh, skj, spk, srb, srh, sri, NJ, R, nlut, offset, scale2,
            fa, fb, seed, p_drop, first, last, keys_base, rowb_base, D,
            BN, RP, PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, REL_GRAD,
            LOOP_ROWS, PARAM_GRAD, PRECISION, ONE_ROW, SHIFTED, BY_DISTANCE, False, OWN_ROWS,
            REL_KEYS, WIN, BY_ENTRY, BM,
        )  # fmt: skip
        begin = split
    dq, dracc, dfa, dfb = _q_tiles(
        dq, dracc, dfa, dfb, begin, end, q, qp, qs, do, lse2, dlt, offs_m, m_ok, offs_d,
        d_ok, row_at, drel_base, K, V, KPOS, KSEG, REL, RELK, DIST, LUT, row_base, DMASS,
        b, h, bh, skb, skh, skj, spk, srb, srh, sri, NJ, R, nlut, offset, scale2,
        fa, fb, seed, p_drop, first, last, keys_base, rowb_base, D,
        BN, RP, PLAIN, CAUSAL, HAS_REL, HAS_MASS, HAS_KREL, DROPOUT, DIST_FN, REL_GRAD,
        LOOP_ROWS, PARAM_GRAD, PRECISION, ONE_ROW, SHIFTED, BY_DISTANCE, True, OWN_ROWS,
        REL_KEYS, WIN, BY_ENTRY, BM,
    )  # fmt: skip
    q_ok = m_ok[:, None] & d_ok[None, :]
    dq = (dq * scale).to(DQ.dtype.element_ty)  # q's dtype; float32 where keys' terms follow
    tl.store(DQ + row_at[:, None] * D + offs_d[None, :], dq, mask=q_ok)
    if PARAM_GRAD:  # per query, (b, h, i, 1|2); summed over batch and queries by the caller
        if DIST_FN == 1 or DIST_FN == 2:
            tl.store(DPARAMS + row_at, dfa, mask=m_ok)
        else:
            tl.store(DPARAMS + 2 * row_at, dfa, mask=m_ok)
            tl.store(DPARAMS + 2 * row_at + 1, dfb, mask=m_ok)
    if REL_GRAD and LOOP_ROWS:
        cols = tl.arange(0, RP)
        grad = dracc.to(DREL.dtype.element_ty)
        tl.store(drel_base + cols[None, :], grad, mask=m_ok[:, None] & (cols[None, :] < R))
    if REL_GRAD and OWN_ROWS:
        _store_end_rows(drel_base, dracc, m_ok, first, last, RP)


def block_ranges(
    pos: Tensor, seg: Tensor, other_pos: Tensor, other_seg: Tensor, *, block: int, step: int,
    causal: bool, queries: bool, batch: int,
) -> Tensor:  # fmt: skip
    """For each block of ``block`` tokens on one side (queries when ``queries``, else keys), the
    index range ``[start, end)`` on the other side outside which no pair can attend: tokens of a
    segment within the block's segment range (padding excluded) and, when causal, at a position
    the block can reach. ``start`` is aligned down to ``step``; an empty range is ``(0, 0)``.

    Returns: int32 ``(batch, blocks, 2)``; computed on the device, ``O(blocks·n)`` booleans.
    """
    pos, seg = pos.expand(batch, -1), seg.expand(batch, -1)
    other_pos, other_seg = other_pos.expand(batch, -1), other_seg.expand(batch, -1)
    n = pos.shape[1]
    blocks = _cdiv(n, block)
    pad = blocks * block - n
    big = 1 << 30
    real = seg != -1

    def tiles(t: Tensor, fill: int) -> Tensor:
        return torch.nn.functional.pad(t, (0, pad), value=fill).view(batch, blocks, block)

    seg_lo = tiles(torch.where(real, seg, big), big).amin(-1)
    seg_hi = tiles(torch.where(real, seg, -big), -big).amax(-1)
    o_seg = other_seg[:, None, :]
    reach = (o_seg != -1) & (o_seg >= seg_lo[..., None]) & (o_seg <= seg_hi[..., None])
    if causal and queries:  # keys at positions up to the block's last query
        pos_hi = tiles(torch.where(real, pos, -big), -big).amax(-1)
        reach = reach & (other_pos[:, None, :] <= pos_hi[..., None])
    elif causal:  # queries at positions from the block's first key
        pos_lo = tiles(torch.where(real, pos, big), big).amin(-1)
        reach = reach & (other_pos[:, None, :] >= pos_lo[..., None])
    index = torch.arange(other_seg.shape[1], device=seg.device)
    start = torch.where(reach, index, big).amin(-1)
    end = torch.where(reach, index + 1, 0).amax(-1)
    start = torch.where(end > 0, start // step * step, 0)
    return torch.stack([start, end], -1).to(torch.int32).contiguous()


def _ranges(
    qpos: Tensor, qseg: Tensor, kpos: Tensor, kseg: Tensor, causal: bool, plain: bool, batch: int,
    tiles: Tiles, *, queries: bool,
) -> Tensor:  # fmt: skip
    """Each query block's key range (``queries``; the forward and the queries' backward kernel)
    or each key block's query range (the keys' backward kernel) for ``tiles``:
    :func:`block_ranges`, empty for plain positions, whose kernels bound their loops by index."""
    if plain:
        return qpos.new_zeros(batch, 0, 2)
    bm, bn = tiles.bm, tiles.bn
    sides = ((qpos, qseg, kpos, kseg, bm, bn), (kpos, kseg, qpos, qseg, bn, bm))[not queries]
    pos, seg, other_pos, other_seg, block, step = sides
    return block_ranges(
        pos, seg, other_pos, other_seg, block=block, step=step, causal=causal, queries=queries,
        batch=batch,
    )  # fmt: skip


def _blocks(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> KernelTiles:
    """The three kernels' launches for ``dtype`` inputs of ``head_dim`` on ``device``: square
    :func:`tile_size` tiles and :func:`warp_count` warps, or :func:`launch_config`'s."""
    warps = _config["num_warps"] or warp_count(dtype)
    if _config["tile"] is not None:
        tile = _config["tile"]
    elif device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        tile = tile_size(dtype, _shared_memory(index), head_dim)
    else:
        tile = tile_size(dtype, None)
    square = Tiles(tile, tile, warps)
    return KernelTiles(*(_config[k] or square for k in KernelTiles._fields))


@functools.cache
def _shared_memory(index: int) -> int:
    """Shared memory a block may opt in to on CUDA device ``index``."""
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


def _padded(q: Tensor, rows: int) -> tuple[int, int, bool]:
    """``(DP, RP, loop_rows)``: the head dim and the row count padded to powers of two, and
    whether the backward pass's row sums fit a register accumulator (else they are stored per
    query or run by atomic adds: the module docstring)."""
    rp = max(16, _next_power_of_2(max(rows, 1)))
    dp = max(16, _next_power_of_2(q.shape[-1]))
    return dp, rp, rp <= MAX_LOOP_ROWS


class _Settings(NamedTuple):
    """What one call fixes besides its tensors, as the two ops take it (keyword arguments):
    ``row_base`` -1 for none (:func:`relative_flash_attention`'s None), ``dist_fn`` 0 (no
    distance function) or its form's place in :data:`DISTANCE_FORMS` plus one, ``tiles`` the
    three kernels' launches flattened
    (:func:`_flat_tiles`)."""

    offset: int
    rows: int
    causal: bool
    plain: bool
    dist_fn: int
    row_base: int
    own_rows: bool
    unmasked: bool
    want_mass: bool
    p_drop: float
    tiles: list[int]


def _flat_tiles(tiles: KernelTiles) -> list[int]:
    """``bm, bn, warps, stages`` per kernel (stages 0: Triton's default), as an op takes them."""
    return [n for t in tiles for n in (t.bm, t.bn, t.warps, t.stages or 0)]


def _kernel_tiles(flat: list[int]) -> KernelTiles:
    """The inverse of :func:`_flat_tiles`."""
    kernels = [flat[n : n + 4] for n in range(0, 12, 4)]
    return KernelTiles(*(Tiles(bm, bn, w, s or None) for bm, bn, w, s in kernels))


def _seed_of(seed: Tensor | None, unread: Tensor) -> Tensor:
    """The kernels' ``SEED``: the dropout seed, an int64 tensor of one value on the inputs'
    device, which they load (a tensor, so that a compiled graph draws a new one each call, and a
    replayed CUDA graph reads the one drawn for it); ``unread`` without dropout."""
    return unread if seed is None else seed


def _forward_outputs(q: Tensor, rows: int, want_mass: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``out`` (q's dtype; float32 with the mass), ``lse`` and ``mass``, allocated."""
    b, h, i, d = q.shape
    out = q.new_empty(b, h, i, d, dtype=torch.float32 if want_mass else q.dtype)
    lse = q.new_empty(b, h, i, dtype=torch.float32)
    mass = q.new_zeros(b, h, i, rows if want_mass else 0, dtype=torch.float32)
    return out, lse, mass


@torch.library.custom_op("relpos::relative_flash_forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, rel: Tensor | None, relk: Tensor | None,
    params: Tensor | None, keys: Tensor | None, row_bias: Tensor | None, qpos: Tensor,
    qseg: Tensor, kpos: Tensor, kseg: Tensor, lut: Tensor, dist: Tensor | None, q_ranges: Tensor,
    k_ranges: Tensor | None, qb_ranges: Tensor | None, seed: Tensor | None, *, offset: int,
    rows: int, causal: bool, plain: bool, dist_fn: int, row_base: int, own_rows: bool,
    unmasked: bool, want_mass: bool, p_drop: float, tiles: list[int],
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, lse, mass)``: the forward kernel's launch, one operator to PyTorch (so that
    ``torch.compile`` takes it whole, with :func:`_forward_shapes` for its shapes).
    ``k_ranges`` and ``qb_ranges``, the block ranges of the keys' and the queries' backward
    (None: not needed, or the forward's), are only kept for the backward pass."""
    b, h, i, d = q.shape
    j = k.shape[2]
    launch = _kernel_tiles(tiles).forward
    dp, rp, _ = _padded(q, rows)
    out, lse, mass = _forward_outputs(q, rows, want_mass)
    tables = _table_args(rel, relk, params, keys, row_bias, lut, dist, row_base, rows, out)
    _launch(
        _forward_kernel, (_cdiv(i, launch.bm), b * h),
        q, k, v, qpos, qseg, kpos, kseg, *tables, out, lse, mass,
        *_strides(q, k, qpos, kpos, rel), *_keyed_strides(keys, row_bias),
        h, i, j, d, rows, lut.shape[1], offset, 1.0 / math.sqrt(d), _seed_of(seed, out), p_drop,
        q_ranges, q_ranges.shape[1],
        tiles=launch, DP=dp, RP=rp, PLAIN=plain, CAUSAL=causal,
        HAS_REL=rel is not None or keys is not None, HAS_MASS=want_mass,
        HAS_KREL=relk is not None, DROPOUT=p_drop > 0, DIST_FN=dist_fn, PRECISION=_precision(q),
        ONE_ROW=lut.shape[0] == 2, SHIFTED=row_base >= 0, BY_DISTANCE=dist is not None,
        UNMASKED=unmasked, REL_KEYS=keys is not None, WIN=_window(launch),
    )  # fmt: skip
    return out, lse, mass


@_forward_op.register_fake
def _forward_shapes(q, k, v, rel, relk, params, keys, row_bias, *args, rows, want_mass, **kw):
    return _forward_outputs(q, rows, want_mass)


def _gradient_buffers(
    q: Tensor, k: Tensor, lut: Tensor, s: _Settings, rel_grad: bool, relk_grad: bool,
    param_grad: bool, by_entry: bool, keyed: bool,
) -> tuple[Tensor, ...]:  # fmt: skip
    """``dq, dk, dv, drel, drelk, dparams`` as the backward kernels write them, zeroed where they
    add to them. ``d rel`` by entry ``(h, n)`` (a table shared by every query past the register
    rows), else per query ``(b, h, i, R|0)``: with the keys in q's dtype where stored (register
    rows, or each query's own rows: then multiplied out on the tensor cores), else float32.
    ``dq`` in float32 where ``d rel·E`` is added to it after the kernels."""
    b, h, i, _ = q.shape
    j, r = k.shape[2], s.rows
    _, _, loop_rows = _padded(q, r)
    drel_dtype = q.dtype if keyed and (loop_rows or s.own_rows) else torch.float32
    if by_entry:
        drel = q.new_zeros(h, lut.shape[1], dtype=torch.float32)
    else:
        drel = q.new_zeros(b, h, i, r if rel_grad else 0, dtype=drel_dtype)
    drelk = q.new_zeros(b, h, j, r if relk_grad else 0, dtype=torch.float32)
    width = _param_width(DISTANCE_FORMS[s.dist_fn - 1]) if s.dist_fn else 0
    dparams = q.new_zeros(b, h, i if param_grad else 0, width, dtype=torch.float32)
    dq = q.new_empty(b, h, i, q.shape[3], dtype=torch.float32 if rel_grad and keyed else q.dtype)
    dk = q.new_empty(b, h, j, q.shape[3])
    return dq, dk, torch.empty_like(dk), drel, drelk, dparams


@torch.library.custom_op("relpos::relative_flash_backward", mutates_args=())
def _backward_op(
    do: Tensor, dmass: Tensor | None, q: Tensor, k: Tensor, v: Tensor, rel: Tensor | None,
    relk: Tensor | None, params: Tensor | None, keys: Tensor | None, row_bias: Tensor | None,
    out: Tensor, lse: Tensor, mass: Tensor, qpos: Tensor, qseg: Tensor, kpos: Tensor,
    kseg: Tensor, lut: Tensor, dist: Tensor | None, q_ranges: Tensor, k_ranges: Tensor,
    seed: Tensor | None, *, offset: int, rows: int, causal: bool, plain: bool, dist_fn: int,
    row_base: int, own_rows: bool, unmasked: bool, want_mass: bool, p_drop: float,
    tiles: list[int], rel_grad: bool, relk_grad: bool, param_grad: bool, by_entry: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``dq, dk, dv, drel, drelk, dparams`` as the two backward kernels write them
    (:func:`_gradient_buffers`); ``dmass`` None without the mass. The queries' kernel runs
    first: it computes each query's ``Σ d out·out`` (plus the mass's term), which the keys'
    kernel reads."""
    s = _Settings(
        offset, rows, causal, plain, dist_fn, row_base, own_rows, unmasked, want_mass, p_drop, tiles
    )
    b, h, i, d = q.shape
    j = k.shape[2]
    dp, rp, loop_rows = _padded(q, rows)
    launches = _kernel_tiles(tiles)
    keyed = keys is not None
    grads = _gradient_buffers(q, k, lut, s, rel_grad, relk_grad, param_grad, by_entry, keyed)
    dq, dk, dv, drel, drelk, dparams = grads
    has_mass = dmass is not None
    if has_mass:  # the queries' backward adds Σ_d d out·out (_output_grads_with_delta)
        dmass = dmass.float().contiguous()
        dlt = (dmass * mass).sum(-1)
    else:
        dmass = do  # any pointer: never read
        dlt = lse.new_empty(b, h, i)
    tables = _table_args(rel, relk, params, keys, row_bias, lut, dist, row_base, rows, out)
    strides = (*_strides(q, k, qpos, kpos, rel), *_keyed_strides(keys, row_bias))
    scale = 1.0 / math.sqrt(d)
    common = (h, i, j, d, rows, lut.shape[1], offset, scale, _seed_of(seed, out), p_drop)
    flags = dict(
        DP=dp, RP=rp if loop_rows else 2, PLAIN=plain, CAUSAL=causal,
        HAS_REL=rel is not None or keyed, HAS_MASS=has_mass, HAS_KREL=relk is not None,
        DROPOUT=p_drop > 0, DIST_FN=dist_fn, LOOP_ROWS=loop_rows, PRECISION=_precision(q),
        ONE_ROW=lut.shape[0] == 2, SHIFTED=row_base >= 0, BY_DISTANCE=dist is not None,
        UNMASKED=unmasked, REL_KEYS=keyed,
    )  # fmt: skip
    _launch(
        _backward_q_kernel, (_cdiv(i, launches.queries.bm), b * h),
        q, k, v, do, lse, dlt, out, qpos, qseg, kpos, kseg, *tables, dmass, dq, drel,
        dparams, *strides, *common, q_ranges, q_ranges.shape[1], REL_GRAD=rel_grad,
        PARAM_GRAD=param_grad, OWN_ROWS=own_rows and not loop_rows, tiles=launches.queries,
        WIN=_window(launches.queries), BY_ENTRY=by_entry, **flags,
    )  # fmt: skip
    _launch(
        _backward_kv_kernel, (_cdiv(j, launches.keys.bn), b * h),
        q, k, v, do, lse, dlt, qpos, qseg, kpos, kseg, *tables, dmass, dk, dv, drelk,
        *strides, *common, k_ranges, k_ranges.shape[1], KREL_GRAD=relk_grad,
        OWN_ROWS=own_rows and not loop_rows, tiles=launches.keys, WIN=_window(launches.keys),
        **flags,
    )  # fmt: skip
    return dq, dk, dv, drel, drelk, dparams


@_backward_op.register_fake
def _backward_shapes(do, dmass, q, k, v, rel, relk, params, keys, *args, **kw):
    lut = args[8]
    flags = {name: kw.pop(name) for name in ("rel_grad", "relk_grad", "param_grad", "by_entry")}
    return _gradient_buffers(q, k, lut, _Settings(**kw), keyed=keys is not None, **flags)


def _save(ctx, inputs: tuple, keyword_only_inputs: dict, output: tuple) -> None:
    """The forward op's autograd context: its tensors, outputs and settings."""
    ctx.save_for_backward(*inputs, *output)  # q … seed (18), then out, lse, mass
    ctx.settings = _Settings(**keyword_only_inputs)
    lse, mass = output[1:]
    ctx.mark_non_differentiable(lse)
    if not ctx.settings.want_mass:
        ctx.mark_non_differentiable(mass)


def _backward(ctx, dout: Tensor, _dlse: Tensor, dmass: Tensor) -> tuple:
    """The gradients of the forward op's inputs: the backward op's, then what is left in
    PyTorch (``d rel`` back to ``rel``'s shape, the keys' products)."""
    q, k, v, rel, relk, params, keys, row_bias, qpos, qseg, kpos, kseg, lut, dist = (
        ctx.saved_tensors[:14]
    )
    q_ranges, k_ranges, qb_ranges, seed, out, lse, mass = ctx.saved_tensors[14:]
    s = ctx.settings
    b = q.shape[0]
    _, _, loop_rows = _padded(q, s.rows)
    needs = ctx.needs_input_grad
    keyed = keys is not None
    # With the keys, d rel (computed, then multiplied out below) serves q's gradient too.
    rel_grad = (rel is not None and needs[3]) or (keyed and (needs[0] or any(needs[6:8])))
    relk_grad = relk is not None and needs[4]
    param_grad = params is not None and needs[5]
    # A table shared by every query past the register rows: its gradient by lut entry.
    by_entry = rel_grad and not loop_rows and rel is not None and _shared(rel)
    # The backward keeps the forward's launches and their block ranges, computed beside the
    # forward's (relative_flash_attention); the queries' backward has the forward's where its
    # tiles are the same.
    tiles = _kernel_tiles(s.tiles)
    geometry = (qpos, qseg, kpos, kseg, s.causal, s.plain, b)
    if k_ranges is None:  # no input needed a gradient at the forward pass
        k_ranges = _ranges(*geometry, tiles.keys, queries=False)
    if tiles.queries[:2] != tiles.forward[:2]:
        q_ranges = qb_ranges
        if q_ranges is None:
            q_ranges = _ranges(*geometry, tiles.queries, queries=True)
    # The products read d out in q's dtype (out's, but with the mass): cast once here if at
    # all, not in every program that loads it.
    do = dout.to(q.dtype).contiguous()
    dmass = dmass.contiguous() if s.want_mass and dmass is not None else None
    dq, dk, dv, drel, drelk, dparams = _backward_op(
        do, dmass, q, k, v, rel, relk, params, keys, row_bias, out, lse, mass, qpos, qseg, kpos,
        kseg, lut, dist, q_ranges, k_ranges, seed, **s._asdict(), rel_grad=rel_grad,
        relk_grad=relk_grad, param_grad=param_grad, by_entry=by_entry,
    )  # fmt: skip
    dkeys = drow_bias = None
    if rel_grad and keyed:  # rel = q·Eᵀ + c, differentiated here, in the keys' dtype (q's)
        rows_grad = drel.to(keys.dtype)
        dq = dq + torch.matmul(rows_grad, keys)
        dkeys = _head_sum(torch.einsum("bhir,bhid->hrd", rows_grad, q), keys)
        drow_bias = _head_sum(drel.sum((0, 2), dtype=torch.float32), row_bias)
        drel = None
    elif by_entry:  # entries to rows: lut[e] is entry e's row
        h = q.shape[1]
        rows = drel.new_zeros(h, s.rows).index_add_(1, lut[0].long(), drel)
        drel = rows.view(1, h, 1, s.rows)
    elif rel_grad:  # back to rel's broadcast shape (b|1, h, i|1, R)
        dims = [n for n in (0, 2) if rel.shape[n] == 1]
        drel = drel.sum(dims, keepdim=True) if dims else drel
    return (
        dq.to(q.dtype),  # float32 only where the keys' terms were added
        dk,
        dv,
        drel if rel_grad else None,
        drelk if relk_grad else None,
        dparams.sum((0, 2)) if param_grad else None,  # (h, 1|2)
        None if dkeys is None else dkeys.to(keys.dtype),
        drow_bias,
        *[None] * 10,  # the geometry, the ranges, the seed
    )


torch.library.register_autograd("relpos::relative_flash_forward", _backward, setup_context=_save)


class _FlashCall(torch.autograd.Function):
    """The forward op with the autograd it has registered (:func:`_save`, :func:`_backward`),
    as :func:`relative_flash_attention` calls it outside ``torch.compile``, for less host time:
    a call of the op itself with inputs that need a gradient fills in its arguments' defaults at
    a cost quadratic in their number (``torch._library.utils.fill_defaults``: 29 arguments,
    0.14 ms a call on a 2-core AMD EPYC, more than the rest of the op's host time); here the op
    runs below autograd and skips that (``benchmarks/host_ops.py``'s host column). Dynamo
    refuses this function where two inputs are one tensor (self-attention's positions), so a
    compiled call takes the op. ``inputs``: the op's 18 tensor arguments, then the call's
    :class:`_Settings`."""

    @staticmethod
    def forward(ctx, *inputs):
        tensors, settings = inputs[:-1], inputs[-1]
        kw = settings._asdict()
        output = _forward_op(*tensors, **kw)
        _save(ctx, tensors, kw, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return (*_backward(ctx, *grads), None)


def _shared(rel: Tensor) -> bool:
    """Whether ``rel`` (``(b|1, h, i|1, R)``) is one table for every batch row and query."""
    return rel.shape[0] == 1 and rel.shape[2] == 1


def _window(tiles: Tiles) -> int:
    """The rows a tile's distances span (:func:`_keyed_logits`), padded to a power of two."""
    return _next_power_of_2(tiles.bm + tiles.bn - 1)


def _table_args(
    rel: Tensor | None, relk: Tensor | None, params: Tensor | None, keys: Tensor | None,
    row_bias: Tensor | None, lut: Tensor, dist: Tensor | None, row_base: int, rows: int,
    unread: Tensor,
) -> list:  # fmt: skip
    """The kernels' ``REL, RELK, PARAMS, KEYS, ROWB, LUT, DIST, row_base`` arguments: ``unread``
    for an absent table (never read), zeros for keys without a bias, a ``row_base`` of -1
    (none) as 0."""
    tables = [t if t is not None else unread for t in (rel, relk, params)]
    if keys is None:
        tables += [unread, unread]
    else:
        bias = row_bias if row_bias is not None else keys.new_zeros(1, rows, dtype=torch.float32)
        tables += [keys, bias]
    return [*tables, lut, unread if dist is None else dist, max(row_base, 0)]


def _keyed_strides(keys: Tensor | None, row_bias: Tensor | None) -> tuple[int, int]:
    """The head strides of ``keys`` and ``row_bias`` (0 where shared by the heads or absent)."""
    seh = keys.stride(0) if keys is not None and keys.shape[0] > 1 else 0
    sch = row_bias.stride(0) if row_bias is not None and row_bias.shape[0] > 1 else 0
    return seh, sch


def _head_sum(grad: Tensor, like: Tensor | None) -> Tensor | None:
    """``grad`` (heads first) summed over the heads where ``like`` shares one among them."""
    if like is None:
        return None
    return grad.sum(0, keepdim=True) if like.shape[0] == 1 else grad


def _strides(q: Tensor, k: Tensor, qpos: Tensor, kpos: Tensor, rel: Tensor | None) -> tuple:
    """Element strides the kernels take (batch strides 0 where broadcast)."""
    spq = qpos.stride(0) if qpos.shape[0] > 1 else 0
    spk = kpos.stride(0) if kpos.shape[0] > 1 else 0
    if rel is None:
        srb = srh = sri = 0
    else:
        srb = rel.stride(0) if rel.shape[0] > 1 else 0
        srh = rel.stride(1)
        sri = rel.stride(2) if rel.shape[2] > 1 else 0
    return (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        spq, spk, srb, srh, sri,
    )  # fmt: skip


def _precision(q: Tensor) -> str:
    """Exact float32 products for float32 inputs (no TF32); half inputs use the tensor cores."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def relative_flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel: Tensor | None,
    lut: Tensor,
    offset: int,
    q_pos: Tensor,
    q_seg: Tensor,
    k_pos: Tensor,
    k_seg: Tensor,
    *,
    rows: int,
    causal: bool,
    plain: bool,
    mass: bool = False,
    dropout_p: float = 0.0,
    seed: int | Tensor = 0,
    distance_form: DistanceForm | None = None,
    relk: Tensor | None = None,
    row_base: int | None = None,
    keys: Tensor | None = None,
    row_bias: Tensor | None = None,
    memo: Callable[[Hashable, Callable[[], Tensor]], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention with a relative logit table, fused (see the module docstring).

    Args:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)``; float32, bfloat16 or float16, one dtype.
        rel: float32 ``(b|1, h, i|1, R)``, the logit term of each query and relative row, or None.
        lut: int32 ``(n,)``, the relative row of distance ``δ`` at ``lut[δ + offset]`` (clamped to
            its ends outside), every entry in ``[0, R)``; or ``(2, n)``, that with its runs as
            :func:`lut_with_runs` gives it (a caller that keeps it between calls).
        rows: ``R``.
        q_pos, q_seg: int32 ``(b|1, i)``; k_pos, k_seg: int32 ``(b|1, j)``; segment -1 is padding.
        causal: keys at positions ``<=`` the query's only.
        plain: positions are ``0..n-1`` of one segment per row and queries are the keys (``i ==
            j``): the kernels then read distances from indices and skip the causal future.
        mass: also return the attention mass per relative row.
        dropout_p: attention dropout on the probabilities (``out`` and ``mass`` read the dropped
            ones; the softmax's normaliser does not), each pair's draw from ``seed`` and its
            index (:func:`dropout_keep` gives the mask).
        seed: the dropout mask's Philox seed: an int, or an integer tensor of one value on
            ``q``'s device, which the kernels read there (no device sync; drawn inside a compiled
            graph, a tensor is new each call, where an int would be fixed into the graph).
        distance_form: a distance bias in closed form added to the logits, evaluated per pair
            (:class:`~relpos.functional.distance_form.DistanceForm`: ALiBi's line, KERPLE's
            kernels), or None; its ``params`` (``(h, 1)`` for the line, ``(h, 2)``) are
            differentiable (learned slopes, KERPLE's ``r1, r2``), their gradient summed per
            query, with no atomic adds.
        relk: float32 ``(b, h, j, R)``, a logit term of each key and relative row, read by every
            query at its pair's row (DeBERTa's position-to-content term), or None.
        row_base: where ``lut[x] = x + row_base`` for every entry (clipped distances, with
            ``lut`` cut at the clip: :attr:`~relpos.schemes.RelativeScheme.distance_clip`), the
            kernels compute each row instead of reading it; None reads ``lut``. A ``rel`` shared
            by every query (``(1, h, 1, R)``) without ``relk`` is read per distance instead
            (``rel[..., lut]``, built here): one load per pair either way. Neither with ``mass``
            nor in float32.
        keys: ``E``, ``(1|h, R, d)``, in place of ``rel``: the logit term is ``q·Eᵀ`` (plus
            ``row_bias``), computed tile by tile on the tensor cores (:func:`keyed_logits`);
            differentiable. Plain positions only.
        row_bias: float32 ``(1|h, R)``, ``c`` of ``q·Eᵀ + c`` (Transformer-XL's), or None.
        memo: ``memo(key, build)``, a store for values of the positions alone (each kernel's
            block ranges) that returns what ``build()`` gave for ``key`` before, where the
            positions tensors are the same function of what it keeps them for (the ``fused``
            backend: :meth:`~relpos.Positions.derived`); None builds them every call.

    Returns:
        ``(out, mass)``: ``(b, h, i, d)`` in ``q``'s dtype (float32 with ``mass``, to which a
        value term is added) and float32 ``(b, h, i, R)`` (``(b, h, i, 0)`` when not asked
        for). A query with no key gets zeros in both. Differentiable in ``q``,
        ``k``, ``v``, ``rel`` and ``mass``.

    Raises:
        ValueError: an input whose shape or dtype does not fit ``q``'s and ``k``'s (named, with
            the shape expected).
        RuntimeError: under ``torch.use_deterministic_algorithms(True)`` (a warning with
            ``warn_only``), when ``rel`` (or ``keys``, ``row_bias``, ``q`` with them) or
            ``relk`` needs a gradient over more than :data:`MAX_LOOP_ROWS` rows: those gradients
            are summed by atomic adds (not over plain positions with ``row_base``: each query's
            and each key's rows are its own).
    """
    want_mass = bool(mass)
    _check_shapes(q, k, v, rel, relk, (q_pos, q_seg, k_pos, k_seg), rows)
    params = _form_params(distance_form, q.shape[1])
    _check_keys(q, rel, keys, row_bias, rows, plain)
    if lut.dim() not in (1, 2) or lut.shape[-1] == 0 or (lut.dim() == 2 and lut.shape[0] != 2):
        raise ValueError(
            f"lut must be (n,) or (2, n) with n >= 1 (lut_with_runs), got {tuple(lut.shape)}"
        )
    runs = lut if lut.dim() == 2 else None
    lut = lut[0] if lut.dim() == 2 else lut
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if row_base is not None and not 0 <= row_base <= rows - lut.numel():
        raise ValueError(
            f"row_base must be in [0, rows - lut.numel()] = [0, {rows - lut.numel()}] (its rows "
            f"row_base..row_base + {lut.numel() - 1} within rows={rows}), got {row_base}"
        )
    # Plain positions and a shifted clip: every row inside the clip is one pair's per query and
    # per key.
    own_rows = bool(plain) and row_base is not None
    atomic = [] if own_rows else [rel, relk, *([q, keys, row_bias] if keys is not None else [])]
    if rows > MAX_LOOP_ROWS and torch.is_grad_enabled():
        if any(t is not None and t.requires_grad for t in atomic):
            _alert_atomic_row_sums(rows)
    has_table = any(t is not None for t in (rel, relk, keys))
    tiles = _blocks(q.device, q.dtype, q.shape[-1])  # every kernel of this call, and backward
    one_row, unmasked = tile_options(has_table, want_mass, q.dtype, tiles.queries)
    # (2, n) with its runs where one-row tiles are on (tile_options), else (1, n): the runs
    # cost a few launches per call, which the other kernels would not read.
    if one_row:
        lut = lut_with_runs(lut.contiguous()) if runs is None else runs.contiguous()
    else:
        lut = lut.contiguous()[None]
    dist, row_base = _one_load_form(rel, relk, want_mass, lut[0], row_base, q.dtype, tiles)
    settings = _Settings(
        offset=int(offset),
        rows=int(rows),
        causal=bool(causal),
        plain=bool(plain),
        dist_fn=0 if distance_form is None else DISTANCE_FORMS.index(distance_form.name) + 1,
        row_base=-1 if row_base is None else row_base,
        own_rows=own_rows,
        unmasked=unmasked,
        want_mass=want_mass,
        p_drop=float(dropout_p),
        tiles=_flat_tiles(tiles),
    )
    q_pos, q_seg, k_pos, k_seg = (t.contiguous() for t in (q_pos, q_seg, k_pos, k_seg))
    remember = memo if memo is not None else _build_now

    def ranges(launch: Tiles, queries: bool) -> Tensor:  # kept by memo: the positions' alone
        geometry = (q_pos, q_seg, k_pos, k_seg, settings.causal, settings.plain, q.shape[0])
        key = ("block ranges", launch.bm, launch.bn, queries, *geometry[4:])
        return remember(key, lambda: _ranges(*geometry, launch, queries=queries))

    q_ranges = ranges(tiles.forward, True)
    differentiable = (q, k, v, rel, relk, params, keys, row_bias)
    backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in differentiable
    )
    k_ranges = ranges(tiles.keys, False) if backward else None
    own_queries = backward and tiles.queries[:2] != tiles.forward[:2]
    qb_ranges = ranges(tiles.queries, True) if own_queries else None
    if dropout_p == 0:
        seed = None
    elif isinstance(seed, Tensor):
        seed = seed.to(device=q.device, dtype=torch.int64).reshape(())
    else:
        seed = torch.tensor(int(seed), dtype=torch.int64, device=q.device)
    q, k, v = (t.contiguous() for t in (q, k, v))
    rel = None if rel is None else rel.contiguous()  # the kernels read its rows with stride 1
    relk = None if relk is None else relk.float().contiguous()
    keys = None if keys is None else keys.to(q.dtype).contiguous()
    row_bias = None if row_bias is None else row_bias.float().contiguous()
    tensors = (
        q, k, v, rel, relk, params, keys, row_bias, q_pos, q_seg, k_pos, k_seg, lut, dist,
        q_ranges, k_ranges, qb_ranges, seed,
    )  # fmt: skip
    if torch.compiler.is_compiling():  # the op whole, its autograd as registered
        out, _, mass = _forward_op(*tensors, **settings._asdict())
    else:
        out, _, mass = _FlashCall.apply(*tensors, settings)
    return out, mass


def _build_now(_key: Hashable, build: Callable[[], Tensor]) -> Tensor:
    """The ``memo`` of a caller that keeps nothing between calls."""
    return build()


def _one_load_form(
    rel: Tensor | None,
    relk: Tensor | None,
    mass: bool,
    lut: Tensor,
    row_base: int | None,
    dtype: torch.dtype,
    tiles: KernelTiles,
) -> tuple[Tensor | None, int | None]:
    """``(dist, row_base)``: how the kernels read a pair's logit in one load (see
    :func:`relative_flash_attention`'s ``row_base``): a shared ``rel`` per distance (``dist``,
    float32 ``(h, n)``, read for the logits only: the gradient still sums by row), or the rows
    computed from ``row_base``; ``(None, None)`` under :func:`launch_config`'s ``lut_only``.

    Not with ``mass`` where a kernel's tile is 64×64: the value term's row sums then spill more
    registers than the table's loads save, for Shaw's keys and values on sm_90 (``python -m
    relpos.kernels.aot --variants shaw-values``, with and without ``--lut-only``); at the
    smaller launches of :data:`LAUNCH_CANDIDATES` nothing spills either way
    (``benchmarks/results/2026-11-28-aot-launches``). Nor in float32, whose 32×32 tiles then ask
    for about 16 KiB more shared memory, past what the smallest GPUs grant a block (``--dtype
    float32``); float32 is not the fast path."""
    large = max(t.bm * t.bn for t in tiles) >= 64 * 64
    if _config["lut_only"] or (mass and large) or dtype == torch.float32:
        return None, None
    if row_base is not None:
        return None, int(row_base)
    if rel is None or not _shared(rel) or relk is not None:
        return None, None
    return rel.detach()[0, :, 0].float().index_select(-1, lut.long()).contiguous(), None


def lut_with_runs(lut: Tensor) -> Tensor:
    """``(2, n)``: ``lut`` and, for each entry, the last entry of its run of equal rows, so that a
    kernel sees in two loads whether a whole tile reads one row (:func:`_one_row`)."""
    n = lut.numel()
    at = torch.arange(n, dtype=lut.dtype, device=lut.device)
    last = torch.ones(n, dtype=torch.bool, device=lut.device)
    last[:-1] = lut[1:] != lut[:-1]
    ends = torch.where(last, at, torch.full_like(at, n))
    return torch.stack([lut, ends.flip(0).cummin(0).values.flip(0)])


def _check_shapes(q, k, v, rel, relk, positions: tuple, rows: int) -> None:
    """Every input's shape against ``q``'s ``(b, h, i, d)`` and ``k``'s ``j``: the kernels read
    them through strides, so a wrong one would be read out of place, not refused."""

    def refuse(name: str, want: str, t: Tensor) -> None:
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")

    if q.dim() != 4:
        refuse("q", "(b, h, i, d)", q)
    b, h, i, d = q.shape
    if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        refuse("k", f"({b}, {h}, j, {d})", k)
    j = k.shape[2]
    if v.shape != k.shape:
        refuse("v", f"{tuple(k.shape)} (k's)", v)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t, n in zip(
        ("q_pos", "q_seg", "k_pos", "k_seg"), positions, (i, i, j, j), strict=True
    ):
        if t.dim() != 2 or t.shape[0] not in (1, b) or t.shape[1] != n:
            refuse(name, f"(1|{b}, {n})", t)
    for pos, seg, name in ((0, 1, "q_seg"), (2, 3, "k_seg")):
        if positions[seg].shape != positions[pos].shape:  # one stride reads both
            refuse(name, f"{tuple(positions[pos].shape)} (its positions')", positions[seg])
    if rel is not None and (
        rel.dim() != 4
        or rel.shape[0] not in (1, b)
        or rel.shape[1] != h
        or rel.shape[2] not in (1, i)
        or rel.shape[3] != rows
    ):
        refuse("rel", f"(1|{b}, {h}, 1|{i}, {rows})", rel)
    if relk is not None and tuple(relk.shape) != (b, h, j, rows):
        refuse("relk", str((b, h, j, rows)), relk)


def _param_width(name: str) -> int:
    """The parameters per head of the distance form ``name``: ALiBi's slope, or KERPLE's two."""
    return 1 if name in LINEAR_FORMS else 2


def _form_params(form: DistanceForm | None, heads: int) -> Tensor | None:
    """``form``'s parameters as the kernels read them, float32 ``(h, 1)`` (ALiBi's line) or
    ``(h, 2)`` (None without a form), after checking its name and shape."""
    if form is None:
        return None
    if not isinstance(form, DistanceForm):
        raise TypeError(f"distance_form must be a DistanceForm, got {type(form).__name__}")
    if form.name not in DISTANCE_FORMS:
        raise ValueError(f"distance_form.name must be one of {DISTANCE_FORMS}, got {form.name!r}")
    width = _param_width(form.name)
    if tuple(form.params.shape) != (heads, width):
        raise ValueError(
            f"distance_form.params must have shape (h, {width}) = ({heads}, {width}) for "
            f"{form.name!r}, got {tuple(form.params.shape)}"
        )
    return form.params.float().contiguous()


def _check_keys(q, rel, keys, row_bias, rows: int, plain: bool) -> None:
    """``keys`` and ``row_bias`` against ``q``'s heads and dim and the rows; refused beside
    ``rel`` and off plain positions (a tile's distances then span any number of rows)."""
    if keys is None:
        if row_bias is not None:
            raise ValueError("row_bias is the bias of keys: pass keys with it, got keys=None")
        return
    if rel is not None:
        raise ValueError("pass rel or keys, not both: keys stand for rel = q·keysᵀ + row_bias")
    if not plain:
        raise ValueError("keys need plain positions (plain=True): pass rel otherwise")
    _, h, _, d = q.shape
    if keys.dim() != 3 or keys.shape[0] not in (1, h) or tuple(keys.shape[1:]) != (rows, d):
        raise ValueError(f"keys must have shape (1|{h}, {rows}, {d}), got {tuple(keys.shape)}")
    if row_bias is not None and (
        row_bias.dim() != 2 or row_bias.shape[0] not in (1, h) or row_bias.shape[1] != rows
    ):
        raise ValueError(f"row_bias must have shape (1|{h}, {rows}), got {tuple(row_bias.shape)}")


def _alert_atomic_row_sums(rows: int) -> None:
    """The backward pass's atomic row sums in deterministic mode (:func:`.alert_atomic_sums`).
    Checked on every device, so tests see it on a CPU."""
    alert_atomic_sums(
        f"the fused kernel's backward pass sums the relative table's gradient by atomic adds for "
        f"{rows} rows (more than MAX_LOOP_ROWS = {MAX_LOOP_ROWS})"
    )


@triton.jit
def _keep_kernel(KEEP, seed, p_drop, NI, NJ, BM: tl.constexpr, BN: tl.constexpr):
    bh = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    row_at = bh * NI + offs_m
    kept = _dropped(tl.full([BM, BN], 1.0, tl.float32), seed, row_at, offs_n, NJ, p_drop) > 0
    ok = (offs_m < NI)[:, None] & (offs_n < NJ)[None, :]
    tl.store(KEEP + row_at[:, None] * NJ + offs_n[None, :], kept.to(tl.int8), mask=ok)


def dropout_keep(
    seed: int, shape: tuple[int, int, int, int], dropout_p: float, device: torch.device | str
) -> Tensor:
    """The pairs :func:`relative_flash_attention` keeps under dropout with ``seed``: bool
    ``(b, h, i, j)`` (for tests and debugging: it is the ``(i, j)`` tensor the kernels avoid)."""
    b, h, i, j = shape
    keep = torch.empty(b, h, i, j, dtype=torch.int8, device=device)
    tiles = _blocks(torch.device(device), torch.float32).forward
    grid = (_cdiv(i, tiles.bm), _cdiv(j, tiles.bn), b * h)
    _launch(_keep_kernel, grid, keep, int(seed), float(dropout_p), i, j, tiles=tiles)
    return keep.bool()
