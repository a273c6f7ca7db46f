"""Studies of the schemes: ``relpos compare`` (length generalisation).

* :mod:`.tasks` — synthetic tasks (copy, reverse, sort, count, add): pure functions of a seed.
* :mod:`.spec` — what a comparison is (task, lengths, model, budget) and its defaults.
* :mod:`.synthetic` — train on a synthetic task; greedy exact match per length (KV cache).
* :mod:`.extrapolate` — the chorale cell: the trainer, then NLL on longer windows.
* :mod:`.compare` — the grid of (scheme, seed) cells, resumable.
* :mod:`.report` — the table (markdown, JSON) and the plot.
"""

from .compare import ComparisonMismatch, run_compare
from .spec import CHORALES, DEFAULT_SCHEMES, TASK_NAMES, CompareSpec, default_spec

__all__ = [
    "CHORALES",
    "DEFAULT_SCHEMES",
    "TASK_NAMES",
    "CompareSpec",
    "ComparisonMismatch",
    "default_spec",
    "run_compare",
]
