"""What the command line checks before it starts work: the device, and whether a run fits in memory.

:func:`estimate_memory` is a deliberately rough, slightly generous estimate of the peak memory of
one training step (or one evaluation batch) from a :class:`~relpos.training.TrainConfig`: model and
optimiser state, the activations a backward pass keeps, the logits, and the attention backend's
working memory. ``relpos train`` and ``relpos eval`` refuse a run whose estimate exceeds the memory
available (:func:`available_memory`) with one line naming ``--context`` (or the model flags) and the
estimate, instead of failing inside the allocator minutes later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..attention.auto import SDPA_MASK_BUDGET
from ..training.evaluate import EVAL_TOKENS

__all__ = [
    "Estimate",
    "available_memory",
    "device_flag",
    "estimate_memory",
    "format_bytes",
    "parse_device",
]

#: Floats per token and head of the ``chunked`` backend's working set (``O(block·L)``: a band of
#: 128 queries over clipped distances, a chunk of rows of the distance engine; see the bound in
#: ``tests/test_backends.py::check_no_l_by_l``), counted twice for the backward pass.
_LEAN_FLOATS = 512
#: Floats per token and layer kept for the backward pass, per unit of ``d_model`` and of ``d_ff``
#: (layer norms, q/k/v, attention output, projections, residuals, dropout masks; the MLP's two
#: hidden activations and their dropout).
_SAVED_PER_D, _SAVED_PER_FF = 16, 3
#: Evaluation windows per batch (``evaluate_nll``'s default), before the token cap.
_EVAL_BATCH = 32


class DeviceError(ValueError):
    """``--device`` names no device, or one this machine does not have."""


def parse_device(text: str | None) -> torch.device:
    """The ``torch.device`` of ``--device`` (default: cuda when available, else cpu).

    Raises:
        DeviceError: not a device name, a type relpos does not train on (only cpu, cuda, mps), or
            a device this machine does not have (no CUDA, an index past the last GPU).
    """
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise DeviceError(f"expected cpu, cuda, cuda:N or mps, got {text!r}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this PyTorch was built without CUDA"
                if not torch.backends.cuda.is_built()
                else "no CUDA device is visible"
            )
            raise DeviceError(f"{text!r} is not available: {why}; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(
                f"{text!r} is not available: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"{text!r} is not available on this machine; use --device cpu")
        return device
    raise DeviceError(f"relpos runs on cpu, cuda or mps, got device type {device.type!r}")


def device_flag(text: str | None) -> torch.device:
    """:func:`parse_device` for ``--device``: a :class:`~.checks.CLIError` naming the flag."""
    from .checks import CLIError

    try:
        return parse_device(text)
    except DeviceError as e:
        raise CLIError(f"--device: {e}") from None


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a run on ``device``: ``MemAvailable`` for the CPU, the free memory of a CUDA
    device; ``None`` when unknown (then nothing is refused)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Estimate:
    """An estimate of peak memory, in bytes, by part."""

    state: int  # weights (+ gradients and AdamW's two moments when training)
    activations: int  # everything that grows with batch × context
    batch: int  # windows per step or evaluation batch, on one process

    @property
    def total(self) -> int:
        return self.state + self.activations


def estimate_memory(cfg, *, training: bool, world: int = 1) -> Estimate:
    """Rough peak memory of one training step (``training``) or one evaluation batch of ``cfg``.

    Args:
        cfg: a :class:`~relpos.training.TrainConfig`.
        world: processes the global batch is split across (``torchrun``).
    """
    m = cfg.model
    d, heads, layers, vocab = m.d_model, m.num_heads, m.num_layers, m.vocab_size
    ff = m.d_ff or 4 * d
    table = m.scheme.get("max_len", 0) * d if m.scheme.get("name") == "learned" else 0
    params = 2 * vocab * d + layers * (4 * d * d + 2 * d * ff + 13 * d + ff) + table
    state = params * 4 * (4 if training else 1)
    n = cfg.context
    if training:
        batch = max(1, cfg.batch_size // max(1, world))
    else:
        batch = max(1, min(_EVAL_BATCH, EVAL_TOKENS // (n + 1)))
    tokens = batch * n
    if training:
        kept = layers * tokens * (_SAVED_PER_D * d + _SAVED_PER_FF * ff) + 2 * tokens * d
        logits = 3 * tokens * vocab  # logits, log-softmax, their gradient
    else:
        kept = tokens * (6 * d + 2 * ff)  # one layer's temporaries at a time
        logits = 2 * tokens * vocab
    # Attention: the (L, L) terms of the backends that build them, else O(block·L) per call.
    square = batch * heads * n * n
    lean = batch * heads * n * _LEAN_FLOATS * (2 if training else 1)
    if m.backend == "eager":
        attention = square * (3 if training else 2) * (layers if training else 1)
    elif m.backend == "sdpa":
        attention = square * 2 * (layers if training else 1)
    elif m.backend == "auto":  # the (i, j) mask only below auto's budget (SDPA_MASK_BUDGET)
        attention = min(square, SDPA_MASK_BUDGET // 4) * 2 + lean
    else:  # chunked, flex
        attention = lean
    return Estimate(state=state, activations=4 * (kept + logits + attention), batch=batch)


def format_bytes(n: float) -> str:
    """``1.5 GB``-style (decimal units, as memory is usually quoted)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # unreachable
