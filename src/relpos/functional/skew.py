"""The Music Transformer "skew" (Huang et al., 2018, "Music Transformer", §3.4.1).

``Q·Erᵀ`` holds, for every query ``i`` and every *relative distance* ``r``, the logit term
``q_i · e_r``. Attention needs it indexed by *key* ``j`` instead, at ``r = j - i``. The skew moves
every row into place with a pad and a reshape — no ``(L, L, d)`` tensor, no gather index. It is
valid when query ``i`` and key ``j`` sit at positions ``i`` and ``j`` (contiguous, unpadded rows);
the general case, any :class:`~relpos.Positions`, is :func:`gather_relative`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["gather_relative", "gather_table", "scatter_relative", "scatter_table", "skew"]


def skew(rel_logits: Tensor, *, causal: bool) -> Tensor:
    """Reindex relative logits by key: ``out[..., i, j] = rel[..., i, j - i + L - 1]``.

    Args:
        rel_logits: ``(..., L, R)``, column ``r`` holding relative distance ``r - (L - 1)``.
            Causal: ``R = L`` (distances ``-(L-1)..0``); bidirectional: ``R = 2L - 1``
            (distances ``-(L-1)..L-1``).
        causal: whether ``rel_logits`` covers only non-positive distances. Entries above the
            diagonal (``j > i``) of a causal skew are meaningless and must be masked by the caller.

    Returns:
        ``(..., L, L)`` logits indexed by key.
    """
    *lead, L, R = rel_logits.shape
    if causal:
        if R != L:
            raise ValueError(f"causal skew needs shape (..., L, L), got {tuple(rel_logits.shape)}")
        # Pad one column on the left, view as (L+1, L), drop the first row (the paper's recipe).
        padded = F.pad(rel_logits, (1, 0))
        return padded.reshape(*lead, L + 1, L)[..., 1:, :]
    if R != 2 * L - 1:
        raise ValueError(
            f"bidirectional skew needs shape (..., L, 2L-1), got {tuple(rel_logits.shape)}"
        )
    if L == 0:
        return rel_logits.new_zeros(*lead, 0, 0)
    # out[i, j] = rel[i, c] with c = j - i + L - 1 in [0, 2L-2]. Pad every row to 2L columns and
    # flatten: rel[i, c] sits at flat index 2L·i + c = i(2L-1) + (L-1) + j. So, from flat offset
    # L-1, output row i is the L consecutive elements starting at i(2L-1): a strided window view.
    padded = F.pad(rel_logits, (0, 1))  # (..., L, 2L)
    flat = padded.reshape(*lead, 2 * L * L)
    return flat[..., L - 1 :].unfold(-1, L, 2 * L - 1)[..., :L, :]


def gather_relative(rel_logits: Tensor, index: Tensor) -> Tensor:
    """Pick each pair's relative logit: ``out[..., i, j] = rel[..., i, index[i, j]]``.

    Shapes:
        rel_logits: ``(b|1, h, i|1, R)`` (a query-independent term broadcasts over ``i``);
        index: ``(b|1, i, j)`` int64 in ``[0, R)``. Returns ``(max b, h, i, j)``.
    """
    if rel_logits.shape[0] == 1 and rel_logits.shape[2] == 1:
        return gather_table(rel_logits, index).contiguous()  # one shared table: the fast form
    b = max(rel_logits.shape[0], index.shape[0])
    h, i = rel_logits.shape[1], index.shape[-2]
    idx = index.unsqueeze(1).expand(b, h, i, index.shape[-1])
    return torch.gather(rel_logits.expand(b, h, i, rel_logits.shape[-1]), -1, idx)


def scatter_relative(out: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """The adjoint of :func:`gather_relative`, in place:
    ``out[.., i, index[.., i, j]] += src[.., i, j]``.

    With ``src`` the attention probabilities this is the attention mass per relative row (Shaw's
    value term); with ``src = dS`` the gradient of the relative logits.

    Shapes:
        out: ``(b, h, i, R)``; index: ``(b|1, i, j)``; src: ``(b, h, i, j)``. Returns ``out``.
    """
    return out.scatter_add_(-1, index.unsqueeze(1).expand(src.shape), src)


def gather_table(table: Tensor, index: Tensor) -> Tensor:
    """:func:`gather_relative` of one table shared by every query and batch row (T5's buckets, a
    distance function's values): one ``index_select``, several times faster on CPU than a
    ``gather`` from the broadcast table.

    Shapes:
        table: ``(1, h, 1, R)``; index: ``(b|1, i, j)`` int64 in ``[0, R)``. Returns
        ``(b|1, h, i, j)``.
    """
    h, r = table.shape[1], table.shape[-1]
    b, i, j = index.shape
    out = table.reshape(h, r).index_select(1, index.reshape(-1))
    return out.view(h, b, i, j).transpose(0, 1)


def scatter_table(out: Tensor, index: Tensor, src: Tensor) -> Tensor:
    """The adjoint of :func:`gather_table`, in place: ``out[0, h, 0, index[.., i, j]] +=
    src[.., h, i, j]`` summed over the batch and queries (the gradient of a shared table).

    Shapes:
        out: contiguous ``(1, h, 1, R)``; index: ``(b|1, i, j)``; src: ``(b, h, i, j)``. Returns
        ``out``.
    """
    b, h = src.shape[:2]
    flat_src = src.transpose(0, 1).reshape(h, -1)
    flat_index = index.expand(b, *index.shape[1:]).reshape(1, -1).expand(h, -1)
    out.view(h, out.shape[-1]).scatter_add_(1, flat_index, flat_src)
    return out
