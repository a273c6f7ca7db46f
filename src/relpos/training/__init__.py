"""Training, evaluation and generation for the reference transformer on chorales."""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import TokenData, load_token_data
from .evaluate import evaluate_nll, window_loss
from .generate import sample_chorale
from .loop import RunPaths, lr_at, train

__all__ = [
    "RunPaths",
    "TokenData",
    "TrainConfig",
    "evaluate_nll",
    "load_checkpoint",
    "load_token_data",
    "lr_at",
    "sample_chorale",
    "save_checkpoint",
    "train",
    "window_loss",
]
