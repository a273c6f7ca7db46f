"""What a comparison is: the task, its training and test lengths, the model and the budget.

A :class:`CompareSpec` is saved in the run folder (``compare.json``); a later run in that folder
must ask for the same spec (it may add schemes or seeds). Defaults differ per task
(:func:`default_spec`): the synthetic tasks train a small model on short strings (about a minute
per scheme on a 2-core CPU), the chorales a small Music Transformer on short windows.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from ..schemes.base import check_int, config_from_dict
from ..spec.base import check_dropout
from ..training.config import NAMED_DATA
from .tasks import TASKS, max_length

__all__ = [
    "CHORALES",
    "DEFAULT_SCHEMES",
    "TASK_NAMES",
    "CompareSpec",
    "check_grid",
    "default_spec",
    "parse_scheme",
    "scheme_label",
    "split_outside_brackets",
]

#: The chorale extrapolation task: NLL at longer windows than the training windows.
CHORALES = "chorales-extrapolate"
TASK_NAMES = (CHORALES, *TASKS)
#: The classic schemes compared by default.
DEFAULT_SCHEMES = ("music", "shaw", "t5", "alibi", "rope", "learned", "sinusoidal", "nope")


@dataclass(frozen=True)
class CompareSpec:
    """One comparison's settings (every field checked on construction, errors naming it).

    Args:
        task: one of :data:`TASK_NAMES`.
        train_length: ``N``: tokens per training window (chorales), or the longest training
            string (synthetic: lengths ``1..N`` digits; for ``add``, digits per operand).
        test_lengths: lengths to test, each ``>= train_length``: window lengths in tokens
            (chorales) or string lengths (synthetic).
        d_model, num_heads, num_layers, dropout, backend: the model (:class:`TransformerConfig`).
        steps, batch_size, lr, warmup: training (AdamW, warm-up then cosine decay);
            ``warmup <= steps``, or the learning rate would never reach ``lr``.
        eval_every: validation (and checkpoint) interval of a chorale run, in steps.
        test_examples: held-out examples per test length (synthetic).
        data: the chorales (``music21``, ``jsb`` or a JSB JSON path); ``""`` for a synthetic
            task.
        max_shift: transposition augmentation of the chorales (semitones).
    """

    task: str
    train_length: int
    test_lengths: tuple[int, ...]
    d_model: int
    num_heads: int
    num_layers: int
    dropout: float
    steps: int
    batch_size: int
    lr: float
    warmup: int
    eval_every: int = 200
    test_examples: int = 100
    data: str = ""
    max_shift: int = 0
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"unknown task {self.task!r}; expected one of {list(TASK_NAMES)}")
        for name, minimum in (
            ("train_length", 1 if self.synthetic else 4),
            ("d_model", 1),
            ("num_heads", 1),
            ("num_layers", 1),
            ("steps", 1),
            ("batch_size", 1),
            ("warmup", 0),
            ("eval_every", 1),
            ("test_examples", 1),
            ("max_shift", 0),
        ):
            check_int(name, getattr(self, name), minimum=minimum)
        if self.warmup > self.steps:
            raise ValueError(
                f"warmup ({self.warmup}) is longer than steps ({self.steps}): the learning rate "
                "would never reach lr; shorten the warm-up or raise the steps"
            )
        lengths = self.test_lengths
        if (
            isinstance(lengths, (str, bytes))
            or not isinstance(lengths, (list, tuple))
            or not (lengths)
        ):
            raise ValueError(f"test_lengths must be a non-empty list of ints, got {lengths!r}")
        for n in lengths:
            check_int("test_lengths", n, minimum=1)
        short = [n for n in lengths if n < self.train_length]
        if short:
            raise ValueError(
                f"test_lengths {short} are shorter than the training length {self.train_length}: "
                "a length-generalisation test needs lengths >= it"
            )
        top = max_length(self.task) if self.synthetic else None
        if top is not None and max(lengths) > top:
            raise ValueError(
                f"test_lengths: {self.task} counts with numbers 0..{top - 1}, so a length is at "
                f"most {top}, got {max(lengths)}"
            )
        object.__setattr__(self, "test_lengths", tuple(sorted(set(lengths))))
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)):
            raise TypeError(f"lr must be a number, got {self.lr!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "dropout", check_dropout(self.dropout))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )
        if not self.synthetic and not self.data:
            raise ValueError(
                f"data: the {CHORALES} task needs chorales (music21, jsb or a JSB file)"
            )
        if self.data and self.data not in NAMED_DATA:  # a file: the same one from any directory
            object.__setattr__(self, "data", os.path.abspath(os.path.expanduser(self.data)))

    @property
    def synthetic(self) -> bool:
        return self.task != CHORALES

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["test_lengths"] = list(self.test_lengths)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompareSpec:
        if not isinstance(data, dict):
            raise TypeError(f"a comparison spec must be a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown comparison spec key(s) {unknown}")
        fields = dict(data)
        if isinstance(fields.get("test_lengths"), list):
            fields["test_lengths"] = tuple(fields["test_lengths"])
        return cls(**fields)


#: Defaults of the synthetic tasks: 2 layers of width 64 (4 heads), strings of 1..16 digits
#: (add: 1..8 digits per operand), tested up to 4× longer.
_SYNTHETIC = {
    "train_length": 16,
    "d_model": 64,
    "num_heads": 4,
    "num_layers": 2,
    "dropout": 0.0,
    "steps": 1000,
    "batch_size": 32,
    "lr": 3e-3,
    "warmup": 100,
    "test_examples": 100,
}
_PER_TASK: dict[str, dict[str, Any]] = {"add": {"train_length": 8}}

#: Defaults of the chorale task: the demo's model (3 layers, 128 wide, 4 heads) on windows of 64
#: tokens (16 time steps, one 4/4 bar), tested on windows of 64, 128, 256 and 512 tokens.
_CHORALES = {
    "train_length": 64,
    "d_model": 128,
    "num_heads": 4,
    "num_layers": 3,
    "dropout": 0.1,
    "steps": 600,
    "batch_size": 16,
    "lr": 2e-3,
    "warmup": 60,
    "eval_every": 150,
    "data": "music21",
    "max_shift": 5,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_spec(task: str, **overrides: Any) -> CompareSpec:
    """The task's default spec, with ``overrides`` (``None`` values ignored).

    Test lengths default to ``N, 2N, 4N, 8N`` (chorales) or ``N, 1.25N, 1.5N, 2N, 3N, 4N``
    (synthetic); a default length the task cannot make is an error naming ``train_length``, where
    it comes from. The default warm-up is capped at ``steps`` (a short run warms up over all its
    steps); a ``warmup`` given longer than ``steps`` is an error.
    """
    if task not in TASK_NAMES:
        raise ValueError(f"unknown task {task!r}; expected one of {list(TASK_NAMES)}")
    fields: dict[str, Any] = dict(_CHORALES if task == CHORALES else _SYNTHETIC)
    fields.update(_PER_TASK.get(task, {}))
    given = {k: v for k, v in overrides.items() if v is not None}
    fields.update(given)
    steps = fields["steps"]
    if "warmup" not in given and _is_int(steps) and 1 <= steps < fields["warmup"]:
        fields["warmup"] = steps
    n = fields["train_length"]
    factors = (1, 2, 4, 8) if task == CHORALES else (1, 1.25, 1.5, 2, 3, 4)
    derived = "test_lengths" not in fields and _is_int(n)
    if derived:
        fields["test_lengths"] = tuple(dict.fromkeys(max(1, round(f * n)) for f in factors))
    try:
        return CompareSpec(task=task, **fields)
    except ValueError as e:
        field, sep, why = str(e).partition(": ")
        if not (derived and sep and field == "test_lengths"):
            raise
        lengths = ", ".join(map(str, fields["test_lengths"]))
        words = ", ".join("N" if f == 1 else f"{f:g}N" for f in factors)
        raise ValueError(
            f"train_length: {n} gives the default test lengths {lengths} ({words}), and {why}; "
            "lower train_length or set the test lengths"
        ) from None


def split_outside_brackets(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` that stands outside brackets, braces and double quotes, so
    that a JSON value keeps its own commas and colons (``alibi:heads=[0,1],t5`` is two schemes;
    ``rope:scaling={"rope_type":"linear","factor":2}`` one scheme of one field)."""
    parts, depth, quoted, start = [], 0, False, 0
    for at, char in enumerate(text):
        if char == '"' and (at == 0 or text[at - 1] != "\\"):
            quoted = not quoted
        elif not quoted and char in "[{":
            depth += 1
        elif not quoted and char in "]}":
            depth -= 1
        elif not quoted and depth == 0 and char == sep:
            parts.append(text[start:at])
            start = at + 1
    return [*parts, text[start:]]


def parse_scheme(text: str) -> dict[str, Any]:
    """``NAME`` or ``NAME:KEY=VALUE:KEY=VALUE`` (e.g. ``music:max_distance=64``) as a scheme dict,
    checked against the registry (``ValueError`` naming the scheme or the field). A value is
    JSON where it parses (``heads=[0,1]``, ``scaling={"rope_type":"linear","factor":2}``), else
    a string."""
    import json

    name, *pairs = [part.strip() for part in split_outside_brackets(text, ":")]
    if not name:
        raise ValueError(f"expected a scheme name, got {text!r}")
    scheme: dict[str, Any] = {"name": name}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or key == "name":
            raise ValueError(f"expected NAME:KEY=VALUE (e.g. music:max_distance=64), got {text!r}")
        try:
            scheme[key] = json.loads(value)
        except json.JSONDecodeError:
            scheme[key] = value
    config_from_dict(scheme)  # unknown names or fields fail here
    return scheme


def scheme_label(scheme: dict[str, Any]) -> str:
    """The scheme as it was asked for: ``rope``, ``music:max_distance=64``."""
    import json

    rest = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in scheme.items()]
    return ":".join([scheme["name"], *rest[1:]])


def check_grid(schemes: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """Parse and check the schemes (at least one, no repeats) and seeds (ints >= 0)."""
    if not schemes:
        raise ValueError("schemes: expected at least one scheme")
    parsed = [parse_scheme(s) for s in schemes]
    labels = [scheme_label(s) for s in parsed]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"schemes: {repeated} named more than once")
    if not seeds:
        raise ValueError("seeds: expected at least one seed")
    for seed in seeds:
        check_int("seeds", seed, minimum=0)
    return parsed
