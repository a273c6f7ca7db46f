"""FIRE: functional interpolation for relative positions (Li et al., 2023/2024, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", ICLR 2024, §3).

For causal attention, the logit of query ``i`` (position ``p_i``) and key ``j`` gets, per head,

    b(i, j) = f_θ( ψ(p_i - p_j) / ψ(max(L, p_i)) ),   ψ(x) = log(c·x + 1),

with ``f_θ`` an MLP from one input to one output per head (hidden width 32, ReLU), ``c > 0`` and
the threshold ``L`` learned. The normaliser makes the input a *fraction* of the query's context
(progressive interpolation), ``L`` keeps short contexts from being stretched. As in the paper's
reference code, ``ψ`` reads ``|c|``, ``L = |L|``, and ``1e-6`` is added to the denominator.

The bias depends on the query's position as well as the distance, so it is ``O(i·j)`` values. No
``(pairs, hidden)`` tensor is needed: with one scalar input and one ReLU layer, ``f_θ`` is exactly
*piecewise linear* in ``x``, with a kink where each hidden unit switches (``x = -b1_k / w1_k``).
Between consecutive kinks the active units are fixed, so each head's output is
``slope[h, s]·x + intercept[h, s]`` on segment ``s``: :func:`fire_bias` finds each pair's segment
(``searchsorted`` over the sorted kinks) and reads two ``(h, hidden + 1)`` tables, ``O(pairs·h)``
work. The backward pass sums the output gradient per segment (``Σ g`` and ``Σ g·x``) and turns
those sums into every weight's gradient with ``(h, hidden + 1) × (hidden + 1, hidden)`` products;
the input's gradient is ``Σ_h g·slope``. Which units are active on a segment comes from the kinks'
ranks, not from evaluating the units, so no rounding near a kink flips a unit.

In float32 on the CPU the per-pair work (the input, its segment, every head's value; the
per-segment sums and the input's gradient) runs in C, one loop over the pairs each way
(:mod:`relpos.native`, ``native/fire.c``): the PyTorch form spends most of its time in
``searchsorted``, gathers and scatters over ``(pairs, h)`` temporaries. ``ψ`` is read from a table
over the distances and the normaliser as one reciprocal per query, so the gradients reach ``c``
and ``L`` through those two small tensors.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..native import load
from ..spec.fire import FIRE_EPS
from .dtypes import outside_autocast
from .pair_bias import PairBias
from .skew import gather_table

__all__ = [
    "FIRE_EPS",
    "FirePairs",
    "fire_bias",
    "fire_inputs",
    "fire_mlp",
    "fire_pairs",
    "fire_segments",
]


def fire_inputs(q_pos: Tensor, k_pos: Tensor, c: Tensor, threshold: Tensor) -> Tensor:
    """The MLP's input of every pair, ``ψ(δ) / (ψ(max(L, p_i)) + ε)`` with ``δ = p_i - p_j``.

    Pairs with ``p_j > p_i`` (a causal query never sees them) get ``δ = 0``: a finite value for
    the masked entries, no extrapolation to negative distances.

    Args:
        q_pos: ``(b|1, i)`` integer query positions; k_pos: ``(b|1, j)`` key positions.
        c: scalar, the log transform's scale (``|c|`` is used); threshold: scalar ``L`` (``|L|``).

    Returns:
        ``(b|1, i, j)`` in ``c``'s dtype (at least float32).
    """
    dtype = torch.promote_types(c.dtype, torch.float32)
    c = c.to(dtype).abs()
    pi, pj = q_pos.to(dtype), k_pos.to(dtype)
    delta = (pi.unsqueeze(-1) - pj.unsqueeze(-2)).clamp_min(0.0)
    norm = torch.log1p(c * torch.maximum(pi, threshold.to(dtype).abs())) + FIRE_EPS
    return torch.log1p(c * delta) / norm.unsqueeze(-1)


def fire_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``f_θ`` evaluated directly, ``relu(x·w1ᵀ + b1)·w2ᵀ + b2`` (the reference the piecewise form
    is tested against).

    Shapes: x ``(n,)``; w1 ``(w, 1)``, b1 ``(w,)``, w2 ``(h, w)``, b2 ``(h,)``; returns ``(n, h)``.
    """
    return torch.addmm(b2, torch.relu(torch.addmm(b1, x.unsqueeze(-1), w1.t())), w2.t())


def fire_segments(w1: Tensor, b1: Tensor) -> tuple[Tensor, Tensor]:
    """The kinks of ``relu(x·w1ᵀ + b1)`` and which units are active between them.

    Returns ``(kinks (m,), active (w, m + 1))``: the sorted ``-b1_k / w1_k`` of the ``m`` units
    with ``w1_k != 0``; segment ``s`` is ``kinks[s-1] <= x < kinks[s]`` (``searchsorted`` with
    ``right=True``), and ``active[k, s]`` (float 0/1) says whether unit ``k`` is positive there: a
    unit with ``w1_k > 0`` on the segments after its kink, ``w1_k < 0`` up to it, ``w1_k = 0``
    everywhere when ``b1_k > 0``. One device sync (the number of kinks).
    """
    w = w1.reshape(-1)
    sloped = w != 0
    kinks, order = torch.sort(-b1[sloped] / w[sloped])
    m = kinks.numel()
    rank = torch.zeros_like(w, dtype=torch.long)
    rank[sloped] = torch.empty_like(order).scatter_(0, order, torch.arange(m, device=w.device))
    seg = torch.arange(m + 1, device=w.device).unsqueeze(0)  # (1, m + 1)
    rank = rank.unsqueeze(1)
    active = torch.where(
        (w > 0).unsqueeze(1),
        seg > rank,
        torch.where((w < 0).unsqueeze(1), seg <= rank, (b1 > 0).unsqueeze(1).expand(-1, m + 1)),
    )
    return kinks, active.to(b1.dtype)


def _pieces(w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, ...]:
    """``(kinks (m,), active (w, m + 1), slope (h, m + 1), intercept (h, m + 1))``: on segment
    ``s`` head ``h`` of ``f_θ`` is ``slope[h, s]·x + intercept[h, s]``."""
    kinks, active = fire_segments(w1, b1)
    slope = w2 @ (active * w1.reshape(-1, 1))
    intercept = w2 @ (active * b1.unsqueeze(1)) + b2.unsqueeze(1)
    return kinks, active, slope, intercept


def _weight_grads(sums: Tensor, active: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> tuple:
    """The MLP's weight gradients from ``sums (2, h, m + 1)``: per head and segment, ``Σ g`` and
    ``Σ g·x`` of the output gradient ``g``."""
    a0, a1 = sums @ active.t()  # (h, w) each: Σ over the segments where a unit is active
    gw2 = a1 * w1.reshape(1, -1) + a0 * b1
    gw1 = (w2 * a1).sum(0).unsqueeze(1)
    gb1 = (w2 * a0).sum(0)
    gb2 = sums[0].sum(1)
    return gw1, gb1, gw2, gb2


class _PiecewiseMLP(torch.autograd.Function):
    """``f_θ`` over every element of ``x`` in its piecewise-linear form (module docstring):
    ``(b, i, j)`` inputs to ``(b, h, i, j)`` outputs."""

    @staticmethod
    @outside_autocast
    def forward(ctx, x, w1, b1, w2, b2):  # type: ignore[override]
        kinks, active, slope, intercept = _pieces(w1, b1, w2, b2)
        flat = x.reshape(-1)
        seg = torch.searchsorted(kinks, flat, right=True)  # (n,)
        out = slope.index_select(1, seg).mul_(flat).add_(intercept.index_select(1, seg))
        ctx.save_for_backward(x, seg, active, slope, w1, b1, w2)
        return out.view(slope.shape[0], *x.shape).transpose(0, 1)  # (h, b, i, j) -> (b, h, i, j)

    @staticmethod
    @outside_autocast
    def backward(ctx, grad):  # type: ignore[override]
        x, seg, active, slope, w1, b1, w2 = ctx.saved_tensors
        h, m1 = slope.shape
        g = grad.transpose(0, 1).reshape(h, -1)  # (h, n)
        flat = x.reshape(-1)
        sums = g.new_zeros(2, h, m1)  # per segment: Σ g and Σ g·x
        sums[0].index_add_(1, seg, g)
        sums[1].index_add_(1, seg, g * flat)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = (g * slope.index_select(1, seg)).sum(0).view_as(x)
        return gx, *_weight_grads(sums, active, w1, b1, w2)


_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
#: The C kernels' signatures (``native/fire.c``).
_SIGNATURES = {
    "relpos_fire_forward": [_PTR, _I64, _PTR, _I64, _PTR, *[_I64] * 4, *[_PTR] * 2, _I64]
    + [_PTR] * 3
    + [_I64],
    "relpos_fire_backward": [_PTR, _I64, _PTR, _I64, _PTR, *[_I64] * 4, *[_PTR] * 2, _I64]
    + [_PTR] * 6,
}


class FirePairs(PairBias):
    """FIRE's bias by the C kernels (``native/fire.c``): float32 on the CPU.

    :attr:`inputs` are ``psi (D,)``, ``ψ`` of every distance ``0 … D - 1`` the positions reach,
    and ``inv (b|1, i)``, one over each query's normaliser (both float64; the kernels read float32
    copies); ``slope`` and ``intercept (h, m + 1)``, the MLP's pieces. The pair ``(i, j)`` gets
    ``slope[h, s]·x + intercept[h, s]`` with ``x = psi[max(p_i - p_j, 0)]·inv_i`` and ``s`` its
    segment; the gradients reach ``c``, ``L`` and the MLP's weights through the inputs' graph.
    Built by :func:`fire_pairs`.
    """

    def __init__(
        self,
        lib: ctypes.CDLL,
        q_pos: Tensor,
        k_pos: Tensor,
        c: Tensor,
        threshold: Tensor,
        weights: tuple[Tensor, ...],
    ) -> None:
        self.lib, self.q_pos, self.k_pos = lib, q_pos.long().contiguous(), k_pos.long().contiguous()
        # ψ and the normalisers in float64: c's gradient is the small difference of two large
        # sums (through ψ and through the normalisers), which float32 would round away.
        c = c.abs().double()
        # Distances 0 … reach - 1: one row's, so rows at far-apart offsets keep a short table.
        reach = max(int((q_pos.amax(1) - k_pos.amin(1)).max()), 0) + 1
        psi = torch.log1p(c * torch.arange(reach, dtype=c.dtype))
        norm = torch.log1p(c * torch.maximum(self.q_pos.to(c.dtype), threshold.abs().double()))
        inv = 1.0 / (norm + FIRE_EPS)
        kinks, _, slope, intercept = _pieces(*weights)
        self.kinks = kinks.contiguous()
        self.psi, self.inv = psi.detach().float(), inv.detach().float()  # what the kernels read
        self.inputs = (psi, inv, slope.contiguous(), intercept.contiguous())
        self._sums: list[Tensor] | None = None

    @property
    def heads(self) -> int:
        return self.inputs[2].shape[0]

    def _tile(self, t: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> tuple:
        """The kernels' leading arguments for the tile ``t (b, h, bi, bj)``, after checking it."""
        (i0, i1), (j0, j1) = rows, cols
        qp, kp = self.q_pos, self.k_pos
        expected = (t.shape[0], self.heads, i1 - i0, j1 - j0)
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != expected:
            raise ValueError(
                f"FIRE's kernel needs a contiguous float32 tile of shape {expected}, got "
                f"{t.dtype} {tuple(t.shape)}"
            )
        if not (0 <= i0 <= i1 <= qp.shape[1] and 0 <= j0 <= j1 <= kp.shape[1]):
            raise ValueError(
                f"FIRE's tile rows {rows} and cols {cols} must lie inside the {qp.shape[1]} "
                f"queries and {kp.shape[1]} keys it was built for"
            )
        if qp.shape[0] not in (1, t.shape[0]) or kp.shape[0] not in (1, t.shape[0]):
            raise ValueError(
                f"FIRE's positions have batch {qp.shape[0]} (queries) and {kp.shape[0]} (keys); "
                f"the tile has batch {t.shape[0]}"
            )
        inv = self.inv
        q_bs = qp.stride(0) if qp.shape[0] > 1 else 0
        k_bs = kp.stride(0) if kp.shape[0] > 1 else 0
        return (
            qp.data_ptr() + i0 * qp.element_size(),
            q_bs,
            kp.data_ptr() + j0 * kp.element_size(),
            k_bs,
            inv.data_ptr() + i0 * inv.element_size(),
            t.shape[0],  # the kernels take (B, I, J, H)
            i1 - i0,
            j1 - j0,
            self.heads,
            self.psi.data_ptr(),
            self.kinks.data_ptr(),
            self.kinks.numel(),
        )

    def _forward(self, out: Tensor, rows: tuple[int, int], cols: tuple[int, int], add: int):
        """The tile's bias written into ``out`` (``add=0``) or added to it (``add=1``)."""
        args = self._tile(out, rows, cols)
        slope, intercept = self.inputs[2:]
        tail = (slope.data_ptr(), intercept.data_ptr(), out.data_ptr(), add)
        self.lib.relpos_fire_forward(*args, *tail)

    def add_(self, s: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        self._forward(s, rows, cols, 1)

    def values(self) -> Tensor:
        """The whole bias, ``(b, h, i, j)`` float32 (no graph)."""
        b = max(self.q_pos.shape[0], self.k_pos.shape[0])
        out = self.psi.new_empty(b, self.heads, self.q_pos.shape[1], self.k_pos.shape[1])
        self._forward(out, (0, out.shape[2]), (0, out.shape[3]), 0)
        return out

    def backward(self, grad: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        args = self._tile(grad, rows, cols)
        if self._sums is None:  # float64 sums: a call adds up to i·j terms into one entry
            self._sums = [torch.zeros(t.shape, dtype=torch.float64) for t in self.inputs]
        gpsi, ginv, gslope, gintercept = self._sums
        slope = self.inputs[2]
        self.lib.relpos_fire_backward(
            *args,
            slope.data_ptr(),
            grad.data_ptr(),
            gslope.data_ptr(),
            gintercept.data_ptr(),
            gpsi.data_ptr(),
            ginv.data_ptr() + rows[0] * ginv.element_size(),
        )

    def grads(self) -> tuple[Tensor, ...]:
        sums, self._sums = self._sums, None
        if sums is None:  # no tile was visible: the bias took part, with a zero gradient
            return tuple(torch.zeros_like(t) for t in self.inputs)
        return tuple(g.to(t.dtype) for g, t in zip(sums, self.inputs, strict=True))


class _FusedPairs(torch.autograd.Function):
    """:class:`FirePairs` over every pair at once, as a differentiable function of its inputs."""

    @staticmethod
    @outside_autocast
    def forward(ctx, pairs: FirePairs, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.pairs = pairs
        return pairs.values()

    @staticmethod
    @outside_autocast
    def backward(ctx, grad):  # type: ignore[override]
        pairs: FirePairs = ctx.pairs
        grad = grad.to(torch.float32).contiguous()
        pairs.backward(grad, (0, grad.shape[2]), (0, grad.shape[3]))
        return None, *pairs.grads()


def fire_pairs(
    q_pos: Tensor,
    k_pos: Tensor,
    c: Tensor,
    threshold: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
) -> FirePairs | None:
    """FIRE's bias as a :class:`~relpos.functional.pair_bias.PairBias` run by the C kernel
    (arguments as :func:`fire_bias`), or None where the kernel does not apply: a dtype other than
    float32, a device other than the CPU, a hidden width over 255 (segments fit a byte), inside
    ``torch.compile``, empty positions, or no kernel (:func:`relpos.native.load`)."""
    if c.dtype != torch.float32 or q_pos.device.type != "cpu" or w1.shape[0] > 255:
        return None
    if torch.compiler.is_compiling() or not (q_pos.numel() and k_pos.numel()):
        return None
    lib = load("fire", _SIGNATURES)
    if lib is None:
        return None
    return FirePairs(lib, q_pos, k_pos, c, threshold.to(c.dtype), (w1, b1, w2, b2))


def fire_bias(
    q_pos: Tensor,
    k_pos: Tensor,
    c: Tensor,
    threshold: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    *,
    by_distance: bool = True,
) -> Tensor:
    """The FIRE bias of every pair for every head (causal attention).

    Args:
        q_pos: ``(b|1, i)`` integer query positions; k_pos: ``(b|1, j)`` key positions.
        c, threshold: scalars ``c`` and ``L`` (:func:`fire_inputs`).
        w1, b1, w2, b2: the MLP ``Linear(1, w)``, ReLU, ``Linear(w, h)``.
        by_distance: whether a table by distance may be taken (below): False evaluates the
            MLP at each pair, with no device value read (decoding's few queries, where the
            pairs are no more than the distances).

    Returns:
        ``(b|1, h, i, j)`` in ``c``'s dtype (at least float32); memory ``O(pairs·h)``, the output's.

    When every query sits at or below the threshold (``p_i <= L``: all of them share the
    normaliser ``ψ(L)``), the bias is a function of the distance alone: the MLP runs once per
    distance ``0 … max δ`` and the table is gathered (the same numbers; reading ``max p_i``,
    ``L`` and ``max δ`` to decide and size it takes three device syncs).
    """
    weights = (w1, b1, w2, b2)
    dtype = torch.promote_types(c.dtype, torch.float32)
    some = q_pos.numel() and k_pos.numel()
    if by_distance and some and bool(q_pos.max() <= threshold.detach().abs()):
        delta = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).clamp_min(0)  # (b, i, j)
        d = torch.arange(int(delta.max()) + 1, device=q_pos.device).unsqueeze(0)  # (1, D)
        peak = torch.full_like(d[:, :1], int(q_pos.max()))  # a query whose normaliser is ψ(L)
        x = fire_inputs(peak, peak - d, c, threshold)  # (1, 1, D): ψ(d) / ψ(L)
        table = _PiecewiseMLP.apply(x, *(t.to(dtype) for t in weights))  # (1, h, 1, D)
        return gather_table(table, delta)
    pairs = fire_pairs(q_pos, k_pos, c.to(dtype), threshold, *(t.to(dtype) for t in weights))
    if pairs is not None:
        return _FusedPairs.apply(pairs, *pairs.inputs)
    x = fire_inputs(q_pos, k_pos, c, threshold)  # (b, i, j)
    return _PiecewiseMLP.apply(x, *(t.to(dtype) for t in weights))
