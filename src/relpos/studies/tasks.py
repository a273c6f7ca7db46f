"""Synthetic length-generalisation tasks on digit strings, as sequence-to-sequence language models.

Every example is ``BOS x SEP y EOS``: the model reads the input ``x`` (digits) and the separator,
and is trained to write the target ``y`` and then ``EOS`` (the loss covers only those tokens).

=========  ==================================================================================
task       target of an input
=========  ==================================================================================
copy       the input itself: ``3 1 4 1`` → ``3 1 4 1``
reverse    the input reversed: ``3 1 4 1`` → ``1 4 1 3``
sort       the input's digits in ascending order: ``3 1 4 1`` → ``1 1 3 4``
add        the sum of two ``n``-digit numbers, every number written least significant digit
           first (Lee et al. 2023, "Teaching arithmetic to small transformers": the order in
           which a carry can be computed left to right), the sum with ``n + 1`` digits:
           ``a + b`` with ``a = 95``, ``b = 17`` is ``5 9 + 7 1`` → ``2 1 1`` (112)
=========  ==================================================================================

The *length* of an example is the number of digits of its input string (copy, reverse, sort) or
of each operand (add), so a target's length follows from it. Everything here is a pure function of
a ``numpy.random.Generator``: a seed gives the same examples on every machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BOS",
    "DIGIT0",
    "EOS",
    "PAD",
    "PLUS",
    "SEP",
    "TASKS",
    "VOCAB_SIZE",
    "Batch",
    "Example",
    "batch_of",
    "digits_of",
    "held_out_examples",
    "make_example",
    "sample_batch",
    "sequence_length",
]

PAD, BOS, SEP, EOS, PLUS = 0, 1, 2, 3, 4
#: Token id of the digit 0; digit ``d`` is ``DIGIT0 + d``.
DIGIT0 = 5
VOCAB_SIZE = DIGIT0 + 10


@dataclass(frozen=True, eq=False)
class Example:
    """One example: ``prompt`` = ``BOS x SEP`` and ``target`` = ``y EOS`` (int64 token ids)."""

    prompt: np.ndarray
    target: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.target])


def digits_of(tokens: np.ndarray) -> list[int]:
    """The digits among ``tokens`` (other ids dropped), for reading an example."""
    return [int(t) - DIGIT0 for t in tokens if DIGIT0 <= t < DIGIT0 + 10]


def _copy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x, x.copy()


def _reverse(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x, x[::-1].copy()


def _sort(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x, np.sort(x)


def _add(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` holds two operands of ``len(x) // 2`` digits each (the caller draws ``2n``)."""
    n = len(x) // 2
    a, b = x[:n], x[n:]
    out = np.zeros(n + 1, dtype=np.int64)
    carry = 0
    for i in range(n):  # least significant digit first
        s = int(a[i]) + int(b[i]) + carry
        out[i], carry = s % 10, s // 10
    out[n] = carry
    return np.concatenate([a, [-1], b]), out  # -1 marks the plus sign


@dataclass(frozen=True)
class _Task:
    make: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    digits_per_length: int  # digits drawn for an example of length n: n, or 2n (two operands)
    description: str


TASKS: dict[str, _Task] = {
    "copy": _Task(_copy, 1, "write the input digits again"),
    "reverse": _Task(_reverse, 1, "write the input digits in reverse order"),
    "sort": _Task(_sort, 1, "write the input digits in ascending order"),
    "add": _Task(
        _add, 2, "add two n-digit numbers, digits least significant first (n + 1 digits out)"
    ),
}


def _task(name: str) -> _Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}") from None


def _check_length(length: int) -> None:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")


def make_example(task: str, length: int, rng: np.random.Generator) -> Example:
    """One example of ``task`` whose input has ``length`` digits (``add``: per operand)."""
    spec = _task(task)
    _check_length(length)
    digits = rng.integers(0, 10, size=spec.digits_per_length * int(length))
    x, y = spec.make(digits)
    x_ids = np.where(x < 0, PLUS, x + DIGIT0)
    prompt = np.concatenate([[BOS], x_ids, [SEP]]).astype(np.int64)
    target = np.concatenate([y + DIGIT0, [EOS]]).astype(np.int64)
    return Example(prompt, target)


def sequence_length(task: str, length: int) -> int:
    """Tokens in an example of ``length``: ``BOS x SEP y EOS``."""
    _check_length(length)
    if _task(task).digits_per_length == 2:
        return 1 + (2 * length + 1) + 1 + (length + 1) + 1
    return 1 + length + 1 + length + 1


@dataclass(frozen=True, eq=False)
class Batch:
    """Examples padded on the right into one array.

    Attributes:
        tokens: ``int64 (b, n)``, :data:`PAD` after each example's end.
        mask: ``bool (b, n)``, True on real tokens (the model's padding mask).
        loss_mask: ``bool (b, n - 1)``, True where ``tokens[:, 1:]`` is a target token (``y`` and
            ``EOS``): the positions the loss covers.
        lengths: ``int64 (b,)``, each example's length.
    """

    tokens: np.ndarray
    mask: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray


def batch_of(examples: list[Example], lengths: list[int] | np.ndarray) -> Batch:
    """Pad ``examples`` (of the given lengths) into a :class:`Batch`."""
    width = max(len(e.prompt) + len(e.target) for e in examples)
    b = len(examples)
    tokens = np.full((b, width), PAD, dtype=np.int64)
    mask = np.zeros((b, width), dtype=bool)
    target = np.zeros((b, width), dtype=bool)
    for i, e in enumerate(examples):
        p, t = len(e.prompt), len(e.target)
        tokens[i, : p + t] = e.tokens
        mask[i, : p + t] = True
        target[i, p : p + t] = True
    return Batch(tokens, mask, target[:, 1:], np.asarray(lengths, dtype=np.int64))


def sample_batch(
    task: str, batch_size: int, max_length: int, rng: np.random.Generator, *, min_length: int = 1
) -> Batch:
    """``batch_size`` training examples, each of a length drawn uniformly in
    ``min_length..max_length``."""
    _check_length(min_length)
    _check_length(max_length)
    if min_length > max_length:
        raise ValueError(f"min_length ({min_length}) > max_length ({max_length})")
    lengths = rng.integers(min_length, max_length + 1, size=batch_size)
    return batch_of([make_example(task, int(n), rng) for n in lengths], lengths)


def held_out_examples(task: str, length: int, count: int, seed: int) -> list[Example]:
    """``count`` examples of exactly ``length``, a pure function of ``(task, length, seed)``:
    every scheme and every training seed of a comparison is tested on the same examples."""
    _task(task)
    rng = np.random.default_rng([seed, sorted(TASKS).index(task), int(length)])
    return [make_example(task, length, rng) for _ in range(count)]
