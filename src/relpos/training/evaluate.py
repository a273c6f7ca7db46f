"""Note-wise negative log-likelihood: nats per token, every token of a split scored once."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..models.transformer import Transformer
from .windows import EVERY_TOKEN, WindowGrid, eval_windows

__all__ = ["evaluate_nll", "window_loss"]


def window_loss(
    model: Transformer, tokens: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over the real targets of ``(b, n+1)`` windows, and their count.

    The model reads ``tokens[:, :-1]`` (padding masked out) and predicts ``tokens[:, 1:]``.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs, padding_mask=mask[:, :-1])
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    keep = mask[:, 1:].flatten()
    return (nll * keep).sum(), int(keep.sum())


@torch.no_grad()
def evaluate_nll(
    model: Transformer,
    seqs: list[np.ndarray],
    *,
    context: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    grid: WindowGrid = EVERY_TOKEN,
) -> float:
    """Mean NLL (nats per token) of ``seqs``, in windows of ``context`` tokens starting on
    ``grid``'s boundaries."""
    was_training = model.training
    model.eval()
    windows = eval_windows(seqs, context, grid=grid)
    total, count = 0.0, 0
    for batch in windows.batches(batch_size):
        tokens = torch.from_numpy(batch.tokens).to(device)
        mask = torch.from_numpy(batch.mask).to(device)
        loss, n = window_loss(model, tokens, mask)
        total, count = total + loss.item(), count + n
    model.train(was_training)
    if count == 0:
        raise ValueError("nothing to evaluate: the split has no tokens")
    return total / count
