"""The configuration of a training run: model, data, optimisation and budget, in one file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.transformer import TransformerConfig
from ..schemes.base import check_int

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs, saved as ``config.json`` in the run folder.

    Args:
        model: the :class:`TransformerConfig` (its ``vocab_size`` is the data's).
        data: ``"music21"`` (the corpus inside music21) or a path to a JSB JSON file.
        context: tokens per training window (the model's context).
        batch_size: windows per optimisation step (over all processes).
        steps: optimisation steps in total.
        lr, weight_decay, betas: AdamW.
        warmup: linear warm-up steps, then cosine decay to ``min_lr_ratio·lr``.
        grad_clip: clip the global gradient norm (0: off).
        eval_every: validate (and checkpoint) every this many steps.
        max_shift: transposition augmentation, semitones either way (0: off).
        seed: seeds torch, numpy and the data order.
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
    grad_clip: float = 1.0
    eval_every: int = 200
    max_shift: int = 5
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, TransformerConfig):
            raise TypeError(f"model must be a TransformerConfig, got {type(self.model).__name__}")
        for name, minimum in (
            ("context", 4),
            ("batch_size", 1),
            ("steps", 1),
            ("warmup", 0),
            ("eval_every", 1),
            ("max_shift", 0),
            ("seed", 0),
        ):
            check_int(name, getattr(self, name), minimum=minimum)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0, got {self.grad_clip}")
        object.__setattr__(self, "betas", tuple(self.betas))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise TypeError(f"train config must be a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown train config key(s) {unknown}; valid keys: {sorted(known)}")
        if "model" not in data:
            raise ValueError("train config needs a 'model' section")
        fields = dict(data)
        fields["model"] = TransformerConfig.from_dict(fields["model"])
        return cls(**fields)

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
