"""Windows of token sequences for next-token training and evaluation (numpy only).

A window is ``length + 1`` token ids: the model reads ``tokens[:, :-1]`` and predicts
``tokens[:, 1:]``. Every window starts at a *step boundary* of its sequence, given by a
:class:`WindowGrid`: position 0, then ``head, head + step, head + 2·step, …`` (every token for the
default grid; for an encoded chorale, BOS and each soprano token, so a window starts on a whole
time step). Sequences that end inside a window are padded with the grid's ``pad`` id; ``mask`` is
``True`` on real tokens, and ``scored`` on the tokens whose prediction counts (all real ones but
those an earlier, overlapping window scored), so the targets to score are ``scored[:, 1:]``.

Everything here returns numpy arrays; the caller makes tensors
(``torch.from_numpy(w.tokens)``, ``torch.from_numpy(w.mask)``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EVERY_TOKEN", "WindowGrid", "Windows", "eval_windows", "random_windows"]


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True)
class WindowGrid:
    """Where windows may start, and the id that pads them.

    Attributes:
        step: tokens between two boundaries after the head (a chorale: 4 voices per step).
        head: first boundary after position 0 (a chorale: 1, after BOS); 0 means none extra.
        pad: token id after the end of a sequence (masked out).
    """

    step: int = 1
    head: int = 0
    pad: int = 0

    def __post_init__(self) -> None:
        _check_positive_int("step", self.step)
        if isinstance(self.head, bool) or not isinstance(self.head, int) or self.head < 0:
            raise ValueError(f"head: expected a non-negative int, got {self.head!r}")

    def boundaries(self, seq_len: int) -> np.ndarray:
        """Window start positions allowed in a sequence of ``seq_len`` tokens, ascending."""
        if seq_len <= 0:
            return np.zeros(0, dtype=np.int64)
        rest = np.arange(self.head or self.step, seq_len, self.step)
        return np.concatenate([[0], rest]).astype(np.int64)


#: The default grid: a window may start at any token; padding id 0.
EVERY_TOKEN = WindowGrid()


@dataclass(frozen=True, eq=False)  # arrays inside: compare contents explicitly
class Windows:
    """A batch of windows.

    Attributes:
        tokens: ``int64 (n, length + 1)`` token ids, the grid's pad id after the end of a sequence.
        mask: ``bool (n, length + 1)``, ``True`` on real tokens.
        seq_index: ``int64 (n,)``, which input sequence each window comes from.
        start: ``int64 (n,)``, position in that sequence of the window's first token.
        scored: ``bool (n, length + 1)``, ``True`` on the real tokens whose prediction counts
            (overlapping evaluation windows score each target in one window only); None: every
            real token (``mask``).
    """

    tokens: np.ndarray
    mask: np.ndarray
    seq_index: np.ndarray
    start: np.ndarray
    scored: np.ndarray | None = None

    @property
    def targets(self) -> np.ndarray:
        """``bool (n, length)``: the targets ``tokens[:, 1:]`` that count."""
        return (self.mask if self.scored is None else self.scored)[:, 1:]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_targets(self) -> int:
        """Number of scored target tokens, ``targets.sum()``."""
        return int(self.targets.sum())

    def batches(self, batch_size: int) -> Iterator[Windows]:
        """Consecutive slices of at most ``batch_size`` windows, in order."""
        _check_positive_int("batch_size", batch_size)
        for i in range(0, len(self), batch_size):
            sl = slice(i, i + batch_size)
            scored = None if self.scored is None else self.scored[sl]
            yield Windows(
                self.tokens[sl], self.mask[sl], self.seq_index[sl], self.start[sl], scored
            )


def _check_seqs(token_seqs: Sequence[Any]) -> list[np.ndarray]:
    if isinstance(token_seqs, np.ndarray) or not isinstance(token_seqs, Sequence):
        raise TypeError(
            f"token_seqs: expected a sequence of 1-D token arrays, got {type(token_seqs).__name__}"
        )
    out = []
    for i, s in enumerate(token_seqs):
        arr = np.asarray(s)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"token_seqs[{i}]: expected a 1-D integer array, got shape {arr.shape}, "
                f"dtype {arr.dtype}"
            )
        out.append(arr.astype(np.int64, copy=False))
    return out


def _at_or_before(bounds: np.ndarray, position: int) -> int:
    """The last boundary ``≤ position`` (``bounds`` ascending, from 0)."""
    return int(bounds[np.searchsorted(bounds, position, side="right") - 1])


def _after(bounds: np.ndarray, position: int) -> int:
    """The first boundary after ``position`` (the sequence's length where none is)."""
    at = int(np.searchsorted(bounds, position, side="right"))
    return int(bounds[at]) if at < len(bounds) else int(bounds[-1]) + 1


def _window(seq: np.ndarray, start: int, size: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    chunk = seq[start : start + size]
    tokens = np.full(size, pad, dtype=np.int64)
    tokens[: len(chunk)] = chunk
    mask = np.zeros(size, dtype=bool)
    mask[: len(chunk)] = True
    return tokens, mask


def random_windows(
    token_seqs: Sequence[Any],
    batch_size: int,
    length: int,
    rng: np.random.Generator,
    *,
    grid: WindowGrid = EVERY_TOKEN,
    weighted: bool = True,
) -> Windows:
    """``batch_size`` random training windows of ``length + 1`` tokens.

    Each window picks a sequence (with probability proportional to its number of tokens when
    ``weighted``, so every token is about equally likely to be seen; uniformly otherwise), then a
    start uniformly among its boundaries ``s`` with ``s + length + 1 ≤ len`` — plus the first
    boundary past that limit, so the last tokens (EOS) can be drawn even when ``length`` is not a
    multiple of the grid's step. A sequence of at most ``length + 1`` tokens is taken whole, padded.

    Args:
        token_seqs: 1-D int arrays of token ids.
        batch_size: number of windows.
        length: model context; windows hold ``length + 1`` tokens.
        rng: ``numpy.random.Generator``.
        grid: where windows may start, and the padding id.
        weighted: sample sequences by length (default) or uniformly.
    """
    seqs = _check_seqs(token_seqs)
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("length", length)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected numpy.random.Generator, got {type(rng).__name__}")
    if not seqs:
        raise ValueError("token_seqs: empty, nothing to sample from")
    lengths = np.array([len(s) for s in seqs], dtype=np.float64)
    if lengths.sum() == 0:
        raise ValueError("token_seqs: all sequences are empty")
    p = lengths / lengths.sum() if weighted else (lengths > 0) / (lengths > 0).sum()
    size = length + 1
    which = rng.choice(len(seqs), size=batch_size, p=p)
    tokens = np.empty((batch_size, size), dtype=np.int64)
    mask = np.empty((batch_size, size), dtype=bool)
    starts = np.empty(batch_size, dtype=np.int64)
    for b, i in enumerate(which):
        seq = seqs[i]
        bounds = grid.boundaries(len(seq))
        last = len(seq) - size  # largest start that fills the window
        if last <= 0:
            start = 0
        else:
            n_ok = int(np.searchsorted(bounds, last, side="right"))
            # Boundaries <= last, plus the next one if `last` itself isn't a boundary.
            n = n_ok + (1 if n_ok < len(bounds) and bounds[n_ok - 1] != last else 0)
            start = int(bounds[rng.integers(n)])
        tokens[b], mask[b] = _window(seq, start, size, grid.pad)
        starts[b] = start
    return Windows(tokens, mask, which.astype(np.int64), starts)


def eval_windows(
    token_seqs: Sequence[Any],
    length: int,
    *,
    grid: WindowGrid = EVERY_TOKEN,
    stride: int | None = None,
) -> Windows:
    """Deterministic windows that score every token of every sequence exactly once.

    For each sequence (in order), windows start at step boundaries ``0 = s_0 < s_1 < ...``;
    window ``j`` holds tokens ``[s_j, e_j]`` (inputs ``[s_j, e_j)``, targets ``(s_j, e_j]``),
    ``e_j`` the last boundary ``≤ s_j + length`` (the sequence's end for the last window), padded
    to ``length + 1``. Without ``stride``, ``s_{j+1} = e_j``: the windows tile the sequence and each
    window's context restarts at its first token. With ``stride``, ``s_{j+1}`` is the last
    boundary ``≤ s_j + stride``: the windows overlap, and window ``j`` scores only its targets
    after ``e_{j-1}`` (``Windows.scored``), so every target but the first window's has at least
    ``length - stride`` tokens of its past (a sliding-window evaluation). Either way the targets
    of a sequence of ``n`` tokens are positions ``1..n-1`` (the first is never a target), each
    exactly once, and ``Windows.num_targets == sum(n - 1)``: summing NLL over ``targets`` and
    dividing by ``num_targets`` gives the per-token NLL.

    Args:
        length: tokens a window reads, at least ``grid.step`` and ``grid.head`` (a window always
            advances).
        stride: tokens between window starts, ``grid.step ≤ stride ≤ length``; None: ``length``
            (no overlap; the figure the trainer validates with).
    """
    seqs = _check_seqs(token_seqs)
    _check_positive_int("length", length)
    if length < max(grid.step, grid.head):  # else a window could not reach the next boundary
        raise ValueError(
            f"length: expected at least {max(grid.step, grid.head)} (one step), got {length}"
        )
    if stride is not None:
        _check_positive_int("stride", stride)
        if not grid.step <= stride <= length:
            raise ValueError(
                f"stride: expected {grid.step} (one step) to length={length}, got {stride}"
            )
    size = length + 1
    rows: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    scored: list[np.ndarray] = []
    index: list[int] = []
    starts: list[int] = []
    for i, seq in enumerate(seqs):
        n = len(seq)
        if n < 2:  # nothing to predict
            continue
        bounds = grid.boundaries(n)
        start, done = 0, 0  # targets at positions <= done are scored already
        while True:
            stop = n - 1 if start + length >= n - 1 else _at_or_before(bounds, start + length)
            if stop <= done:  # it would score nothing new (a stride under a step's reach)
                start = _after(bounds, start)
                continue
            row, m = _window(seq[: stop + 1], start, size, grid.pad)
            counts = m.copy()
            counts[: done - start + 1] = False
            rows.append(row)
            masks.append(m)
            scored.append(counts)
            index.append(i)
            starts.append(start)
            if stop >= n - 1:
                break
            # The next start: at the stride (but past this start, and not past this stop).
            ahead = (
                stop
                if stride is None
                else max(_at_or_before(bounds, start + stride), _after(bounds, start))
            )
            start, done = min(ahead, stop), stop
    if not rows:
        empty = np.zeros((0, size), dtype=np.int64)
        no_tokens = empty.astype(bool)
        return Windows(empty, no_tokens, np.zeros(0, np.int64), np.zeros(0, np.int64), no_tokens)
    return Windows(
        np.stack(rows),
        np.stack(masks),
        np.array(index, np.int64),
        np.array(starts, np.int64),
        np.stack(scored),
    )
