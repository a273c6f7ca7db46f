"""The configuration of a training run: model, data, optimisation and budget, in one file."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.transformer import TransformerConfig
from ..schemes.base import check_int
from ..spec.base import check_config_keys

__all__ = ["TrainConfig"]

#: The data sources given by name, not as a file: the music21 corpus and the JSB split that ships
#: with relpos (``relpos.music.MUSIC21``, ``relpos.music.JSB``).
MUSIC21 = "music21"
NAMED_DATA = (MUSIC21, "jsb")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(
    cfg: Any,
    name: str,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
) -> None:
    """Check that field ``name`` is a finite number in its range, and store it as a float."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    bound = f"> {low:g}" if low_open else f">= {low:g}"
    if high < math.inf:
        bound = f"in [{low:g}, {high:g}]"
    if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")
    object.__setattr__(cfg, name, float(value))


def _check_model(model: TransformerConfig) -> None:
    """What a language-model trainer needs of the model beyond what TransformerConfig checks."""
    if not isinstance(model.causal, bool):
        raise TypeError(
            f"model.causal must be true or false, got {type(model.causal).__name__} "
            f"({model.causal!r})"
        )
    if not model.causal:
        raise ValueError(
            "model.causal is false: a bidirectional model sees the token it is asked to predict, "
            "so next-token training would learn nothing useful; the trainer needs causal=true"
        )


def _model_from_dict(data: Any) -> TransformerConfig:
    """``TransformerConfig.from_dict`` with field types checked first, so a JSON config's
    mistakes name the field (``"causal": "no"`` would otherwise read as true)."""
    if not isinstance(data, dict):
        raise TypeError(f"model must be a JSON object (dict), got {type(data).__name__}")
    if "causal" in data and not isinstance(data["causal"], bool):
        raise TypeError(
            f"model.causal must be true or false, got {type(data['causal']).__name__} "
            f"({data['causal']!r})"
        )
    if "dropout" in data and (
        isinstance(data["dropout"], bool) or not isinstance(data["dropout"], (int, float))
    ):
        raise TypeError(
            f"model.dropout must be a number, got {type(data['dropout']).__name__} "
            f"({data['dropout']!r})"
        )
    if "backend" in data and not isinstance(data["backend"], str):
        raise TypeError(f"model.backend must be a string, got {data['backend']!r}")
    if "scheme" in data and not isinstance(data["scheme"], (str, dict)):
        raise TypeError(
            f'model.scheme must be a name or an object {{"name": ...}}, got {data["scheme"]!r}'
        )
    return TransformerConfig.from_dict(data)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs, saved as ``config.json`` in the run folder.

    Args:
        model: the :class:`TransformerConfig` (its ``vocab_size`` is the data's).
        data: ``"music21"`` (the corpus inside music21), ``"jsb"`` (the standard JSB split,
            shipped with relpos) or a path to a JSB JSON file; the trainer stores a path as an
            absolute one (:meth:`with_absolute_data`).
        context: tokens per training window (the model's context).
        batch_size: windows per optimisation step (over all processes).
        steps: optimisation steps in total.
        lr, weight_decay, betas: AdamW.
        warmup: linear warm-up steps, then cosine decay to ``min_lr_ratio·lr`` (the floor).
        position_lr_scale: the positional scheme's own parameters (every
            :class:`~relpos.schemes.base.Scheme` in the model: a T5 or relative table, learned
            slopes or absolute positions, an MLP of the distance) train at this multiple of the
            learning rate. Adam moves a parameter by about the learning rate per step, so a
            scalar bias such as T5's can grow only as fast as the schedule allows.
        grad_clip: clip the global gradient norm (0: off).
        accumulate: micro-batches per step: each step's ``batch_size`` windows run as this many
            forward/backward passes of ``batch_size / accumulate`` windows, the gradient summed
            (the same update as one pass over the whole batch, in less memory).
        ema: decay of an exponential moving average of the weights (0: off), e.g. 0.999;
            validation, ``best.pt``'s evaluation weights and ``relpos eval``/``generate`` use the
            average (:class:`~relpos.training.ema.WeightAverage`).
        patience: stop after this many validations in a row without a new best NLL (0: never);
            ``best.pt`` keeps the best.
        autocast: run forward passes under bfloat16 autocast (weights, optimiser and loss stay
            float32): ``True``, ``False``, or ``"auto"``: on where the device computes bfloat16
            natively (:func:`relpos.runtime.native_bf16`: a CUDA GPU, or a CPU with AVX-512 BF16
            or AMX), where it is faster; off elsewhere, where bfloat16 is emulated and slower.
        eval_every: validate (and checkpoint) every this many steps.
        max_shift: transposition augmentation, semitones either way (0: off).
        seed: seeds torch, numpy and the data order.
        extra: free-form notes, stored with the run.

    Every field is checked on construction, with a message naming it; ``model.causal`` must be
    ``True`` (a next-token trainer cannot train a model that sees the next token).
    """

    model: TransformerConfig
    data: str = "music21"
    context: int = 256
    batch_size: int = 16
    steps: int = 1000
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    warmup: int = 100
    min_lr_ratio: float = 0.1
    position_lr_scale: float = 1.0
    grad_clip: float = 1.0
    accumulate: int = 1
    ema: float = 0.0
    patience: int = 0
    autocast: bool | str = False
    eval_every: int = 200
    max_shift: int = 5
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, TransformerConfig):
            raise TypeError(f"model must be a TransformerConfig, got {type(self.model).__name__}")
        _check_model(self.model)
        if not isinstance(self.data, str) or not self.data:
            raise TypeError(
                f"data must be a non-empty string (a path, 'music21' or 'jsb'), got {self.data!r}"
            )
        for name, minimum in (
            ("context", 4),
            ("batch_size", 1),
            ("steps", 1),
            ("warmup", 0),
            ("eval_every", 1),
            ("accumulate", 1),
            ("patience", 0),
            ("max_shift", 0),
            ("seed", 0),
        ):
            check_int(name, getattr(self, name), minimum=minimum)
        number = functools.partial(_number, self)
        number("lr", low=0.0, low_open=True)
        number("weight_decay", low=0.0)
        number("min_lr_ratio", low=0.0, high=1.0)
        number("position_lr_scale", low=0.0, low_open=True)
        number("grad_clip", low=0.0)
        number("ema", low=0.0, high=1.0)
        if self.ema == 1.0:
            raise ValueError("ema must be < 1 (1 would never move from the initial weights)")
        if self.batch_size % self.accumulate:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by accumulate "
                f"({self.accumulate}): each micro-batch holds batch_size / accumulate windows"
            )
        if not isinstance(self.autocast, bool) and self.autocast != "auto":
            raise TypeError(f"autocast must be true, false or 'auto', got {self.autocast!r}")
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise TypeError(f"betas must be a pair of numbers [beta1, beta2], got {betas!r}")
        checked = []
        for i, b in enumerate(betas):
            if not _is_real(b) or not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] must be a number in [0, 1), got {b!r}")
            checked.append(float(b))
        object.__setattr__(self, "betas", tuple(checked))
        if not isinstance(self.extra, dict):
            raise TypeError(f"extra must be a dict, got {type(self.extra).__name__}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise TypeError(f"train config must be a dict, got {type(data).__name__}")
        check_config_keys("train config", cls, data)
        fields = dict(data)
        fields["model"] = _model_from_dict(fields["model"])
        return cls(**fields)

    def with_absolute_data(self) -> TrainConfig:
        """This config with ``data`` as an absolute path (a name, ``"music21"`` or ``"jsb"``, is
        kept as it is).

        The trainer stores this form in ``config.json`` and the checkpoints, so ``relpos eval``
        and ``--resume`` find the data from any working directory.
        """
        if self.data in NAMED_DATA:
            return self
        return dataclasses.replace(self, data=os.path.abspath(os.path.expanduser(self.data)))

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
        return cls.from_dict(data)
