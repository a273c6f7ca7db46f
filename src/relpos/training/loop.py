"""The training loop: AdamW, warm-up + cosine decay, clipping, gradient accumulation, a moving
average of the weights, validation with early stopping, atomic checkpoints.

A run lives in one folder::

    config.json         the TrainConfig (model included)
    metrics.jsonl       one JSON record per log line: train loss, lr, tokens/s; valid NLL
    last.pt, best.pt    checkpoints (latest; lowest validation NLL), written atomically; with
                        ``ema``, each also holds the averaged weights (validated and evaluated)
    learning_curve.png  train loss and valid NLL against step

Ctrl-C (SIGINT) or SIGTERM finishes the current step, writes ``last.pt`` and returns (the
summary's ``exit_status`` is 130 or 143); ``--resume`` continues from it with the same data order
and RNG states, so an interrupted run ends where an uninterrupted one would. Under ``torchrun``
the loop runs data-parallel (DistributedDataParallel; gloo on CPU, nccl on CUDA); only rank 0
writes files and validates.

What it refuses, before step 1: a folder that already holds a run (unless resuming), data it
cannot train or validate on (:func:`check_data`), a non-causal model (:class:`TrainConfig`). What
it stops on: a non-finite loss, gradient or validation NLL (:class:`TrainingDiverged`, raised
before the update, with nothing written, so ``last.pt`` stays the last good checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..atomic import atomic_path, remove_stale_temporaries
from ..models.transformer import Transformer
from ..runtime import native_bf16
from ..schemes import Scheme
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .dataset import TokenDataset
from .ema import WeightAverage
from .evaluate import evaluate_nll, window_loss
from .plots import plot_learning_curve
from .windows import random_windows

__all__ = [
    "RUN_FILES",
    "RunPaths",
    "TrainingDiverged",
    "accumulate_gradients",
    "check_data",
    "lr_at",
    "param_groups",
    "set_lr",
    "train",
]

LOG_EVERY = 10

#: Files whose presence means a folder already holds a run: a new run there is refused.
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "last.pt",
    "best.pt",
    "learning_curve.png",
    "eval.json",
)

#: Signals that stop a run cleanly (finish the step, write ``last.pt``); the summary's
#: ``exit_status`` is then 128 + the signal number, the shell's convention (130, 143).
_STOP_SIGNALS = ("SIGINT", "SIGTERM")


class TrainingDiverged(ValueError):
    """The loss, a gradient or the validation NLL is not finite: the run stopped, nothing written.

    A ``ValueError``, so the command line reports it as one line with status 2.
    """


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

    def existing(self) -> list[str]:
        """The names of :data:`RUN_FILES` present in the folder."""
        return [name for name in RUN_FILES if (self.root / name).exists()]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio·lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    """AdamW's parameter groups: weight decay on matrices only (``ndim >= 2``), and the
    positional schemes' parameters (those of every :class:`~relpos.schemes.base.Scheme` in the
    model) in groups of their own at ``lr_scale = position_lr_scale``, the rest at 1. Empty
    groups are left out: at a scale of 1 the run has the two decay groups alone."""
    positional: set[int] = set()
    if cfg.position_lr_scale != 1.0:
        for module in model.modules():
            if isinstance(module, Scheme):
                positional.update(id(p) for p in module.parameters())
    groups = []
    for scale, is_positional in ((1.0, False), (cfg.position_lr_scale, True)):
        for decay in (True, False):
            params = [
                p
                for p in model.parameters()
                if (id(p) in positional) == is_positional and (p.ndim >= 2) == decay
            ]
            if params:
                wd = cfg.weight_decay if decay else 0.0
                groups.append({"params": params, "weight_decay": wd, "lr_scale": scale})
    return groups


def set_lr(opt: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> None:
    """Each group's learning rate for ``step``: :func:`lr_at` times its ``lr_scale``."""
    rate = lr_at(step, cfg)
    for group in opt.param_groups:
        group["lr"] = rate * group.get("lr_scale", 1.0)


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


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats as ``None``: ``json.dumps`` would write bare ``NaN``, which is not JSON."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(_json_safe(record), allow_nan=False)


def _read_metrics(path: Path, up_to_step: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and record.get("step", 0) <= up_to_step:
            records.append(_json_safe(record))
    return records


class _Metrics:
    """JSON-lines metrics, appended and flushed line by line; also kept in memory for plots."""

    def __init__(self, path: Path, records: list[dict[str, Any]]) -> None:
        self.path, self.records = path, records
        with atomic_path(path) as tmp:  # drop records past a resumed checkpoint
            tmp.write_text("".join(_dumps(r) + "\n" for r in records))

    def write(self, record: dict[str, Any]) -> None:
        line = _dumps(record)
        self.records.append(_json_safe(record))
        with self.path.open("a") as f:
            f.write(line + "\n")


@contextmanager
def _graceful_interrupt() -> Iterator[dict[str, Any]]:
    """The first SIGINT (Ctrl-C) or SIGTERM sets a flag the loop checks after each step; a second
    one aborts at once. A signal the process ignores (a background job's SIGINT) stays ignored."""
    # Test hook: $RELPOS_TEST_SIGNAL_AT_STEP=N makes the loop send itself SIGINT after step N
    # ($RELPOS_TEST_SIGNAL=SIGTERM: that signal instead).
    flag: dict[str, Any] = {
        "stop": False,
        "signal": None,
        "signal_at": int(os.environ.get("RELPOS_TEST_SIGNAL_AT_STEP") or 0),
        "test_signal": getattr(signal, os.environ.get("RELPOS_TEST_SIGNAL") or "SIGINT"),
    }
    if sys.platform == "win32":
        yield flag
        return

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"], flag["signal"] = True, signal.Signals(signum)
        again = "Ctrl-C" if signum == signal.SIGINT else "the signal"
        print(
            f"\n{signal.Signals(signum).name}: finishing this step and writing a checkpoint "
            f"({again} again to abort)",
            file=sys.stderr,
        )

    previous: dict[signal.Signals, Any] = {}
    try:
        for name in _STOP_SIGNALS:
            signum = getattr(signal, name)
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread: no handlers at all
        for signum, old in previous.items():
            signal.signal(signum, old)
        yield flag
        return
    try:
        yield flag
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _progress_bar(enabled: bool, total: int, initial: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


def check_data(data: TokenDataset, cfg: TrainConfig) -> None:
    """Refuse, before step 1, data the run would fail on later (with no checkpoint to show).

    The ``train`` and ``valid`` splits must each hold a sequence of at least 2 tokens (a window
    with a target), every token id and the grid's pad id must be in the model's vocabulary, and
    the context must span at least one step of the grid. ``test`` may be empty (only
    ``relpos eval`` reads it), but its ids are checked too.
    """
    source = f" (data: {cfg.data})"
    vocab, grid = cfg.model.vocab_size, data.grid
    if cfg.context < grid.step:
        raise ValueError(
            f"context ({cfg.context}) is shorter than one step of the data's window grid "
            f"({grid.step} tokens): no validation window can be formed"
        )
    if not 0 <= grid.pad < vocab:
        raise ValueError(f"the pad id {grid.pad} is outside the model's vocabulary 0..{vocab - 1}")
    for name in ("train", "valid", "test"):
        seqs = data.split(name)
        if name != "test":
            what = "train on" if name == "train" else "validate on"
            if len(seqs) == 0:
                raise ValueError(f"the {name} split is empty: nothing to {what}{source}")
            if not any(len(x) >= 2 for x in seqs):
                raise ValueError(
                    f"every sequence of the {name} split has fewer than 2 tokens: no window has "
                    f"a target to {what}{source}"
                )
        for i, seq in enumerate(seqs):
            arr = np.asarray(seq)
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise ValueError(
                    f"{name}[{i}]: expected a 1-D array of integer token ids, got shape "
                    f"{arr.shape}, dtype {arr.dtype}{source}"
                )
            if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
                raise ValueError(
                    f"{name}[{i}] holds token id {bad}, outside the model's vocabulary "
                    f"0..{vocab - 1}{source}"
                )


def _refuse_existing_run(run: RunPaths) -> None:
    found = run.existing()
    if found:
        raise FileExistsError(
            f"{run.root} already holds a run ({', '.join(found)}); pass --resume to continue it "
            "(it needs last.pt), or choose another --run-dir (or delete those files)"
        )


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def accumulate_gradients(
    net: torch.nn.Module,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    micro_batches: int = 1,
    autocast: bool = False,
    distributed: bool = False,
) -> tuple[torch.Tensor, int]:
    """Backward the mean next-token NLL of ``(b, n+1)`` windows in ``micro_batches`` passes,
    adding to the gradients: each pass's summed NLL is divided by the whole batch's target count,
    so the sum of the passes' gradients is the whole batch's (one pass over ``b`` windows, in the
    memory of ``b / micro_batches``).

    Args:
        autocast: run the forward passes under bfloat16 autocast (the loss in float32).
        distributed: ``net`` is a ``DistributedDataParallel``: gradients are all-reduced once,
            on the last pass.

    Returns:
        the batch's mean loss (detached) and its number of targets.
    """
    n = int(mask[:, 1:].sum())
    total = torch.zeros((), device=tokens.device)
    chunks = list(zip(tokens.chunk(micro_batches), mask.chunk(micro_batches), strict=True))
    for c, (t, m) in enumerate(chunks):
        last = c == len(chunks) - 1
        with net.no_sync() if distributed and not last else nullcontext():
            with torch.autocast(tokens.device.type, torch.bfloat16, enabled=autocast):
                loss_sum, _ = window_loss(net, t, m)
            loss = loss_sum.float() / max(n, 1)
            loss.backward()
        total += loss.detach()
    return total, n


# ----------------------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig | None,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    device: str | torch.device | None = None,
    data: TokenDataset,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train (or resume) a run in ``run_dir``; returns a summary dict.

    Args:
        cfg: the run's config; ``None`` with ``resume=True`` reads it from the checkpoint. A new
            run stores ``cfg.data`` as an absolute path (:meth:`TrainConfig.with_absolute_data`).
        resume: continue from ``run_dir/last.pt`` (its saved config wins over ``cfg``).
        progress: show a progress bar (rank 0 only).
        data: the token dataset (any task: :class:`TokenDataset`). The trainer knows nothing of
            music; the command line passes the chorales named by ``cfg.data``
            (:func:`relpos.music.load_token_data`).
        stop_after: stop (as if interrupted) after this many steps of this session.

    Returns:
        ``run_dir``, ``step``, ``steps``, ``interrupted``, ``stopped_early`` (``patience``
        validations without a new best), ``signal`` (the name of the signal
        that stopped the run, or ``None``), ``exit_status`` (0 when finished; 128 + the signal
        number when a signal stopped it: 130 for SIGINT, 143 for SIGTERM; 130 for
        ``stop_after``), ``best_valid_nll``, ``autocast`` (whether it was on: ``"auto"``
        resolved), ``tokens_per_s``.

    Raises:
        FileExistsError: a new run in a folder that already holds one (:data:`RUN_FILES`).
        ValueError: data the run cannot use (:func:`check_data`).
        TrainingDiverged: a non-finite loss, gradient or validation NLL; raised before the
            update, with nothing written, so ``last.pt`` is the last good checkpoint.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run = RunPaths(Path(run_dir))
    state: dict[str, Any] | None = None
    if resume:
        state = load_checkpoint(run.last)
        cfg = TrainConfig.from_dict(state["config"])
    elif cfg is None:
        raise ValueError("cfg is required unless resume=True")
    else:
        _refuse_existing_run(run)
        cfg = cfg.with_absolute_data()
    ctx = _Dist.from_env(device)
    autocast = native_bf16(device) if cfg.autocast == "auto" else bool(cfg.autocast)
    if cfg.batch_size % (ctx.world * cfg.accumulate):
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by the number of "
            f"processes ({ctx.world}) times accumulate ({cfg.accumulate})"
        )
    local_batch = cfg.batch_size // ctx.world

    torch.manual_seed(cfg.seed + ctx.rank)
    rng = np.random.default_rng([cfg.seed, ctx.rank])
    if not isinstance(data, TokenDataset):
        raise TypeError(f"data must be a TokenDataset, got {type(data).__name__}")
    check_data(data, cfg)
    model = Transformer(cfg.model).to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=cfg.betas)
    step, best, since_best = 0, math.inf, 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, best = state["step"], state.get("best_valid_nll", math.inf)
        since_best = state.get("evals_since_best", 0)
        rng.bit_generator.state = state["numpy_rng"][ctx.rank]
        torch.set_rng_state(state["torch_rng"][ctx.rank])
        device_rng = state.get("device_rng")  # CUDA's generator: its dropout masks go on
        if device.type == "cuda" and device_rng and device_rng[ctx.rank] is not None:
            torch.cuda.set_rng_state(device_rng[ctx.rank], device)
    average = WeightAverage(model, cfg.ema) if cfg.ema else None
    if average is not None and state is not None:
        average.load_state_dict(state["ema"])
    evaluated = model if average is None else average.model  # what validation measures
    net = DistributedDataParallel(model) if ctx.world > 1 else model
    saved_step = step if state is not None else None  # the step last.pt holds

    metrics = None
    if ctx.main:
        run.root.mkdir(parents=True, exist_ok=True)
        # Temporaries of a writer killed outright (SIGKILL): this run is the folder's only writer.
        remove_stale_temporaries(run.root, RUN_FILES)
        with atomic_path(run.config) as tmp:
            tmp.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        metrics = _Metrics(run.metrics, _read_metrics(run.metrics, step))

    def gather_rng() -> tuple[list[Any], ...]:
        """Every rank's numpy, CPU and device (CUDA's, else None) generator states."""
        on_cuda = device.type == "cuda"
        mine = (
            rng.bit_generator.state,
            torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if on_cuda else None,
        )
        if ctx.world == 1:
            return tuple([x] for x in mine)
        everyone: list[Any] = [None] * ctx.world
        dist.all_gather_object(everyone, mine)
        return tuple([e[t] for e in everyone] for t in range(3))

    def diverged(what: str) -> TrainingDiverged:
        kept = (
            f"{run.last} still holds step {saved_step}, the last good checkpoint"
            if saved_step is not None
            else f"no checkpoint had been written yet: delete {run.root} to start over"
        )
        return TrainingDiverged(
            f"training diverged at step {step}: {what}; stopped without writing a checkpoint "
            f"({kept}). Try a lower lr (it is {cfg.lr:g}), a longer warmup or gradient clipping"
        )

    def checkpoint(path: Path, valid_nll: float | None) -> None:
        nonlocal saved_step
        # Same weights on every rank, so every rank takes the same branch.
        if not _all_finite(model.state_dict().values()):
            raise diverged("the model's weights are not finite")
        numpy_rng, torch_rng, device_rng = gather_rng()  # every rank takes part
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
                    "device_rng": device_rng,
                    "best_valid_nll": best,
                    "evals_since_best": since_best,
                    "valid_nll": valid_nll,
                    **({} if average is None else {"ema": average.state_dict()}),
                },
            )
        if path == run.last:
            saved_step = step

    def validate() -> float:
        nonlocal best, since_best
        result = [
            evaluate_nll(evaluated, data.valid, context=cfg.context, device=device, grid=data.grid)
            if ctx.main
            else None
        ]
        if ctx.world > 1:  # every rank tracks the same `best`, so they checkpoint together
            dist.broadcast_object_list(result, src=0)
        valid_nll = result[0]
        if not math.isfinite(valid_nll):
            raise diverged(f"the validation NLL is {valid_nll}")
        if ctx.main:
            metrics.write({"step": step, "valid_nll": valid_nll})
        since_best += 1
        if valid_nll < best:
            best, since_best = valid_nll, 0
            checkpoint(run.best, valid_nll)
        checkpoint(run.last, valid_nll)
        if ctx.main:
            plot_learning_curve(metrics.records, run.curve, title=cfg.model.scheme["name"])
        return valid_nll

    bar = _progress_bar(progress and ctx.main, cfg.steps, step)
    session_start, t0, tokens_seen, interrupted = step, time.perf_counter(), 0, False
    # A run that stopped early stays stopped: its last.pt holds the validation that ended it.
    stopped_early = bool(cfg.patience) and since_best >= cfg.patience and step < cfg.steps
    net.train()
    params = list(model.parameters())
    try:
        with _graceful_interrupt() as flag:
            while step < cfg.steps and not stopped_early:
                set_lr(opt, step, cfg)
                w = random_windows(data.train, local_batch, cfg.context, rng, grid=data.grid)
                tokens = torch.from_numpy(w.tokens).to(device)
                mask = torch.from_numpy(w.mask).to(device)
                opt.zero_grad(set_to_none=True)
                loss, n = accumulate_gradients(
                    net,
                    tokens,
                    mask,
                    micro_batches=cfg.accumulate,
                    autocast=autocast,
                    distributed=ctx.world > 1,
                )
                if cfg.grad_clip:
                    norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                else:
                    norm = torch.nn.utils.get_total_norm(
                        [p.grad for p in params if p.grad is not None]
                    )
                # Before the update: a non-finite loss or gradient must not reach the weights.
                bad = (~torch.isfinite(loss.detach()) | ~torch.isfinite(norm)).float()
                if ctx.world > 1:  # every rank stops together
                    dist.all_reduce(bad)
                if bad.item():
                    step += 1  # the step that failed, for the message
                    raise diverged(
                        f"the training loss is {loss.item()} and the gradient norm "
                        f"{norm.item()} (on this process)"
                    )
                opt.step()
                step += 1
                if average is not None:
                    average.update(model)
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
                if step == flag["signal_at"]:  # the test hook above; returns after the handler
                    signal.raise_signal(flag["test_signal"])
                stop = flag["stop"] or (
                    stop_after is not None and step - session_start >= stop_after
                )
                if ctx.world > 1:  # every rank stops together
                    stop_t = torch.tensor([float(stop)], device=device)
                    dist.all_reduce(stop_t)
                    stop = bool(stop_t.item())
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    validate()
                    if cfg.patience and since_best >= cfg.patience and step < cfg.steps:
                        stopped_early = True  # best.pt holds the best; last.pt this step
                        break
                elif stop:
                    checkpoint(run.last, None)
                if stop and step < cfg.steps:
                    interrupted = True
                    break
    except TrainingDiverged:
        ctx.close()  # every rank raised it at the same step
        raise
    finally:
        if bar is not None:
            bar.close()
    ctx.close()
    stopped_by = flag["signal"] if interrupted else None
    if stopped_by is not None:
        exit_status = 128 + int(stopped_by)
    else:
        exit_status = 130 if interrupted else 0
    return {
        "run_dir": str(run.root),
        "step": step,
        "steps": cfg.steps,
        "interrupted": interrupted,
        "stopped_early": stopped_early,
        "signal": stopped_by.name if stopped_by is not None else None,
        "exit_status": exit_status,
        "best_valid_nll": best,
        "autocast": autocast,
        "tokens_per_s": tokens_seen / max(time.perf_counter() - t0, 1e-9),
    }
