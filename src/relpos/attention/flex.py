"""The ``flex`` backend: FlexAttention (``torch.nn.attention.flex_attention``) with a ``score_mod``
per scheme and a ``BlockMask`` for causal, padding and document masking.

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries, ``j`` keys, ``d`` head dim, ``R`` rows of a
relative table.

* ``score_mod`` adds the scheme's term to each scaled logit, from the tokens' *positions* (never
  their indices): ALiBi ``±slope_h·(p_j - p_i)``; relative-form schemes (T5, Shaw keys, Music
  Transformer) ``rel[b, h, i, r(p_j - p_i)]`` where ``rel = relative_logits(q)`` is ``(b, h, i, R)``
  (``q·Eᵀ`` for Shaw and the Music Transformer, the bucket table for T5) and ``r`` a lookup table
  from distance to relative row; a distance-function bias (KERPLE) ``table[h, p_j - p_i - lo]``
  from its table over the distances the call can see, so nothing ``(i, j)`` is materialised;
  a relative key term (DeBERTa's p2c) adds ``rel_k[b, h, j, r(p_j - p_i)]`` with ``rel_k =
  relative_key_logits(k)`` ``(b, h, j, R)``. A ``key_bias`` without that form is unsupported.
  A decay bias (the Forgetting Transformer) adds ``c[b, h, i] - c[b, h, j]`` from the positions'
  per-token ``log_decay`` (float64; the difference cast to the score's dtype).
* Compiled once per shape (and scheme, layout): the first call at a new shape compiles for seconds
  (``relpos bench`` reports it as ``first call s``). Past Dynamo's recompile limit
  (``torch._dynamo.config.recompile_limit``, 8 by default) FlexAttention runs unfused, the same
  numbers from an ``(i, j)`` score matrix; a job with many shapes (``relpos bench``) raises it.
  Decoding with a KV cache is a new shape at every step, which is why ``auto`` leaves ``flex`` to
  training.
* The ``BlockMask`` says which pairs may attend (same segment, real tokens, and ``p_j <= p_i`` when
  causal); blocks with no allowed pair are skipped. For plain positions it is cached per shape.
* Shaw's value term is not expressible (FlexAttention returns no probabilities): unsupported.
* On CPU, FlexAttention is compiled by Inductor's C++ backend for inference only: ``flex`` runs
  there without gradients (:func:`flex_supports` says so, ``auto`` never picks it for training).
  On CUDA it runs forward and backward (gradients of a learned table flow through the captured
  ``rel``; ``tests/test_cuda.py`` checks them against float64 ``eager`` where a GPU is present).
  There, head dims under :data:`CUDA_MIN_HEAD_DIM` are zero-padded (``q``, ``k`` and ``v``; the
  extra output columns dropped), and a learned table with gradients runs with
  :data:`SMALL_BLOCKS`, as does any kernel that ran out of shared memory with the defaults.
* Plain positions (self-attention, one contiguous sequence per row) read distances as
  ``kv_idx - q_idx`` and mask causally by index, with no mask at all when bidirectional.
* On CPU, ``q`` and ``k`` of head dim 8 or 16 are zero-padded to 24 (``q·k`` is unchanged; ``v``
  is not padded): Inductor's CPU kernel (torch 2.13, AVX2) computes ``q·kᵀ`` for ``d % 8 == 0``,
  ``d < 24`` with a micro-GEMM that, for a key block of length ``≡ 8 (mod 16)`` (any ``j ≤ 128``
  with ``j % 16 == 8``: 8, 24, 40, ..., 120), reads 8 keys past the block and writes 8 scores past
  its end, over the running maxima (and, for fewer than 8 queries, sums) of the query block: rows
  0-7 come out 0, NaN or wrong whenever the memory after the keys holds large values, silently.
  At ``d = 24`` the kernel takes its other, bounds-checked path. ``tests/test_flex_cpu.py`` has a
  canary that says when upstream is fixed.

Reference: Dong et al. (2024), "Flex Attention: A Programming Model for Generating Optimized
Attention Kernels"; the PyTorch ``flex_attention`` docs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..determinism import alert_atomic_sums
from ..functional.dtypes import outside_autocast
from ..positions import PAD_SEGMENT, Positions
from ..schemes.base import (
    LOGIT_HOOKS,
    DecayBiasScheme,
    DistanceBiasScheme,
    LinearBiasScheme,
    RelativeScheme,
    Scheme,
)
from .contract import (
    empty_attention,
    is_contiguous_self,
    is_empty,
    needs_grad,
    propagate_nonfinite,
    relative_rows,
    rows_with_keys,
    validate_attention_inputs,
    zero_padding_keys,
)
from .memo import BoundedCache

__all__ = ["flex_attention_backend", "flex_available", "flex_supports"]

try:  # FlexAttention appeared in torch 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - old torch
    create_block_mask = flex_attention = None

_compiled: Callable[..., Tensor] | None = None
#: Block masks of plain positions by (i, j, causal, device): the 16 most recently used.
_BLOCK_MASKS = BoundedCache(16, cost=lambda _: 1)
#: The smallest head dim Inductor's CUDA FlexAttention kernel takes; smaller ones are zero-padded.
CUDA_MIN_HEAD_DIM = 16
#: Triton block sizes for kernels that would otherwise ask for more shared memory than the GPU
#: has. On an H100 (torch 2.11) Inductor's default forward kernel for a learned T5 or Music
#: Transformer table with gradients at d=64 asks for 272 KiB of its 227 KiB; these compile
#: (forward 64×64 in one stage, backward 32×32).
SMALL_BLOCKS = {
    "BLOCK_M": 64,
    "BLOCK_N": 64,
    "num_stages": 1,
    "BLOCK_M1": 32,
    "BLOCK_N1": 32,
    "BLOCK_M2": 32,
    "BLOCK_N2": 32,
}
#: ``(scheme type, device, grad)`` whose kernels ran out of shared memory with the defaults.
_NEEDS_SMALL_BLOCKS: set[tuple] = set()
#: Head dim ``q`` and ``k`` are zero-padded to on CPU when ``d % 8 == 0`` and ``d < 24``: the
#: smallest that avoids the CPU kernel's out-of-bounds ``q·kᵀ`` path (``K % VLEN == 0 and
#: 24 * BLOCK_M > K``, ``BLOCK_M = 1``) for both AVX2 (``VLEN = 8``) and AVX-512 (``VLEN = 16``).
_CPU_SAFE_HEAD_DIM = 24


def flex_available() -> bool:
    """Whether FlexAttention can be imported."""
    return flex_attention is not None


def flex_supports(
    scheme: Scheme, *, device: torch.device | None = None, needs_grad: bool = False
) -> bool:
    """Whether :func:`flex_attention_backend` runs ``scheme`` on ``device``.

    Not with a value term (Shaw values), not with gradients on CPU (Inductor compiles
    FlexAttention's CPU kernel for inference only), a bias only from a
    :class:`~relpos.schemes.RelativeScheme`, a :class:`~relpos.schemes.LinearBiasScheme`, a
    :class:`~relpos.schemes.DistanceBiasScheme` or a :class:`~relpos.schemes.DecayBiasScheme`,
    and a key bias only from a :class:`~relpos.schemes.RelativeScheme`
    (``relative_key_logits``).
    """
    if not flex_available() or "value_term" in scheme.hooks:
        return False
    device = torch.device("cpu") if device is None else torch.device(device)
    if needs_grad and device.type == "cpu":
        return False
    if "key_bias" in scheme.hooks and not isinstance(scheme, RelativeScheme):
        return False
    if "score_bias" not in scheme.hooks:
        return True
    return isinstance(
        scheme, LinearBiasScheme | RelativeScheme | DistanceBiasScheme | DecayBiasScheme
    )


def _compiled_flex() -> Callable[..., Tensor]:
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _mask_mod(q_positions: Positions, k_positions: Positions, causal: bool):
    qb, kb = q_positions.batch, k_positions.batch
    qpos, qseg, kpos, kseg = q_positions.pos, q_positions.seg, k_positions.pos, k_positions.seg

    def mask_mod(b, h, q_idx, kv_idx):
        bq = b if qb > 1 else 0
        bk = b if kb > 1 else 0
        sq, sk = qseg[bq, q_idx], kseg[bk, kv_idx]
        ok = (sq == sk) & (sq != PAD_SEGMENT)
        if causal:
            ok = ok & (kpos[bk, kv_idx] <= qpos[bq, q_idx])
        return ok

    return mask_mod


def _causal_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _block_mask(q_positions: Positions, k_positions: Positions, causal: bool, device):
    """The ``BlockMask`` of the allowed pairs, or None for plain bidirectional attention (every
    pair). Plain causal positions take an index-only ``mask_mod``, cached per shape."""
    b = max(q_positions.batch, k_positions.batch)
    i, j = len(q_positions), len(k_positions)
    if not is_contiguous_self(q_positions, k_positions):
        mask_mod = _mask_mod(q_positions, k_positions, causal)
        return create_block_mask(mask_mod, b, None, i, j, device=device)
    if not causal:
        return None
    return _BLOCK_MASKS.get_or_build(
        (i, j, str(device)), lambda: create_block_mask(_causal_mod, 1, None, i, j, device=device)
    )


def _score_mod(
    scheme: Scheme, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
) -> tuple[Callable | None, list[Tensor]]:
    """The scheme's ``score_mod`` and the tensors it reads (whose gradients FlexAttention's
    backward pass sums by atomic adds)."""
    if not scheme.hooks & LOGIT_HOOKS:
        return None, []
    qb, kb = q_positions.batch, k_positions.batch
    qpos, kpos = q_positions.pos, k_positions.pos

    if is_contiguous_self(q_positions, k_positions):

        def distance(b, q_idx, kv_idx):  # p_j - p_i, no position loads
            return kv_idx - q_idx

    else:

        def distance(b, q_idx, kv_idx):  # p_j - p_i
            return kpos[b if kb > 1 else 0, kv_idx] - qpos[b if qb > 1 else 0, q_idx]

    if isinstance(scheme, LinearBiasScheme):
        slopes = scheme.slopes.to(device=q.device, dtype=torch.float32)
        causal = scheme.causal

        def alibi_mod(score, b, h, q_idx, kv_idx):
            dist = distance(b, q_idx, kv_idx).float()
            dist = dist if causal else -dist.abs()
            return score + slopes[h] * dist

        return alibi_mod, [slopes]
    if isinstance(scheme, DecayBiasScheme):
        cq, ck = scheme.decays(q_positions, k_positions)  # (b, h, i), (b, h, j): float64

        def decay_mod(score, b, h, q_idx, kv_idx):
            c_i, c_j = cq[b if qb > 1 else 0, h, q_idx], ck[b if kb > 1 else 0, h, kv_idx]
            return score + (c_i - c_j).to(score.dtype)

        return decay_mod, [cq, ck]
    if isinstance(scheme, DistanceBiasScheme):
        lo, table = scheme.distance_table(q_positions, k_positions)  # (h, D)
        table = table.to(device=q.device, dtype=torch.float32)

        last = table.shape[-1] - 1

        def distance_mod(score, b, h, q_idx, kv_idx):  # clamped: pairs with padding (masked)
            return score + table[h, torch.clamp(distance(b, q_idx, kv_idx) - lo, 0, last)]

        return distance_mod, [table]
    lut, offset = relative_rows(scheme, q_positions, k_positions, q.device)
    last_entry = lut.shape[0] - 1

    def entry(b, q_idx, kv_idx):  # clamped: pairs with padding may lie outside lut (masked)
        return torch.clamp(distance(b, q_idx, kv_idx) + offset, 0, last_entry)

    rel_k = None
    if "key_bias" in scheme.hooks:
        rel_k = scheme.relative_key_logits(k).float()  # (b, h, j, R)

        def key_mod(score, b, h, q_idx, kv_idx):
            return score + rel_k[b, h, kv_idx, lut[entry(b, q_idx, kv_idx)]]

        if "score_bias" not in scheme.hooks:
            return key_mod, [rel_k]
    rel = scheme.relative_logits(q).float()  # (b|1, h, i|1, R)
    per_query, rb = rel.shape[2] > 1, rel.shape[0]
    if not per_query and rb == 1 and rel_k is None:
        # One table for every query and row (T5): read it per distance, (h, hi - lo + 1), so that
        # the backward pass spreads its atomic adds over every distance instead of R buckets.
        by_distance = rel[0, :, 0, :][:, lut]

        def bucket_mod(score, b, h, q_idx, kv_idx):
            return score + by_distance[h, entry(b, q_idx, kv_idx)]

        return bucket_mod, [by_distance]

    def relative_mod(score, b, h, q_idx, kv_idx):
        row = lut[entry(b, q_idx, kv_idx)]
        return score + rel[b if rb > 1 else 0, h, q_idx if per_query else 0, row]

    if rel_k is None:
        return relative_mod, [rel]

    def both_mod(score, b, h, q_idx, kv_idx):
        return key_mod(relative_mod(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return both_mod, [rel, rel_k]


@outside_autocast
def flex_attention_backend(
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
    """Attention through compiled FlexAttention (see the module docstring for what it supports).

    Shapes:
        q: ``(b, h, i, d)``; k, v: ``(b, h, j, d)`` (already rotated); returns ``(b, h, i, d)`` in
        ``q``'s dtype. Queries that may attend to no key get 0.

    Raises:
        ValueError: unsupported scheme, gradients on CPU, or dropout in training.
        RuntimeError: under ``torch.use_deterministic_algorithms(True)`` (a warning with
            ``warn_only``), when a tensor the ``score_mod`` reads needs a gradient: FlexAttention
            sums it by atomic adds.
    """
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    k, v = zero_padding_keys(k, v, k_positions)
    if not flex_available():
        raise ValueError("the flex backend needs torch.nn.attention.flex_attention (torch >= 2.5)")
    grad = needs_grad(scheme, q, k, v)
    if not flex_supports(scheme, device=q.device, needs_grad=grad):
        why = (
            "gradients (FlexAttention compiles for inference only on CPU; use backend='chunked')"
            if grad and q.device.type == "cpu"
            else f"scheme {type(scheme).__name__}"
        )
        raise ValueError(f"the flex backend does not support {why}")
    if dropout_p > 0 and training:
        raise ValueError("the flex backend does not support attention dropout")
    if is_empty(q, k):
        return empty_attention(q, k, v)
    dtype = q.dtype if q.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    mask = _block_mask(q_positions, k_positions, causal, q.device)
    score_mod, captured = _score_mod(scheme, qc, kc, q_positions, k_positions)  # unpadded q, k
    if torch.is_grad_enabled() and any(t.requires_grad for t in captured):
        alert_atomic_sums(
            "the flex backend's backward pass sums the positional term's gradient by atomic adds"
        )
    qc, kc, vc = _pad_head_dim(qc, kc, vc)
    options = _kernel_options(scheme, q.device, grad)
    while True:
        try:
            out = _compiled_flex()(
                qc,
                kc,
                vc,
                score_mod=score_mod,
                block_mask=mask,
                scale=1.0 / math.sqrt(q.shape[-1]),
                kernel_options=options,
            )
            break
        except RuntimeError as e:  # a kernel that needs more shared memory than the GPU has
            if options == SMALL_BLOCKS or "out of resource" not in str(e):
                raise
            _NEEDS_SMALL_BLOCKS.add(_options_key(scheme, q.device, grad))
            options = dict(SMALL_BLOCKS)
    out = out[..., : v.shape[-1]]
    if not is_contiguous_self(q_positions, k_positions):  # plain: every query has a key
        out = torch.where(
            rows_with_keys(q_positions, k_positions, causal)[:, None, :, None], out, 0.0
        )
    return propagate_nonfinite(out, q, k, scheme, q_positions, k_positions, causal).to(q.dtype)


def _options_key(scheme: Scheme, device: torch.device, grad: bool) -> tuple:
    return type(scheme).__name__, str(device), grad


def _kernel_options(scheme: Scheme, device: torch.device, grad: bool) -> dict | None:
    """Triton block sizes for FlexAttention on CUDA: :data:`SMALL_BLOCKS` when the ``score_mod``
    reads a learned tensor whose gradient the kernels accumulate (a relative or distance table,
    slopes), or when a kernel of this scheme has already asked for more shared memory than the
    GPU has; Inductor's defaults otherwise (``flex_attention_backend`` retries with
    :data:`SMALL_BLOCKS` when a compile runs out of shared memory)."""
    if _options_key(scheme, device, grad) in _NEEDS_SMALL_BLOCKS:
        return dict(SMALL_BLOCKS)
    learned = bool(scheme.hooks & LOGIT_HOOKS) and any(p.requires_grad for p in scheme.parameters())
    if device.type == "cuda" and grad and learned:
        return dict(SMALL_BLOCKS)
    return None


def _pad_head_dim(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q``, ``k`` (and on CUDA ``v``) with zero columns appended to the head dim where the
    kernel needs it (see the module docstring): on CPU a head dim of 8 or 16 becomes
    :data:`_CPU_SAFE_HEAD_DIM` for ``q`` and ``k``; on CUDA one under :data:`CUDA_MIN_HEAD_DIM`
    becomes that for all three (Inductor's CUDA kernel refuses smaller ones).

    Zero columns add nothing to ``q·k`` and give zero output columns, which the caller drops; it
    passes the scale ``1/√d`` of the unpadded ``d``.
    """
    d = q.shape[-1]
    pad = torch.nn.functional.pad
    if q.device.type == "cuda" and d < CUDA_MIN_HEAD_DIM:
        extra = (0, CUDA_MIN_HEAD_DIM - d)
        return pad(q, extra), pad(k, extra), pad(v, (0, CUDA_MIN_HEAD_DIM - v.shape[-1]))
    if q.device.type != "cpu" or d % 8 or d >= _CPU_SAFE_HEAD_DIM:
        return q, k, v
    extra = (0, _CPU_SAFE_HEAD_DIM - d)
    return pad(q, extra), pad(k, extra), v
