"""Parity checks: does a model give every sequence the same numbers however it is batched?

Each check builds a batch the hard way (padded, packed, or decoded with a KV cache) on the model's
device and returns the largest absolute difference from running every sequence alone (NaN if any
difference is NaN, so ``gap < tol`` fails). The test suite asserts they are ~0 for every scheme;
``relpos tour`` prints them. Use them on your own model as a self-test.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from .models.transformer import Transformer

__all__ = ["cached_gap", "left_padded_decoding_gap", "packed_gap", "padded_gap"]


def _device(model: Transformer) -> torch.device:
    """Where the model's parameters are: every batch a check builds goes there."""
    return next(model.parameters()).device


def _largest(gaps: Iterable[float]) -> float:
    """The largest gap, NaN if any is (Python's ``max`` keeps a NaN only when it comes first)."""
    gaps = list(gaps)
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps)


def _alone(model: Transformer, doc: Tensor) -> Tensor:
    return model(doc.to(_device(model)).unsqueeze(0))[0]


@torch.no_grad()
def padded_gap(
    model: Transformer, docs: list[Tensor], *, side: str = "right", extra: int = 2
) -> float:
    """Pad ``docs`` (1-D token tensors) on ``side`` into a batch; compare each row with its doc."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    n = max(len(d) for d in docs) + extra
    tokens = torch.zeros(len(docs), n, dtype=torch.long)
    mask = torch.zeros(len(docs), n, dtype=torch.bool)
    for r, d in enumerate(docs):
        sl = slice(n - len(d), n) if side == "left" else slice(0, len(d))
        tokens[r, sl], mask[r, sl] = d, True
    tokens, mask = tokens.to(_device(model)), mask.to(_device(model))
    out = model(tokens, padding_mask=mask)
    return _largest(
        (out[r][mask[r]] - _alone(model, d)).abs().max().item() for r, d in enumerate(docs)
    )


@torch.no_grad()
def packed_gap(model: Transformer, rows: list[list[Tensor]], *, extra: int = 1) -> float:
    """Pack each row's docs side by side with segment ids; compare each doc with the doc alone."""
    n = max(sum(len(d) for d in row) for row in rows) + extra
    tokens = torch.zeros(len(rows), n, dtype=torch.long)
    seg = torch.full((len(rows), n), -1)
    for r, row in enumerate(rows):
        t = 0
        for s, d in enumerate(row):
            tokens[r, t : t + len(d)], seg[r, t : t + len(d)] = d, s
            t += len(d)
    tokens, seg = tokens.to(_device(model)), seg.to(_device(model))
    out = model(tokens, segment_ids=seg)
    return _largest(
        (out[r][seg[r] == s] - _alone(model, d)).abs().max().item()
        for r, row in enumerate(rows)
        for s, d in enumerate(row)
    )


@torch.no_grad()
def cached_gap(model: Transformer, tokens: Tensor, *, chunk: int = 1) -> float:
    """Decode ``tokens (b, n)`` ``chunk`` tokens a step with a KV cache; compare every step with
    one pass over everything fed so far.

    For a causal model whose positional terms do not depend on the sequence length, that pass's
    rows are those of one pass over all ``n`` tokens. Length-dependent schemes (dynamic NTK,
    LongRoPE) define a token's output by the sequence as long as it is then, so the reference is
    the pass over the prefix.
    """
    cache = model.new_cache()
    tokens = tokens.to(_device(model))
    gaps = []
    for t in range(0, tokens.shape[1], chunk):
        step = model(tokens[:, t : t + chunk], cache=cache)
        ref = model(tokens[:, : t + chunk])[:, t:]
        gaps.append((step - ref).abs().max().item())
    return _largest(gaps)


@torch.no_grad()
def left_padded_decoding_gap(
    model: Transformer, prompts: list[Tensor], continuation: Tensor
) -> float:
    """Batched generation: left-padded ``prompts``, then ``continuation (b, m)`` one token a step.

    Compares every row, at every step, with its prompt and the continuation so far run alone.
    """
    n = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.bool)
    for r, p in enumerate(prompts):
        tokens[r, n - len(p) :], mask[r, n - len(p) :] = p, True
    device = _device(model)
    tokens, mask, continuation = tokens.to(device), mask.to(device), continuation.to(device)
    cache = model.new_cache()
    first = model(tokens, padding_mask=mask, cache=cache)
    gaps = [
        (first[r][mask[r]] - _alone(model, p)).abs().max().item() for r, p in enumerate(prompts)
    ]
    for t in range(continuation.shape[1]):
        step = model(continuation[:, t : t + 1], cache=cache)
        for r, p in enumerate(prompts):
            ref = _alone(model, torch.cat([p.to(device), continuation[r, : t + 1]]))[-1]
            gaps.append((step[r, 0] - ref).abs().max().item())
    return _largest(gaps)
