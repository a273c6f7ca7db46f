"""Note-wise negative log-likelihood: nats per token, every token of a split scored once.

Memory stays ``O(context)`` at any context: a batch holds at most :data:`EVAL_TOKENS` tokens (one
window when a window is longer), the columns after a batch's last real token are dropped before
the model runs (windows of short sequences are mostly padding at a long context), and attention
takes the same memory-lean backend choice as training (``auto`` never builds an ``(L, L)`` mask
past its budget: :data:`relpos.attention.auto.SDPA_MASK_BUDGET`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..models.transformer import Transformer
from .windows import EVERY_TOKEN, WindowGrid, eval_windows

__all__ = ["EVAL_TOKENS", "evaluate_nll", "trim_padding", "window_loss"]

#: Tokens per evaluation batch at most (fewer windows per batch at a long context; at least one
#: window). 65,536 tokens: the logits of a batch take 65,536 × vocabulary × 4 bytes (20 MB for
#: the chorales' 77 ids).
EVAL_TOKENS = 2**16


def trim_padding(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, n)`` windows without the columns after the batch's last real token (at least 2).

    Those columns hold only padding, which no real token attends to, so no real token's output
    or target changes; a short sequence in a long window costs its own length, not the window's.
    """
    real = mask.any(0).nonzero()
    width = max(int(real[-1]) + 1, 2) if len(real) else min(2, tokens.shape[1])
    return tokens[:, :width], mask[:, :width]


def window_loss(
    model: Transformer | torch.nn.Module,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over the scored targets of ``(b, n+1)`` windows, and their count.

    The model reads ``tokens[:, :-1]`` (padding masked out) and predicts ``tokens[:, 1:]``;
    trailing padding columns are dropped first (:func:`trim_padding`). ``scored`` ``(b, n+1)``:
    the tokens whose prediction counts (:attr:`Windows.scored`); default every real one.
    """
    tokens, mask = trim_padding(tokens, mask)
    scored = mask if scored is None else scored[:, : mask.shape[1]]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs, padding_mask=mask[:, :-1])
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    keep = scored[:, 1:].flatten()
    return torch.where(keep, nll, 0.0).sum(), int(keep.sum())


@torch.no_grad()
def evaluate_nll(
    model: Transformer,
    seqs: list[np.ndarray],
    *,
    context: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    grid: WindowGrid = EVERY_TOKEN,
    stride: int | None = None,
) -> float:
    """Mean NLL (nats per token) of ``seqs``, in windows of ``context`` tokens starting on
    ``grid``'s boundaries, every ``stride`` tokens (default ``context``: no overlap; a shorter
    stride gives each target more of its past, each still scored once: :func:`eval_windows`).

    ``batch_size`` windows per forward pass, fewer when they would hold more than
    :data:`EVAL_TOKENS` tokens (the result does not depend on it). A model with non-finite
    weights gives a non-finite result; callers that report it should check.
    """
    was_training = model.training
    model.eval()
    windows = eval_windows(seqs, context, grid=grid, stride=stride)
    batch_size = max(1, min(batch_size, EVAL_TOKENS // (context + 1)))
    total, count = 0.0, 0
    try:
        for batch in windows.batches(batch_size):
            tokens = torch.from_numpy(batch.tokens).to(device)
            mask = torch.from_numpy(batch.mask).to(device)
            scored = None if batch.scored is None else torch.from_numpy(batch.scored).to(device)
            loss, n = window_loss(model, tokens, mask, scored)
            total, count = total + loss.item(), count + n
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("nothing to evaluate: the split has no tokens")
    return total / count
