"""Sampling chorales from a trained model, token by token with a KV cache."""

from __future__ import annotations

import numpy as np
import torch

from ..models.transformer import Transformer
from .splits import NUM_VOICES
from .tokens import BOS, EOS, PAD, decode, encode

__all__ = ["sample_chorale"]


@torch.no_grad()
def sample_chorale(
    model: Transformer,
    num_steps: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    prime: np.ndarray | None = None,
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """Sample ``num_steps`` 16th-note steps, continuing ``prime`` (a ``(T, 4)`` chorale) if given.

    Only music tokens (pitches and rests) are ever sampled — PAD, BOS and EOS are masked out — and
    every step has exactly four voices, so the S-A-T-B order holds by construction; the result is
    still passed through :func:`relpos.music.decode`, which drops anything malformed.

    Returns:
        ``(len(prime) + num_steps, 4)`` int16 array, ``-1`` = silent.
    """
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    prefix = encode(prime)[:-1] if prime is not None else np.array([BOS])  # drop the prime's EOS
    total = len(prefix) + NUM_VOICES * num_steps
    scheme = model.cfg.scheme
    if scheme["name"] == "learned" and total > scheme["max_len"]:
        raise ValueError(
            f"{total} tokens exceed the learned position table (max_len={scheme['max_len']}); "
            "sample fewer steps or use a shorter prime"
        )
    model.eval()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    cache = model.new_cache()
    tokens = torch.from_numpy(prefix).long().unsqueeze(0).to(device)
    logits = model(tokens, cache=cache)[:, -1]
    out = list(prefix)
    for _ in range(NUM_VOICES * num_steps):
        logits = logits.float() / temperature
        logits[:, [PAD, BOS, EOS]] = -torch.inf
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -torch.inf)
        probs = torch.softmax(logits, dim=-1).cpu()
        nxt = int(torch.multinomial(probs, 1, generator=generator))
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=device), cache=cache)[:, -1]
    return decode(np.array([*out, EOS], dtype=np.int64))
