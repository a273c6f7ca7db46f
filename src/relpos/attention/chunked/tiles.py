"""The ``chunked`` backend's general path: query × key tiles with a streaming softmax.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` rows of a
relative table; ``bi``/``bj`` the sizes of one query/key block (a *tile*).

Any :class:`~relpos.Positions` (padding, packing, KV cache), any scheme, dropout. Each tile's
logits ``q·kᵀ/√d + bias`` fold into a running row maximum, normaliser and output (the online
softmax of Milakov & Gimelshein, 2018; FlashAttention, Dao et al., 2022), so nothing ``(i, j)`` is
held. The backward pass recomputes each tile from the saved row log-sum-exp (FlashAttention-2):
``dS = P ⊙ (dP - rowsum(dO ⊙ O))``. Tiles the mask rules out are skipped (:mod:`.plan`).

Scheme terms enter a tile in one of these ways:

* a :class:`~relpos.schemes.RelativeScheme` (T5, Shaw, Music Transformer, Transformer-XL): the
  logit term is ``relative_logits`` ``(b, h, bi, R)`` per query block, gathered per tile by
  ``relative_index``; its gradient is scattered back into ``(b, h, bi, R)`` and pushed through
  ``relative_logits`` once per block (once per call for a ``query_independent`` term). A
  ``q·Eᵀ`` term (``relative_keys``, plus ``relative_row_bias``) reads its keys once per call,
  and their gradients are summed over the blocks and pushed once (:class:`.relative.KeyedTerm`).
  A key term (DeBERTa's p2c) is ``relative_key_logits`` ``(b, h, j, R)``, computed once per call
  and gathered per tile by the transposed index; its gradient is scattered back per tile and
  pushed through once. A value term accumulates the attention mass per row with the same
  rescaling as ``p·v``;
* a :class:`~relpos.schemes.DistanceBiasScheme` (KERPLE, learned ALiBi, DPB, Sandwich): like
  T5, one table per call over the call's distances (``distance_table``), gathered per tile by
  distance, its gradient scattered per tile and pushed through the function once;
* a :class:`~relpos.schemes.PairBiasScheme` (FIRE) whose ``pair_bias`` has a kernel for the
  call: the kernel adds each tile's bias into the logits and sums its inputs' gradients from each
  tile's ``dS``; they are pushed through the scheme's parameters once per call;
* any other scheme: its own ``score_bias``/``value_term`` on the tile's sliced positions, with
  gradients by ``torch.autograd.grad`` per tile.

Dropout draws each tile's keep-mask in a fixed order; the backward pass replays the generator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...functional.dropout import drop_mask
from ...functional.dtypes import compute_dtype, outside_autocast
from ...functional.pair_bias import PairBias
from ...functional.skew import gather_relative, scatter_relative, scatter_table
from .grads import GradSink, push_grad
from .job import Job
from .kernels import flush_exp_, sum_to
from .relative import KeyedTerm

__all__ = ["DEFAULT_BLOCK", "TiledAttention"]

#: Default (query, key) tile sizes (tuned on a 2-core CPU, fp32, h=8, d=64).
DEFAULT_BLOCK = (256, 512)

#: A ``q·Eᵀ`` term with more rows than this is computed per query block for the rows its tiles
#: reach only (Transformer-XL, a Music Transformer with a large ``M``). Below it the term is
#: small next to the tiles' ``q·kᵀ``, and finding the rows (an index pass per tile) costs more.
FEW_ROWS = 256


def _keep_mask(p: Tensor, dropout_p: float) -> Tensor:
    drop, scale = drop_mask(p.shape, dropout_p, p.device)
    return torch.where(drop, 0.0, scale).to(p.dtype)


def _rng_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _ReplayRng:
    """Run with the RNG state the forward pass started from; restore the current one after."""

    def __init__(self, device: torch.device, state: Tensor | None) -> None:
        self.device, self.state, self.saved = device, state, None

    def __enter__(self) -> None:
        if self.state is not None:
            self.saved = _rng_state(self.device)
            _set_rng_state(self.device, self.state)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            _set_rng_state(self.device, self.saved)


def _scatter(drel: Tensor, index: Tensor, ds: Tensor) -> None:
    """Add a tile's ``dS (b, h, bi, bj)`` into the gradient of a query-independent term
    ``drel (1|b, h, 1, R)``."""
    if drel.shape[0] == 1:
        scatter_table(drel, index, ds)
    else:
        part = ds.new_zeros(*ds.shape[:-1], drel.shape[-1])
        drel += sum_to(scatter_relative(part, index, ds), drel.shape)


def _tile_terms(
    job: Job, i0: int, i1: int, j0: int, j1: int, masked: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``(blocked (b|1, 1, bi, bj) bool | None, relative index (b|1, bi, bj) | None)``."""
    blocked = ~job.tile_mask(i0, i1, j0, j1) if masked else None
    index = None
    if job.rel_bias or job.rel_value or job.rel_key or job.distance:
        qp, kp = job.q_positions[i0:i1], job.k_positions[j0:j1]
        index = job.tile_index(qp, kp)
    return blocked, index


def _keyed_logits(
    job: Job, keyed: KeyedTerm, qb: Tensor, i0: int, i1: int, tiles: list
) -> tuple[Tensor, int]:
    """``(rel, lo)``: a query block's ``q·Eᵀ`` term from row ``lo`` on; past :data:`FEW_ROWS`
    rows, only the rows its tiles reach."""
    lo, hi = _block_rows(job, i0, i1, tiles) if job.num_rel > FEW_ROWS else (0, None)
    return keyed.logits(qb, lo, hi), lo


def _block_rows(job: Job, i0: int, i1: int, tiles: list) -> tuple[int, int]:
    """The relative rows ``[lo, hi)`` that a query block's tiles reach (one host sync). The
    indices are recomputed per tile later rather than held for the whole block."""
    bounds = []
    for j0, j1, _ in tiles:
        index = job.tile_index(job.q_positions[i0:i1], job.k_positions[j0:j1])
        if index.numel():
            bounds.append(torch.stack(torch.aminmax(index)))
    if not bounds:
        return 0, 0
    ranges = torch.stack(bounds)
    lo, hi = torch.stack((ranges[:, 0].min(), ranges[:, 1].max())).tolist()
    return lo, hi + 1


def _scores(
    job: Job,
    qb: Tensor,
    kb: Tensor,
    bounds: tuple[int, int, int, int],
    rel: Tensor | None,
    masked: bool,
    bias_leaf: Tensor | None = None,
    rel_k: Tensor | None = None,
    pairs: PairBias | None = None,
    rel_lo: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Scaled, biased, masked logits of one tile, ``(b, h, bi, bj)``.

    ``rel`` holds the relative rows from ``rel_lo`` on; ``rel_k`` is the key term
    ``(b, h, j, R)`` of every key (``relative_key_logits``); ``pairs`` the call's ``pair_bias``,
    which adds the tile's bias itself. Returns
    ``(s, blocked, index, bias)``; ``bias`` is the scheme's ``score_bias`` with a graph (for its
    gradient) when ``bias_leaf`` is given and the scheme has no relative form.
    """
    i0, i1, j0, j1 = bounds
    blocked, index = _tile_terms(job, i0, i1, j0, j1, masked)
    s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(job.scale)
    bias = None
    if rel_k is not None:
        s.add_(gather_relative(rel_k[:, :, j0:j1], index.transpose(-1, -2)).transpose(-1, -2))
    if rel is not None:
        s.add_(gather_relative(rel, index - rel_lo if rel_lo else index))
    elif pairs is not None:
        pairs.add_(s, (i0, i1), (j0, j1))
    elif job.has_bias and not job.rel_bias:
        if bias_leaf is not None:
            with torch.enable_grad():  # slice inside: a log_decay leaf's slice keeps its graph
                qp, kp = job.q_positions[i0:i1], job.k_positions[j0:j1]
                bias = job.scheme.score_bias(bias_leaf, qp, kp)
        else:
            qp, kp = job.q_positions[i0:i1], job.k_positions[j0:j1]
            bias = job.scheme.score_bias(qb, qp, kp)
        if bias is not None:
            s.add_(bias.detach().to(s.dtype))
    if blocked is not None:
        s.masked_fill_(blocked, -math.inf)
    return s, blocked, index, bias


def _tiles_forward(job: Job, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor]:
    """Streaming softmax over the plan's tiles.

    Returns unnormalised row statistics over all queries: ``m (b, h, i)`` running maximum,
    ``norm (b, h, i)`` Σ exp(s - m), ``acc (b, h, i, d)`` Σ exp(s - m)·v, and, for a relative value
    term, ``mass (b, h, i, R)``.
    """
    b, h, n, _ = q.shape
    m = q.new_full((b, h, n), torch.finfo(q.dtype).min)
    norm = q.new_zeros(b, h, n)
    acc = q.new_zeros(b, h, n, v.shape[-1])
    mass = q.new_zeros(b, h, n, job.num_rel) if job.rel_value else None
    s_ = job.scheme
    rel_const = keyed = None
    if job.query_independent:
        rel_const = job.constant_logits(q)  # compute once
    elif job.keyed:
        keyed = KeyedTerm(s_, q.dtype, grads=False)
    rel_k = s_.relative_key_logits(k) if job.rel_key else None  # (b, h, j, R), once
    pairs = s_.pair_bias(q, job.q_positions, job.k_positions) if job.pairwise else None
    for (i0, i1), tiles in zip(job.plan.q_blocks, job.plan.tiles, strict=True):
        qb = q[:, :, i0:i1]
        qp = job.q_positions[i0:i1]
        lo = 0
        if rel_const is not None:
            rel = rel_const
        elif keyed is not None:
            rel, lo = _keyed_logits(job, keyed, qb, i0, i1, tiles)
        else:
            rel = s_.relative_logits(qb) if job.rel_bias else None
        mb, nb, ab = m[:, :, i0:i1], norm[:, :, i0:i1], acc[:, :, i0:i1]
        massb = mass[:, :, i0:i1] if mass is not None else None
        first = True  # the block's first tile: assign instead of rescale-and-add
        for j0, j1, masked in tiles:
            s, blocked, index, _ = _scores(
                job,
                qb,
                k[:, :, j0:j1],
                (i0, i1, j0, j1),
                rel,
                masked,
                rel_k=rel_k,
                pairs=pairs,
                rel_lo=lo,
            )
            if blocked is not None and bool(blocked.all()):
                continue
            m_new = torch.maximum(mb, s.amax(-1))  # finite: mb starts at finfo.min
            p = flush_exp_(s.sub_(m_new.unsqueeze(-1)))
            if blocked is not None:
                p.masked_fill_(blocked, 0.0)
            alpha = None if first else torch.exp(mb - m_new).unsqueeze(-1)
            if first:
                nb.copy_(p.sum(-1))
            else:
                nb.mul_(alpha.squeeze(-1)).add_(p.sum(-1))
            if job.dropout_p > 0:
                p = p * _keep_mask(p, job.dropout_p)
            pv = torch.matmul(p, v[:, :, j0:j1])
            ab.copy_(pv) if first else ab.mul_(alpha).add_(pv)
            if job.rel_value:
                if not first:
                    massb.mul_(alpha)
                scatter_relative(massb, index, p)
            elif job.has_value:
                term = s_.value_term(p, qp, job.k_positions[j0:j1])
                if term is not None:
                    ab.add_(term.to(ab.dtype))
            mb.copy_(m_new)
            first = False
    out = {"m": m, "norm": norm, "acc": acc}
    if mass is not None:
        out["mass"] = mass
    return out


def _tiles_backward(
    job: Job,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    lse: Tensor,
    delta: Tensor,
    dmass: Tensor | None,
    needs_q: bool,
    sink: GradSink,
    needs_k: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute every tile from the final ``lse`` and return ``dq, dk, dv``; the scheme's
    parameter gradients go into ``sink``.

    ``delta (b, h, i)`` is ``rowsum(dO ⊙ O)``; ``dmass (b, h, i, R)`` the gradient of the relative
    value mass.
    """
    b, h, _, _ = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    s_, params = job.scheme, job.params
    need_bias_grad = job.has_bias and (needs_q or any(p.requires_grad for p in params))
    # A query-independent relative term (T5) is computed once; its gradient is the sum over
    # tiles of dS scattered by relative index.
    rel_const = drel_const = None
    if job.query_independent:
        with torch.enable_grad():
            probe = job.constant_logits(q)
        rel_const = probe
        if probe.requires_grad:
            drel_const = q.new_zeros(probe.shape[0], h, 1, job.num_rel)
    # A q·Eᵀ term: the keys once per call, their gradient summed over the blocks, pushed once.
    keyed = KeyedTerm(s_, q.dtype, grads=True) if job.keyed else None
    # A key term is computed once for every key; its gradient is scattered per tile.
    rel_k = drel_k = k_leaf = None
    if job.rel_key:
        with torch.enable_grad():
            k_leaf = k.detach().requires_grad_(needs_k)
            rel_k = s_.relative_key_logits(k_leaf)
        if rel_k.requires_grad:
            drel_k = torch.zeros_like(rel_k)
    # A per-pair kernel is built once (its inputs keep a graph) and sums their gradients per tile.
    pairs = None
    if job.pairwise:
        with torch.enable_grad():
            pairs = s_.pair_bias(q, job.q_positions, job.k_positions)
    pair_grads = pairs is not None and any(t.requires_grad for t in pairs.inputs)
    # score_bias per tile, differentiated by autograd (no relative, distance or pair form)
    tile_bias_grad = need_bias_grad and not (job.rel_bias or job.distance or pairs is not None)
    bias_pushed = False  # whether a tile pushed a gradient through score_bias
    for (i0, i1), tiles in zip(job.plan.q_blocks, job.plan.tiles, strict=True):
        qb, dob = q[:, :, i0:i1], do[:, :, i0:i1]
        qp = job.q_positions[i0:i1]
        lse_b, delta_b = lse[:, :, i0:i1].unsqueeze(-1), delta[:, :, i0:i1].unsqueeze(-1)
        dqb = dq[:, :, i0:i1]
        rel = drel = qb_leaf = None
        lo = 0
        if rel_const is not None:
            rel = rel_const.detach()
        elif keyed is not None:
            rel, lo = _keyed_logits(job, keyed, qb, i0, i1, tiles)
            if keyed.needs_grads(needs_q):
                drel = q.new_zeros(rel.shape)
        elif job.rel_bias:
            with torch.enable_grad():
                qb_leaf = qb.detach().requires_grad_(needs_q)
                rel = s_.relative_logits(qb_leaf)
            if rel.requires_grad:
                drel = q.new_zeros(b, h, i1 - i0, job.num_rel)
        bias_leaf = None
        if tile_bias_grad:
            qb_leaf = bias_leaf = qb.detach().requires_grad_(needs_q)
        dmass_b = dmass[:, :, i0:i1] if dmass is not None else None
        for j0, j1, masked in tiles:
            kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]
            bounds = (i0, i1, j0, j1)
            s, blocked, index, bias = _scores(
                job,
                qb,
                kb,
                bounds,
                None if rel is None else rel.detach(),
                masked,
                bias_leaf,
                rel_k=None if rel_k is None else rel_k.detach(),
                pairs=pairs,
                rel_lo=lo,
            )
            if blocked is not None and bool(blocked.all()):
                continue
            p = flush_exp_(s.sub_(lse_b))
            if blocked is not None:
                p.masked_fill_(blocked, 0.0)
            keep = _keep_mask(p, job.dropout_p) if job.dropout_p > 0 else None
            pd = p if keep is None else p * keep  # the probabilities that weigh v
            dp = torch.matmul(dob, vb.transpose(-1, -2))
            if job.rel_value:
                dp.add_(gather_relative(dmass_b, index))
            elif job.has_value:
                with torch.enable_grad():
                    p_leaf = pd.detach().requires_grad_(True)
                    term = s_.value_term(p_leaf, qp, job.k_positions[j0:j1])
                if term is not None:
                    grads = torch.autograd.grad(term, [p_leaf, *params], dob, allow_unused=True)
                    dp.add_(grads[0])
                    sink.add(grads[1:])
            if keep is not None:
                dp.mul_(keep)
            ds = dp.sub_(delta_b).mul_(p)  # dS = P ⊙ (dP - D)
            dv[:, :, j0:j1] += torch.matmul(pd.transpose(-1, -2), dob)
            if drel_k is not None:
                scatter_relative(drel_k[:, :, j0:j1], index.transpose(-1, -2), ds.transpose(-1, -2))
            if drel is not None:
                scatter_relative(drel, index - lo if lo else index, ds)
            elif drel_const is not None:
                _scatter(drel_const, index, ds)
            elif pair_grads:
                pairs.backward(ds, (i0, i1), (j0, j1))
            elif bias is not None and bias.requires_grad:
                push_grad(bias, sum_to(ds, bias.shape), qb_leaf if needs_q else None, dqb, sink)
                bias_pushed = True
            ds.mul_(job.scale)
            dqb += torch.matmul(ds, kb)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb)
        if drel is not None and keyed is not None:
            keyed.add_grads(drel, qb, dqb, needs_q, lo)
        elif drel is not None:
            push_grad(rel, sum_to(drel, rel.shape), qb_leaf if needs_q else None, dqb, sink)
    if keyed is not None:
        keyed.push(sink)
    if drel_const is not None:
        push_grad(rel_const, drel_const.to(rel_const.dtype), None, dq, sink)
    if drel_k is not None:
        push_grad(rel_k, drel_k, k_leaf if needs_k else None, dk, sink)
    if tile_bias_grad and not bias_pushed:
        # No tile was visible: the bias still took part, so its parameters get zeros (as eager's).
        with torch.enable_grad():
            bias = s_.score_bias(q[:, :, :1], job.q_positions[0:1], job.k_positions[0:1])
        if bias is not None and bias.requires_grad:
            push_grad(bias, torch.zeros_like(bias), None, None, sink)
    if pair_grads:
        kept = [(t, g) for t, g in zip(pairs.inputs, pairs.grads(), strict=True) if t.requires_grad]
        push_grad([t for t, _ in kept], [g for _, g in kept], None, None, sink)
    return dq, dk, dv


def _normalise(stats: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(lse (b, h, i), out (b, h, i, d), mass (b, h, i, R) | None)`` from running statistics.

    Rows with no key (``norm`` exactly 0) get ``lse = +inf`` (so recomputed probabilities are 0)
    and zeros; a row of NaN logits keeps its NaN (``norm`` NaN), as in ``eager``.
    """
    norm = stats["norm"]
    has = norm != 0
    safe = torch.where(has, norm, 1.0)
    out = torch.where(has.unsqueeze(-1), stats["acc"] / safe.unsqueeze(-1), 0.0)
    lse = torch.where(has, stats["m"] + torch.log(safe), math.inf)
    mass = stats.get("mass")
    if mass is not None:
        mass = torch.where(has.unsqueeze(-1), mass / safe.unsqueeze(-1), 0.0)
    return lse, out, mass


class TiledAttention(torch.autograd.Function):
    """The general path (see the module docstring)."""

    @staticmethod
    @outside_autocast
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, job: Job, *params: Tensor) -> Tensor:
        del params  # reached through job.scheme; listed so that autograd tracks them
        dtype = compute_dtype(q.dtype)
        qf, kf, vf = (t.to(dtype) for t in (q, k, v))
        rng_state = _rng_state(q.device) if job.dropout_p > 0 else None
        lse, out, mass = _normalise(_tiles_forward(job, qf, kf, vf))
        if mass is not None:
            out = out + job.value_term(mass)
        ctx.job, ctx.rng_state = job, rng_state
        ctx.save_for_backward(qf, kf, vf, out, lse, *(() if mass is None else (mass,)))
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @outside_autocast
    def backward(ctx, grad_out: Tensor):
        job: Job = ctx.job
        qf, kf, vf, out, lse, *rest = ctx.saved_tensors
        do = grad_out.to(qf.dtype)
        delta = (do * out).sum(-1)  # rowsum(dO ⊙ O), O including the value term
        sink = GradSink(job.params)
        dmass = job.value_grads(rest[0], do, sink) if rest else None
        with _ReplayRng(qf.device, ctx.rng_state):
            dq, dk, dv = _tiles_backward(
                job,
                qf,
                kf,
                vf,
                do,
                lse,
                delta,
                dmass,
                ctx.needs_input_grad[0],
                sink,
                needs_k=ctx.needs_input_grad[1],
            )
        t = grad_out.dtype
        return dq.to(t), dk.to(t), dv.to(t), None, *sink.result()
