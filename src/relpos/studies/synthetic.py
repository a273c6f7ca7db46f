"""Train a decoder on a synthetic task (:mod:`.tasks`) and measure exact-match accuracy per length.

Training draws fresh examples at every step, a pure function of ``(seed, step)``, with lengths
uniform in ``1..train_length``; the loss is the mean NLL of the target tokens only (``y EOS``;
the prompt is context, not a target). The optimiser and schedule are the trainer's (AdamW with
weight decay on matrices, :func:`relpos.training.lr_at`, gradient clipping), and ``last.pt``
is written atomically every ``save_every`` steps, so an interrupted cell resumes where it stopped
with the same batches.

Testing is **greedy decoding through the KV cache**: the model reads ``BOS x SEP``, then writes
one token at a time, each the argmax given everything it wrote before, for as many tokens as the
target holds (``y EOS``). An example counts only if every token is right (exact match); a single
wrong digit early on, fed back, is the model's own mistake to recover from, as in real use.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..models.transformer import Transformer
from ..training.checkpoint import load_checkpoint, save_checkpoint
from ..training.config import TrainConfig
from ..training.loop import TrainingDiverged, lr_at
from .tasks import Example, held_out_examples, sample_batch, sequence_length

__all__ = [
    "decode_greedy",
    "exact_match",
    "synthetic_cell",
    "table_limit",
    "target_loss",
    "train_synthetic",
]


def _optimizer(model: Transformer, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
    )


def target_loss(
    model: Transformer, tokens: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Mean next-token NLL over the target positions (``loss_mask``) of padded examples."""
    logits = model(tokens[:, :-1], padding_mask=mask[:, :-1])
    nll = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
    keep = loss_mask.flatten().float()
    return (nll * keep).sum() / keep.sum().clamp(min=1)


def train_synthetic(
    cfg: TrainConfig,
    task: str,
    train_length: int,
    checkpoint: Path,
    *,
    save_every: int = 200,
    on_step: Callable[[int, float], None] | None = None,
    stop_after: int | None = None,
) -> tuple[Transformer, dict[str, Any]]:
    """Train (or resume, from ``checkpoint`` when it exists) a model of ``cfg.model`` on ``task``.

    ``cfg`` gives the model, ``steps``, ``batch_size``, the optimiser and schedule, ``seed``.
    ``on_step(step, loss)`` is called after every step (progress); ``stop_after`` stops after
    that many steps of this call, with ``last.pt`` written (tests: an interrupted cell).

    Returns:
        the model (in eval mode) and ``{"steps", "final_loss", "seconds", "finished"}``.

    Raises:
        TrainingDiverged: a non-finite loss or gradient (before the update; nothing written).
    """
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    opt = _optimizer(model, cfg)
    step, seconds = 0, 0.0
    if checkpoint.is_file():
        state = load_checkpoint(checkpoint)
        if state["config"] != cfg.to_dict():
            raise ValueError(f"{checkpoint} holds another run's config; delete it to start over")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        step, seconds = int(state["step"]), float(state.get("seconds", 0.0))
    params = list(model.parameters())
    model.train()
    loss_value, start, session = math.nan, time.perf_counter(), 0

    def save() -> None:
        save_checkpoint(
            checkpoint,
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "config": cfg.to_dict(),
                "torch_rng": torch.get_rng_state(),
                "seconds": seconds + time.perf_counter() - start,
            },
        )

    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sample_batch(
            task, cfg.batch_size, train_length, np.random.default_rng([cfg.seed, step])
        )
        loss = target_loss(
            model,
            torch.from_numpy(batch.tokens),
            torch.from_numpy(batch.mask),
            torch.from_numpy(batch.loss_mask),
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
        if not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
            raise TrainingDiverged(
                f"training diverged at step {step + 1}: the loss is {loss.item()} and the "
                f"gradient norm {norm.item()}"
            )
        opt.step()
        step, session, loss_value = step + 1, session + 1, loss.item()
        if on_step is not None:
            on_step(step, loss_value)
        if step % save_every == 0 or step == cfg.steps:
            save()
        if stop_after is not None and session >= stop_after and step < cfg.steps:
            save()
            break
    model.eval()
    return model, {
        "steps": step,
        "final_loss": loss_value,
        "seconds": seconds + time.perf_counter() - start,
        "finished": step >= cfg.steps,
    }


def table_limit(model: Transformer) -> int | None:
    """The most positions the model can read (a learned absolute table), or None (no limit)."""
    scheme = model.cfg.scheme
    return int(scheme["max_len"]) if scheme["name"] == "learned" else None


@torch.no_grad()
def decode_greedy(model: Transformer, prompts: np.ndarray, steps: int) -> np.ndarray:
    """``(b, steps)`` tokens written greedily after ``(b, p)`` prompts, through the KV cache."""
    model.eval()
    cache = model.new_cache()
    logits = model(torch.from_numpy(prompts), cache=cache)[:, -1]
    out = []
    for t in range(steps):
        nxt = logits.argmax(-1)
        out.append(nxt)
        if t + 1 < steps:
            logits = model(nxt[:, None], cache=cache)[:, -1]
    return torch.stack(out, 1).numpy()


def exact_match(
    model: Transformer,
    task: str,
    lengths: list[int],
    *,
    examples: int,
    seed: int,
    batch_size: int = 128,
) -> dict[int, dict[str, Any]]:
    """Greedy exact-match accuracy at each length, on ``examples`` held-out examples each
    (:func:`~.tasks.held_out_examples`, the same for every model given ``seed``).

    Returns ``{length: {"exact_match", "token_accuracy"}}``; both ``None``, with a ``"note"``,
    for a length whose examples need more positions than a learned table holds.
    """
    limit = table_limit(model)
    results: dict[int, dict[str, Any]] = {}
    for length in lengths:
        needed = sequence_length(task, length) - 1  # the last EOS is never read
        if limit is not None and needed > limit:
            results[length] = {
                "exact_match": None,
                "token_accuracy": None,
                "note": f"needs {needed} positions; the learned table holds {limit}",
            }
            continue
        data: list[Example] = held_out_examples(task, length, examples, seed)
        right, tokens_right, tokens_total = 0, 0, 0
        for i in range(0, len(data), batch_size):
            chunk = data[i : i + batch_size]
            prompts = np.stack([e.prompt for e in chunk])
            targets = np.stack([e.target for e in chunk])
            written = decode_greedy(model, prompts, targets.shape[1])
            same = written == targets
            right += int(same.all(1).sum())
            tokens_right += int(same.sum())
            tokens_total += same.size
        results[length] = {
            "exact_match": right / len(data),
            "token_accuracy": tokens_right / tokens_total,
        }
    return results


def synthetic_cell(
    cfg: TrainConfig,
    spec: Any,
    cell_dir: Path,
    *,
    test_seed: int,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) one cell of a synthetic comparison in ``cell_dir``, then test it.

    ``spec`` is the comparison's :class:`~.spec.CompareSpec`. Returns ``{"values": {length:
    exact-match or None}, "token_accuracy", "notes", "parameters", "train_seconds",
    "eval_seconds", "final_loss"}``.
    """
    cell_dir.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, unit="step", dynamic_ncols=True, file=sys.stderr, leave=False)

    def on_step(step: int, loss: float) -> None:
        if bar is not None:
            bar.n = step
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update(0)

    try:
        model, info = train_synthetic(
            cfg, spec.task, spec.train_length, cell_dir / "last.pt", on_step=on_step
        )
    finally:
        if bar is not None:
            bar.close()
    t0 = time.perf_counter()
    tested = exact_match(
        model, spec.task, list(spec.test_lengths), examples=spec.test_examples, seed=test_seed
    )
    return {
        "values": {n: r["exact_match"] for n, r in tested.items()},
        "token_accuracy": {n: r["token_accuracy"] for n, r in tested.items()},
        "notes": [f"{n}: {r['note']}" for n, r in tested.items() if "note" in r],
        "parameters": model.num_parameters(),
        "train_seconds": info["seconds"],
        "eval_seconds": time.perf_counter() - t0,
        "final_loss": info["final_loss"],
    }
