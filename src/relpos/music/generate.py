"""Sampling chorales from a trained model, token by token with a KV cache."""

from __future__ import annotations

import math
import sys
from numbers import Integral, Real

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
    progress: bool = False,
) -> np.ndarray:
    """Sample ``num_steps`` 16th-note steps, continuing ``prime`` (a ``(T, 4)`` chorale) if given.

    Only music tokens (pitches and rests) are ever sampled — PAD, BOS and EOS are masked out — and
    every step has exactly four voices, so the S-A-T-B order holds by construction; the result is
    still passed through :func:`relpos.music.decode`, which drops anything malformed.

    The logits are shifted so that the likeliest allowed token has logit 0 before they are divided
    by ``temperature``, so any finite temperature > 0 works (a tiny one samples the likeliest
    token, a huge one uniformly). Time grows with the square of the length (each token attends to
    all before it); ``progress`` shows a bar on stderr, one tick per time step.

    Returns:
        ``(len(prime) + num_steps, 4)`` int16 array, ``-1`` = silent.

    Raises:
        ValueError: a negative ``num_steps`` or ``top_k``, a temperature that is not a finite
            number > 0, more tokens than a learned position table holds, or a model whose
            logits are not finite (its weights diverged).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, Integral) or num_steps < 0:
        raise ValueError(f"num_steps must be an int >= 0, got {num_steps!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, Real)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: off), got {top_k!r}")
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
    bar = _progress_bar(progress, num_steps)
    try:
        for t in range(NUM_VOICES * num_steps):
            logits = logits.float()
            if not bool(torch.isfinite(logits).all()):
                raise ValueError(
                    f"the model's logits are not finite at token {len(out)} (step "
                    f"{t // NUM_VOICES}): its weights or activations overflowed; this checkpoint "
                    "cannot be sampled"
                )
            logits[:, [PAD, BOS, EOS]] = -torch.inf
            if top_k:  # before scaling, which could round near-ties into ties
                kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -torch.inf)
            # float64, and a divisor no smaller than the least normal float64 (a denormal one
            # reads as 0 where denormals are flushed): every finite temperature works.
            shifted = (logits - logits.amax(-1, keepdim=True)).double()
            probs = torch.softmax(shifted / max(float(temperature), sys.float_info.min), -1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=generator))
            out.append(nxt)
            logits = model(torch.tensor([[nxt]], device=device), cache=cache)[:, -1]
            if bar is not None and t % NUM_VOICES == NUM_VOICES - 1:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return decode(np.array([*out, EOS], dtype=np.int64))


def _progress_bar(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", desc="sampling", dynamic_ncols=True, file=sys.stderr)
