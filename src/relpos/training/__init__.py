"""A generic trainer for the reference transformer on any :class:`TokenDataset`.

Windows (:mod:`.windows`), the loop with checkpoints and resume (:mod:`.loop`), note-wise NLL
(:mod:`.evaluate`). The chorale data that ``relpos train`` uses by default is :mod:`relpos.music`.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .dataset import TokenDataset
from .evaluate import evaluate_nll, window_loss
from .loop import (
    RUN_FILES,
    RunPaths,
    TrainingDiverged,
    accumulate_gradients,
    check_data,
    lr_at,
    param_groups,
    set_lr,
    train,
)
from .windows import WindowGrid, Windows, eval_windows, random_windows

__all__ = [
    "RUN_FILES",
    "RunPaths",
    "TokenDataset",
    "TrainConfig",
    "TrainingDiverged",
    "WindowGrid",
    "Windows",
    "accumulate_gradients",
    "check_data",
    "eval_windows",
    "evaluate_nll",
    "load_checkpoint",
    "lr_at",
    "param_groups",
    "random_windows",
    "save_checkpoint",
    "set_lr",
    "train",
    "window_loss",
]
