"""``auto``: per call, the fastest backend that supports the scheme, positions, device and whether
gradients are needed.

What it picks (measured on a 2-core CPU, fp32, h=8, d=64; ``docs/performance.md``):

=================================  ===========================  ==================================
scheme                             plain positions              padded / packed / KV cache
=================================  ===========================  ==================================
NoPE, sinusoidal, learned, RoPE    ``sdpa`` (no mask)           ``sdpa`` (boolean-as-float mask)
ALiBi, learned ALiBi               ``chunked`` (flash parts)    ``sdpa`` (float mask); learned
                                                                ALiBi ``chunked`` (tiles)
T5, Shaw keys, Music Transformer,  ``chunked`` (band + flash)   ``chunked`` with gradients,
Transformer-XL                                                  ``sdpa`` without
Shaw with a value term             ``chunked``                  ``chunked``
DeBERTa (a key term)               ``chunked`` (tiles) with     ``chunked`` (tiles) with
                                   gradients, ``sdpa`` without  gradients, ``sdpa`` without
KERPLE, DPB, Sandwich, FIRE        ``sdpa``; ``chunked``        ``sdpa``; ``chunked`` (tiles)
(a function of the positions)      (tiles) past 512² on CPU     past 512² on CPU
Forget gate (a per-token decay)    ``sdpa``; ``chunked``        ``sdpa``; ``chunked`` (tiles)
                                   (flash parts) past 512²      past 512² on CPU with
                                   on CPU                       gradients
=================================  ===========================  ==================================

A scheme whose ``key_bias`` has no relative form (CoPE) runs on ``sdpa`` only (``chunked``
cannot tile it: :func:`~relpos.attention.chunked.chunked_supports`), and on ``eager`` if it also
has a value term.

Short sequences (``i·j <= 512²``, :data:`SMALL`) take ``sdpa`` whenever it supports the scheme:
the ``(i, j)`` tensors are small and its fused kernels beat ``chunked``'s per-tile overhead. The
region path (a relative term over plain positions on CPU, no dropout) overtakes ``sdpa`` sooner,
from ``i·j > 128·256`` (:data:`SMALL_RELATIVE`), when the term's table needs a gradient (``sdpa``
then differentiates its float mask with the math kernel) or when the term depends on the query
(``sdpa`` builds a ``(b, h, i, j)`` bias). Plain positions: self-attention over one contiguous
sequence per row (``Positions.from_length``). On a device other than CPU, ``chunked`` has no
fused parts, so ``auto`` takes ``sdpa`` whenever it supports the scheme and ``chunked`` otherwise,
except where a GPU measured otherwise (an H200 in bf16, ``docs/performance.md``, "On a GPU";
:func:`fused_wins_on_cuda`, then :func:`flex_wins_on_cuda`):

==============================  ================================================================
scheme (CUDA)                   picks (half precision; Shaw's value term in any dtype)
==============================  ================================================================
Shaw with a value term          ``fused``, with or without gradients (L=4096: 8.7× flash SDPA)
ALiBi, with gradients           ``flex`` past 512² (L=4096: 2.4× vs 2.7× ``fused``, 15× ``sdpa``)
T5, learned ALiBi, with         ``fused`` from 512² (L=4096: T5 4.4× vs 6.4× ``flex``, 1491×
gradients                       ``sdpa``; learned ALiBi 2.9× vs 6.2× ``flex``)
KERPLE, Sandwich, DPB, with     ``flex`` from 512² (L=4096: 6.0–8.0× vs 17–19× ``sdpa``,
gradients                       46–79× ``chunked``); with attention dropout (none in ``flex``),
                                ``fused`` as T5 (not yet timed), and so KERPLE in deterministic
                                mode (its closed form sums nothing atomically)
Shaw keys, Music Transformer,   past the mask budget, ``flex`` up to ``i·j =`` :data:`FUSED_LONG`
Transformer-XL, with gradients  (L=1024: 6.3× vs 7.2× ``fused``), ``fused`` past it (L=4096:
                                6.3× vs 8.7×)
DeBERTa, with gradients         ``flex`` past the mask budget (L=4096: 12× vs 15× ``fused``,
                                35× ``sdpa``, 122× ``chunked``)
any scheme ``fused`` runs,      ``fused`` past the mask budget (ALiBi's forward at L=4096: 3.9×
without gradients               vs 20× ``sdpa``, 107× ``chunked``)
==============================  ================================================================

``flex`` compiles once per shape (seconds), which training pays once; without gradients (a new
shape at every decoding step) ``auto`` never picks it. ``fused`` compiles once per kind of call,
not per shape. In deterministic mode neither is taken for a call whose gradient it would sum by
atomic adds.

**Memory first.** Wherever ``sdpa`` would have to build its float mask — a ``(b|1, h|1, i, j)``
tensor, for padded, packed or cached positions or for a score bias — and that mask would exceed
:data:`SDPA_MASK_BUDGET` (64 MiB; :func:`sdpa_mask_bytes`), ``auto`` takes ``chunked``, whose
memory is ``O(block·L)``, whatever the CPU table above says (on CUDA the table's ``fused`` and
``flex`` build no such tensor either). So evaluation of padded windows at a long
context never builds an ``(L, L)`` tensor (a batch of 16 windows of 100,000 tokens would need a
640 GB mask). Below the budget the table holds.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from ..functional.dtypes import outside_autocast
from ..positions import Positions
from ..schemes.base import (
    LOGIT_HOOKS,
    DecayBiasScheme,
    DistanceBiasScheme,
    LinearBiasScheme,
    RelativeScheme,
    Scheme,
)
from .chunked import chunked_attention, chunked_path, chunked_supports
from .contract import AttentionBackend, needs_grad, validate_attention_inputs
from .eager import eager_attention
from .flex import flex_attention_backend, flex_available, flex_supports
from .fused import (
    FUSED_DTYPES,
    fused_attention,
    fused_sums_atomically,
    fused_sums_by_entry,
    fused_supports,
)
from .sdpa import is_plain, sdpa_attention, sdpa_supports

__all__ = [
    "FLEX_LEARNED_TORCH",
    "FUSED_HEAD_DIM",
    "FUSED_LONG",
    "SDPA_MASK_BUDGET",
    "SMALL",
    "SMALL_RELATIVE",
    "auto_attention",
    "choose_backend",
    "flex_wins_on_cuda",
    "fused_wins_on_cuda",
    "sdpa_mask_bytes",
]

#: ``i·j`` up to which ``auto`` takes ``sdpa`` for every scheme it supports (512 × 512 tokens).
SMALL = 512 * 512
#: The same bound where the region path runs a learned relative term with gradients, or a
#: query-dependent one (``docs/performance.md``, "What auto picks").
SMALL_RELATIVE = 128 * 256
#: The torch release ``flex`` was measured and tested with, on CUDA, differentiating a learned
#: relative table it reads in its ``score_mod`` (older releases may lack that backward): ``auto``
#: takes ``flex`` for those schemes from this release on.
FLEX_LEARNED_TORCH = "2.11"
#: ``i·j`` past which ``fused`` overtakes ``flex`` in training for a query-dependent table
#: (:func:`fused_wins_on_cuda`; measured at L=1024 and 4096 only).
FUSED_LONG = 1024 * 1024
#: The largest head dim for which ``auto`` prefers ``fused`` to ``flex`` (Shaw's value term
#: aside): the one timed (64). Compiled for sm_90 in bf16 at 64×64 tiles
#: (``aot.variant_launches(..., d=...)``), T5's and the Music Transformer's kernels ask for
#: 129–145 KiB of shared memory at d=128 and spill up to 1 KB per thread, and for 241–273 KiB at
#: d=256, past what an H100 grants a block (227 KiB).
FUSED_HEAD_DIM = 64
#: Bytes of the float mask ``sdpa`` may build in one call; past it ``auto`` takes ``chunked``
#: (:func:`sdpa_mask_bytes`). 64 MiB: e.g. one ``(1, 1, 4096, 4096)`` float32 mask, or a
#: ``(32, 4, 256, 256)`` bias (a batch of 32 windows of 256 tokens, 4 heads).
SDPA_MASK_BUDGET = 64 * 2**20

_PICKS: dict[str, AttentionBackend] = {
    "sdpa": sdpa_attention,
    "chunked": chunked_attention,
    "eager": eager_attention,
    "flex": flex_attention_backend,
    "fused": fused_attention,
}


def sdpa_mask_bytes(
    scheme: Scheme,
    q: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    *,
    causal: bool | None = None,
) -> int:
    """Bytes of the float mask :func:`~relpos.attention.sdpa.sdpa_attention` would build for this
    call: ``0`` when it needs none (no score bias, plain positions), else the size of its
    ``(b|1, h|1, i, j)`` mask (the largest tensor it makes, besides the bias it is made from).

    The batch dimension is the positions' (1 when they broadcast), or ``q``'s for a bias that
    depends on the query (Shaw's keys, the Music Transformer, any scheme of unknown form); the head
    dimension is 1 without a bias. ``causal=False`` lets it see that unmasked bidirectional
    positions need no mask (one device sync, only when the mask would be large); ``None``
    (unknown) counts a mask for any positions but plain ones.
    """
    has_bias = bool(scheme.hooks & LOGIT_HOOKS)
    plain = q_positions is k_positions and q_positions.contiguous
    if not has_bias and plain:
        return 0
    batch = max(q_positions.batch, k_positions.batch)
    heads = 1
    if has_bias:
        heads = q.shape[1]
        per_query = "key_bias" in scheme.hooks or not (
            isinstance(scheme, LinearBiasScheme | DistanceBiasScheme)
            or (isinstance(scheme, RelativeScheme) and scheme.query_independent)
        )
        if per_query:
            batch = q.shape[0]
    itemsize = 4 if has_bias and q.dtype in (torch.float16, torch.bfloat16) else q.element_size()
    size = batch * heads * len(q_positions) * len(k_positions) * itemsize
    if (
        size > SDPA_MASK_BUDGET
        and not has_bias
        and causal is False
        and is_plain(q_positions, k_positions, causal=False)
    ):
        return 0  # every token real, one segment: sdpa runs without a mask
    return size


def _query_dependent(scheme: Scheme) -> bool:
    """Whether the scheme's relative logit term depends on the query (Shaw's keys, the Music
    Transformer, Transformer-XL, DeBERTa's content-to-position term): not T5's shared table."""
    return isinstance(scheme, RelativeScheme) and not scheme.query_independent


def flex_wins_on_cuda(
    scheme: Scheme,
    q: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    *,
    needs_grad: bool,
    dropout: bool,
) -> bool:
    """Whether ``flex`` runs this call faster than the other backends ``auto`` could take
    besides ``fused`` (:func:`fused_wins_on_cuda` is asked first): on CUDA, for training
    (gradients; no attention dropout, which FlexAttention lacks), where an H200 measured it
    (bf16, causal, fwd+bwd × flash SDPA; ``docs/performance.md``, "On a GPU"): ALiBi's fixed
    slopes past ``i·j = 512²`` (L=4096: 2.4× against 2.7× ``fused``, 15× ``sdpa``); a bias that
    is a function of the distance (T5, KERPLE, Sandwich, DPB, learned ALiBi) from ``i·j = 512²``
    (KERPLE 6.3× against 19× ``sdpa``, 67× ``chunked``); a query- or key-dependent relative term
    (Shaw's keys, the Music Transformer, Transformer-XL, DeBERTa) wherever ``sdpa``'s float mask
    would pass :data:`SDPA_MASK_BUDGET` (DeBERTa 12× against 35× ``sdpa``, 122× ``chunked``).
    Training runs one shape, so the compile (seconds, once per shape) is paid once; inference (a
    new shape per decoding step) never takes it. A term whose gradient FlexAttention sums by
    atomic adds (a learned table, a query- or key-dependent term) only from torch
    :data:`FLEX_LEARNED_TORCH`, the release it was tested with, and not in deterministic
    mode."""
    if q.device.type != "cuda" or not needs_grad or dropout or not flex_available():
        return False
    if not flex_supports(scheme, device=q.device, needs_grad=True):
        return False
    size = len(q_positions) * len(k_positions)
    if isinstance(scheme, LinearBiasScheme):  # fixed slopes (learned ALiBi is a distance bias)
        return size > SMALL
    dependent = _query_dependent(scheme) or "key_bias" in scheme.hooks
    atomic = dependent or any(p.requires_grad for p in scheme.parameters())
    if atomic and (
        TorchVersion(torch.__version__) < FLEX_LEARNED_TORCH
        or torch.are_deterministic_algorithms_enabled()
    ):
        return False
    if dependent:
        return sdpa_mask_bytes(scheme, q, q_positions, k_positions) > SDPA_MASK_BUDGET
    return size >= SMALL  # sdpa: a float mask (differentiated by the math kernel if learned)


def _untimed_for_training(scheme: Scheme) -> bool:
    """The ``fused`` paths no GPU has timed with gradients: a wide shared table's gradient
    summed by entry (:func:`~.fused.fused_sums_by_entry`: Sandwich, DPB, T5 past 128 buckets) and
    KERPLE's closed form."""
    curved = isinstance(scheme, DistanceBiasScheme) and scheme.closed_form and not scheme.linear
    return curved or fused_sums_by_entry(scheme)


def fused_wins_on_cuda(
    scheme: Scheme,
    q: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    *,
    needs_grad: bool,
    dropout: bool = False,
    causal: bool | None = None,
) -> bool:
    """Whether ``auto`` takes ``fused`` for this call, on CUDA where the kernel runs the scheme
    (measured on an H200 in bf16, causal, × flash SDPA: ``docs/performance.md``, "On a GPU"):

    * a value term (Shaw's), which ``sdpa`` and ``flex`` cannot run and ``chunked`` runs as
      PyTorch tiles: always, in any dtype the kernel takes, with or without gradients;
    * in half precision, with gradients: T5 and learned ALiBi from ``i·j = 512²`` (L=4096: T5
      4.4× against 6.4× ``flex``, learned ALiBi 2.9× against 6.2×); a query-dependent table
      (Shaw's keys, the Music Transformer, Transformer-XL) past ``i·j =``
      :data:`FUSED_LONG` (the Music Transformer 6.3× against 8.7× ``flex``; ``flex`` leads at
      L=1024, 6.3× against 7.2×), and below it where ``sdpa``'s mask would pass
      :data:`SDPA_MASK_BUDGET` and ``flex`` cannot run the call; ALiBi's fixed slopes and
      DeBERTa's key term likewise where ``flex`` cannot (:func:`flex_wins_on_cuda`). Not in
      deterministic mode where the kernel would sum a table's gradient by atomic adds
      (:func:`~.fused.fused_sums_atomically`);
    * in half precision, without gradients: wherever ``sdpa``'s mask would pass the budget
      (ALiBi's forward at L=4096: 3.9× against 20× ``sdpa``, 107× ``chunked``); the kernel
      compiles once per kind of call, not per shape, so decoding pays no compile.

    Float32 and head dims past :data:`FUSED_HEAD_DIM`, not timed, keep the other backends. So do
    the wide shared tables (:func:`~.fused.fused_sums_by_entry`: Sandwich, DPB, T5 past 128
    buckets) and KERPLE's closed form, not yet timed on the kernel with gradients, where ``flex``
    runs the call for training (KERPLE 6.3× at L=4096). Where it cannot (attention dropout;
    deterministic mode, in which ``flex`` refuses a learned table) they follow T5's rule above,
    and without gradients the rule above: the alternatives are ``chunked``'s 46–79× and
    ``sdpa``'s 18–19× (same run). A wide table's forward is T5's (a table read per distance:
    7.4× at L=4096 without gradients) and its backward T5's plus one atomic add per diagonal of
    a tile (so never in deterministic mode); KERPLE's is learned ALiBi's (2.9×) plus a logarithm
    or a power per pair, with no table and no atomic adds."""
    if q.device.type != "cuda" or q.dtype not in FUSED_DTYPES:
        return False
    if not fused_supports(scheme, device=q.device):
        return False
    if "value_term" in scheme.hooks:
        return True
    if q.dtype == torch.float32 or q.shape[-1] > FUSED_HEAD_DIM:
        return False
    mask_passes = sdpa_mask_bytes(scheme, q, q_positions, k_positions, causal=causal) > (
        SDPA_MASK_BUDGET
    )
    if not needs_grad:
        return mask_passes
    if (
        _untimed_for_training(scheme)
        and not dropout
        and flex_wins_on_cuda(scheme, q, q_positions, k_positions, needs_grad=True, dropout=False)
    ):
        return False  # KERPLE, Sandwich, DPB, T5 past 128 buckets: flex, until fused is timed
    if torch.are_deterministic_algorithms_enabled() and fused_sums_atomically(
        scheme, q_positions, k_positions
    ):
        return False
    size = len(q_positions) * len(k_positions)
    keyed, dependent = "key_bias" in scheme.hooks, _query_dependent(scheme)
    if dependent and not keyed and size > FUSED_LONG:
        return True
    if isinstance(scheme, LinearBiasScheme) or keyed or dependent:
        flex = flex_wins_on_cuda(
            scheme, q, q_positions, k_positions, needs_grad=True, dropout=dropout
        )
        return mask_passes and not flex
    return mask_passes or size >= SMALL


def choose_backend(
    scheme: Scheme,
    q: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    *,
    needs_grad: bool,
    dropout_p: float = 0.0,
    training: bool = False,
    causal: bool | None = None,
) -> str:
    """The backend ``auto`` runs for this call (the table in this module's docstring).

    Args:
        needs_grad: whether a backward pass will follow (gradients of q, k, v or the scheme).
        causal: the call's masking, if known (:func:`sdpa_mask_bytes`).
    """
    dropout = dropout_p > 0 and training
    if fused_wins_on_cuda(
        scheme, q, q_positions, k_positions, needs_grad=needs_grad, dropout=dropout, causal=causal
    ):
        return "fused"
    if not chunked_supports(scheme):
        return "sdpa" if sdpa_supports(scheme) else "eager"
    if not sdpa_supports(scheme):
        return "chunked"
    if flex_wins_on_cuda(
        scheme, q, q_positions, k_positions, needs_grad=needs_grad, dropout=dropout
    ):
        return "flex"
    if sdpa_mask_bytes(scheme, q, q_positions, k_positions, causal=causal) > SDPA_MASK_BUDGET:
        return "chunked"  # memory first: O(block·L), never the (i, j) mask
    size = len(q_positions) * len(k_positions)
    learned_grad = needs_grad and any(p.requires_grad for p in scheme.parameters())
    if SMALL_RELATIVE < size <= SMALL:
        # The path chunked would take for this very call (dropout in training rules out the
        # region path, and then sdpa wins at this size).
        path = chunked_path(
            scheme, q, q_positions, k_positions, dropout_p=dropout_p, training=training
        )
        if path == "region" and (learned_grad or _query_dependent(scheme)):
            return "chunked"  # sdpa: the math kernel, or a (b, h, i, j) bias per call
    if size <= SMALL:
        return "sdpa"  # short: (i, j) tensors are small and the fused kernels' overhead wins
    path = chunked_path(scheme, q, q_positions, k_positions)
    if path == "fused":  # no bias, plain positions: the stock kernel with no mask
        return "sdpa"
    if path in ("alibi", "decay", "region"):
        return "chunked"
    if q.device.type != "cpu":
        return "sdpa"
    if scheme.hooks & LOGIT_HOOKS and not isinstance(
        scheme, RelativeScheme | LinearBiasScheme | DecayBiasScheme
    ):
        # A function of the positions (KERPLE, DPB, Sandwich, learned ALiBi, FIRE): evaluated per
        # tile, it beats sdpa's float mask past 512² on any layout, with or without gradients.
        return "chunked"
    if scheme.hooks & LOGIT_HOOKS and learned_grad:
        return "chunked"  # sdpa would differentiate the mask with the math kernel
    return "sdpa"


@outside_autocast
def auto_attention(
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
    """Run the backend :func:`choose_backend` picks (:class:`.contract.AttentionBackend`)."""
    validate_attention_inputs(q, k, v, q_positions, k_positions)
    name = choose_backend(
        scheme,
        q,
        q_positions,
        k_positions,
        needs_grad=needs_grad(scheme, q, k, v),
        dropout_p=dropout_p,
        training=training,
        causal=causal,
    )
    return _PICKS[name](
        q, k, v, scheme, q_positions, k_positions,
        causal=causal, dropout_p=dropout_p, training=training,
    )  # fmt: skip
