"""Synthetic length-generalisation tasks, as sequence-to-sequence language models.

Every example is ``BOS x SEP y EOS``: the model reads the input ``x`` and the separator,
and is trained to write the target ``y`` and then ``EOS`` (the loss covers only those tokens).

=========  ==================================================================================
task       target of an input
=========  ==================================================================================
copy       the input itself: ``3 1 4 1`` → ``3 1 4 1``
reverse    the input reversed: ``3 1 4 1`` → ``1 4 1 3``
sort       the input's digits in ascending order: ``3 1 4 1`` → ``1 1 3 4``
count      from ``a`` to ``b``, every number one token (Zhou et al. 2023, "What algorithms can
           transformers learn?", whose RASP-L analysis predicts it generalises): ``5 9`` →
           ``5 6 7 8 9``; numbers 0..127
add        the sum of two ``n``-digit numbers, every number written least significant digit
           first (Lee et al. 2023, "Teaching arithmetic to small transformers": the order in
           which a carry can be computed left to right), the sum with ``n + 1`` digits:
           ``a + b`` with ``a = 95``, ``b = 17`` is ``5 9 + 7 1`` → ``2 1 1`` (112)
=========  ==================================================================================

The *length* of an example is the number of digits of its input string (copy, reverse, sort), of
each operand (add), or of numbers to write (count), so a target's length follows from it.
Everything here is a pure function of a ``numpy.random.Generator``: a seed gives the same examples
on every machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BOS",
    "DIGIT0",
    "EOS",
    "MAX_COUNT",
    "PAD",
    "PLUS",
    "SEP",
    "TASKS",
    "Batch",
    "Example",
    "add_digits",
    "batch_of",
    "digits_of",
    "held_out_examples",
    "make_example",
    "max_length",
    "sample_batch",
    "sequence_length",
    "vocab_size",
]

PAD, BOS, SEP, EOS, PLUS = 0, 1, 2, 3, 4
#: Token id of the digit (or number) 0; digit ``d`` is ``DIGIT0 + d``.
DIGIT0 = 5
#: ``count`` writes the numbers 0..MAX_COUNT-1, each one token.
MAX_COUNT = 128


@dataclass(frozen=True, eq=False)
class Example:
    """One example: ``prompt`` = ``BOS x SEP`` and ``target`` = ``y EOS`` (int64 token ids)."""

    prompt: np.ndarray
    target: np.ndarray

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.target])


def digits_of(tokens: np.ndarray) -> list[int]:
    """The digits (or numbers) among ``tokens``, other ids dropped, for reading an example."""
    return [int(t) - DIGIT0 for t in tokens if t >= DIGIT0]


def _digits(length: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 10, size=length)


def _copy(length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = _digits(length, rng)
    return x, x.copy()


def _reverse(length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = _digits(length, rng)
    return x, x[::-1].copy()


def _sort(length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = _digits(length, rng)
    return x, np.sort(x)


def add_digits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sum of two numbers of ``n`` digits each, least significant digit first: ``n + 1``."""
    out = np.zeros(len(a) + 1, dtype=np.int64)
    carry = 0
    for i in range(len(a)):
        s = int(a[i]) + int(b[i]) + carry
        out[i], carry = s % 10, s // 10
    out[len(a)] = carry
    return out


def _add(length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    a, b = _digits(length, rng), _digits(length, rng)
    return np.concatenate([a, [-1], b]), add_digits(a, b)  # -1: the plus sign


def _count(length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    start = int(rng.integers(0, MAX_COUNT - length + 1))
    return np.array([start, start + length - 1]), np.arange(start, start + length)


@dataclass(frozen=True)
class _Task:
    make: Callable[[int, np.random.Generator], tuple[np.ndarray, np.ndarray]]
    symbols: int  # digits (10) or numbers (MAX_COUNT): token DIGIT0 + value
    max_length: int | None
    length_of: Callable[[int], int]  # tokens of BOS x SEP y EOS, from the length


TASKS: dict[str, _Task] = {
    "copy": _Task(_copy, 10, None, lambda n: 2 * n + 3),
    "reverse": _Task(_reverse, 10, None, lambda n: 2 * n + 3),
    "sort": _Task(_sort, 10, None, lambda n: 2 * n + 3),
    "count": _Task(_count, MAX_COUNT, MAX_COUNT, lambda n: n + 5),
    "add": _Task(_add, 10, None, lambda n: 3 * n + 5),
}


def _task(name: str) -> _Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; expected one of {list(TASKS)}") from None


def _check_length(length: int, task: str | None = None) -> None:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    top = None if task is None else _task(task).max_length
    if top is not None and length > top:
        raise ValueError(
            f"length {length} is too long for {task}: its numbers run from 0 to {top - 1}, so "
            f"a length is at most {top}"
        )


def vocab_size(task: str) -> int:
    """Token ids a model of ``task`` needs: the specials, then the digits or numbers."""
    return DIGIT0 + _task(task).symbols


def max_length(task: str) -> int | None:
    """The longest ``length`` the task can make (``count``: its numbers), or None."""
    return _task(task).max_length


def make_example(task: str, length: int, rng: np.random.Generator) -> Example:
    """One example of ``task`` of ``length`` (digits of the input; ``add``: per operand;
    ``count``: numbers written)."""
    spec = _task(task)
    _check_length(length, task)
    x, y = spec.make(int(length), rng)
    x_ids = np.where(x < 0, PLUS, x + DIGIT0)
    prompt = np.concatenate([[BOS], x_ids, [SEP]]).astype(np.int64)
    target = np.concatenate([y + DIGIT0, [EOS]]).astype(np.int64)
    return Example(prompt, target)


def sequence_length(task: str, length: int) -> int:
    """Tokens in an example of ``length``: ``BOS x SEP y EOS``."""
    _check_length(length, task)
    return _task(task).length_of(int(length))


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
    task: str, batch_size: int, longest: int, rng: np.random.Generator, *, shortest: int = 1
) -> Batch:
    """``batch_size`` training examples, each of a length drawn uniformly in
    ``shortest..longest``."""
    _check_length(shortest, task)
    _check_length(longest, task)
    if shortest > longest:
        raise ValueError(f"shortest ({shortest}) > longest ({longest})")
    lengths = rng.integers(shortest, longest + 1, size=batch_size)
    return batch_of([make_example(task, int(n), rng) for n in lengths], lengths)


def held_out_examples(task: str, length: int, count: int, seed: int) -> list[Example]:
    """``count`` examples of exactly ``length``, a pure function of ``(task, length, seed)``:
    every scheme and every training seed of a comparison is tested on the same examples."""
    _task(task)
    rng = np.random.default_rng([seed, list(TASKS).index(task), int(length)])
    return [make_example(task, length, rng) for _ in range(count)]
