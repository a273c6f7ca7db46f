"""The training loop: AdamW, warm-up + cosine decay, clipping, validation, atomic checkpoints.

A run lives in one folder::

    config.json         the TrainConfig (model included)
    metrics.jsonl       one JSON record per log line: train loss, lr, tokens/s; valid NLL
    last.pt, best.pt    checkpoints (latest; lowest validation NLL), written atomically
    learning_curve.png  train loss and valid NLL against step

Ctrl-C finishes the current step, writes ``last.pt`` and exits; ``--resume`` continues from it
with the same data order and RNG states, so an interrupted run ends where an uninterrupted one
would. Under ``torchrun`` the loop runs data-parallel (DistributedDataParallel; gloo on CPU, nccl
on CUDA); only rank 0 writes files and validates.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..atomic import atomic_path
from ..models.transformer import Transformer
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .dataset import TokenDataset
from .evaluate import evaluate_nll, window_loss
from .plots import plot_learning_curve
from .windows import random_windows

__all__ = ["RunPaths", "lr_at", "train"]

LOG_EVERY = 10


@dataclass(frozen=True)
class RunPaths:
    """The files of a run folder."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def last(self) -> Path:
        return self.root / "last.pt"

    @property
    def best(self) -> Path:
        return self.root / "best.pt"

    @property
    def curve(self) -> Path:
        return self.root / "learning_curve.png"


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio·lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Dist:
    """This process's place in a data-parallel run (world of 1 without torchrun)."""

    rank: int = 0
    world: int = 1
    #: Whether this run created the process group (and so must tear it down).
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device) -> _Dist:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), owns)

    def close(self) -> None:
        """Wait for every rank, then tear the group down. Leaving gloo's threads running at
        interpreter exit aborts the process ("terminate called without an active exception")."""
        if self.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _read_metrics(path: Path, up_to_step: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if record.get("step", 0) <= up_to_step:
            records.append(record)
    return records


class _Metrics:
    """JSON-lines metrics, appended and flushed line by line; also kept in memory for plots."""

    def __init__(self, path: Path, records: list[dict[str, Any]]) -> None:
        self.path, self.records = path, records
        with atomic_path(path) as tmp:  # drop records past a resumed checkpoint
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


@contextmanager
def _graceful_interrupt() -> Iterator[dict[str, Any]]:
    """First Ctrl-C sets a flag the loop checks after each step; a second one aborts at once."""
    # Test hook: $RELPOS_TEST_SIGNAL_AT_STEP=N makes the loop send itself SIGINT after step N.
    flag = {"stop": False, "signal_at": int(os.environ.get("RELPOS_TEST_SIGNAL_AT_STEP") or 0)}
    if sys.platform == "win32" or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield flag
        return

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True
        print(
            "\ninterrupt: finishing this step and writing a checkpoint (Ctrl-C again to abort)",
            file=sys.stderr,
        )

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _progress_bar(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


# ----------------------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig | None,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    device: str | torch.device | None = None,
    data: TokenDataset | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train (or resume) a run in ``run_dir``; returns a summary dict.

    Args:
        cfg: the run's config; ``None`` with ``resume=True`` reads it from the checkpoint.
        resume: continue from ``run_dir/last.pt`` (its saved config wins over ``cfg``).
        progress: show a progress bar (rank 0 only).
        data: the token dataset; default: the chorales named by ``cfg.data``
            (:func:`relpos.music.load_token_data`).
        stop_after: stop (as if interrupted) after this many steps of this session.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run = RunPaths(Path(run_dir))
    state: dict[str, Any] | None = None
    if resume:
        state = load_checkpoint(run.last)
        cfg = TrainConfig.from_dict(state["config"])
    elif cfg is None:
        raise ValueError("cfg is required unless resume=True")
    elif run.last.exists():
        raise FileExistsError(
            f"{run.root} already holds a run (last.pt); pass --resume to continue it, "
            "or choose another --run-dir"
        )
    ctx = _Dist.from_env(device)
    if cfg.batch_size % ctx.world:
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by the number of "
            f"processes ({ctx.world})"
        )
    local_batch = cfg.batch_size // ctx.world

    torch.manual_seed(cfg.seed + ctx.rank)
    rng = np.random.default_rng([cfg.seed, ctx.rank])
    if data is None:
        from ..music import load_token_data  # the command line's default dataset

        data = load_token_data(cfg.data, max_shift=cfg.max_shift, progress=progress and ctx.main)
    model = Transformer(cfg.model).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
    )
    step, best = 0, math.inf
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, best = state["step"], state.get("best_valid_nll", math.inf)
        rng.bit_generator.state = state["numpy_rng"][ctx.rank]
        torch.set_rng_state(state["torch_rng"][ctx.rank])
    net = DistributedDataParallel(model) if ctx.world > 1 else model

    metrics = None
    if ctx.main:
        run.root.mkdir(parents=True, exist_ok=True)
        with atomic_path(run.config) as tmp:
            tmp.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        metrics = _Metrics(run.metrics, _read_metrics(run.metrics, step))

    def gather_rng() -> tuple[list[Any], list[torch.Tensor]]:
        mine = (rng.bit_generator.state, torch.get_rng_state())
        if ctx.world == 1:
            return [mine[0]], [mine[1]]
        everyone: list[Any] = [None] * ctx.world
        dist.all_gather_object(everyone, mine)
        return [e[0] for e in everyone], [e[1] for e in everyone]

    def checkpoint(path: Path, valid_nll: float | None) -> None:
        numpy_rng, torch_rng = gather_rng()  # every rank takes part
        if ctx.main:
            save_checkpoint(
                path,
                {
                    "step": step,
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "config": cfg.to_dict(),
                    "numpy_rng": numpy_rng,
                    "torch_rng": torch_rng,
                    "best_valid_nll": best,
                    "valid_nll": valid_nll,
                },
            )

    def validate() -> float:
        nonlocal best
        result = [
            evaluate_nll(model, data.valid, context=cfg.context, device=device, grid=data.grid)
            if ctx.main
            else None
        ]
        if ctx.world > 1:  # every rank tracks the same `best`, so they checkpoint together
            dist.broadcast_object_list(result, src=0)
        valid_nll = result[0]
        if ctx.main:
            metrics.write({"step": step, "valid_nll": valid_nll})
        if valid_nll < best:
            best = valid_nll
            checkpoint(run.best, valid_nll)
        checkpoint(run.last, valid_nll)
        if ctx.main:
            plot_learning_curve(metrics.records, run.curve, title=cfg.model.scheme["name"])
        return valid_nll

    bar = _progress_bar(progress and ctx.main, cfg.steps, step)
    session_start, t0, tokens_seen, interrupted = step, time.perf_counter(), 0, False
    net.train()
    with _graceful_interrupt() as flag:
        while step < cfg.steps:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            w = random_windows(data.train, local_batch, cfg.context, rng, grid=data.grid)
            tokens = torch.from_numpy(w.tokens).to(device)
            mask = torch.from_numpy(w.mask).to(device)
            loss_sum, n = window_loss(net, tokens, mask)
            loss = loss_sum / max(n, 1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            tokens_seen += n * ctx.world
            if ctx.main and (step % LOG_EVERY == 0 or step == cfg.steps):
                rate = tokens_seen / (time.perf_counter() - t0)
                metrics.write(
                    {
                        "step": step,
                        "train_loss": loss.item(),
                        "lr": lr_at(step - 1, cfg),
                        "tokens_per_s": rate,
                    }
                )
                if bar is not None:
                    bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{rate:,.0f}")
            if bar is not None:
                bar.update(1)
            if step == flag["signal_at"]:  # the test hook above; returns after the handler ran
                signal.raise_signal(signal.SIGINT)
            stop = flag["stop"] or (stop_after is not None and step - session_start >= stop_after)
            if ctx.world > 1:  # every rank stops together
                stop_t = torch.tensor([float(stop)], device=device)
                dist.all_reduce(stop_t)
                stop = bool(stop_t.item())
            if step % cfg.eval_every == 0 or step == cfg.steps:
                validate()
            elif stop:
                checkpoint(run.last, None)
            if stop and step < cfg.steps:
                interrupted = True
                break
    if bar is not None:
        bar.close()
    ctx.close()
    return {
        "run_dir": str(run.root),
        "step": step,
        "steps": cfg.steps,
        "interrupted": interrupted,
        "best_valid_nll": best,
        "tokens_per_s": tokens_seen / max(time.perf_counter() - t0, 1e-9),
    }
