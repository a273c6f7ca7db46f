"""Per-token positions: the one place in relpos where positions are computed.

Every positional scheme is a function of *token positions*, never of array indices. A
:class:`Positions` value carries, for every token of a batch, its position inside its own sequence
and the id of the sequence (segment) it belongs to. Padding tokens belong to no segment
(``segment == -1``): they have no position, attend nowhere and are attended by nobody.

A token may also carry *coordinates*, one per axis (row and column of an image patch; time, height
and width of a video token), for the multi-axis rotary embeddings (M-RoPE, axial RoPE). ``pos`` and
``seg`` keep their meaning (the position is the token's rank inside its segment), so masks, caches
and every one-axis scheme work unchanged on such positions.

A token may also carry a *contextual position* computed from the layer's input: ``log_decay``, a
cumulative sum over the earlier tokens of its own segment (the Forgetting Transformer's forget
gates; :meth:`Positions.with_log_decay`). Like coordinates it follows the tokens through slicing,
expansion and concatenation, so a KV cache carries it.

Shape legend: ``b`` batch, ``n`` tokens, ``a`` axes, ``i`` query, ``j`` key. A ``Positions`` may
have batch size 1 and stand for every row of a batch (the plain ``from_length`` case): its tensors
broadcast.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "PAD_SEGMENT",
    "Positions",
    "as_offset",
    "dense_segment_ids",
    "distance_range",
    "promised_distance_range",
    "resolve_positions",
    "sequence_lengths",
]

#: Segment id of padding tokens.
PAD_SEGMENT = -1


def _check_int_tensor(name: str, t: Tensor, ndim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def as_offset(offset: int | Tensor, batch: int, device: torch.device | None) -> Tensor:
    """Normalise a decoding offset (scalar or per row) to an int64 tensor of shape ``(b, 1)``."""
    if isinstance(offset, bool):
        raise TypeError("offset must be an int or an integer tensor, got bool")
    if isinstance(offset, int):
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        return torch.full((1, 1), offset, dtype=torch.long, device=device)
    if not isinstance(offset, Tensor):
        raise TypeError(f"offset must be an int or an integer tensor, got {type(offset).__name__}")
    if offset.dtype.is_floating_point or offset.dtype == torch.bool:
        raise TypeError(f"offset must hold integers, got dtype {offset.dtype}")
    if offset.ndim == 0:
        offset = offset.reshape(1)
    if offset.ndim != 1 or offset.shape[0] not in (1, batch):
        raise ValueError(
            f"offset must be a scalar or have shape ({batch},), got shape {tuple(offset.shape)}"
        )
    if bool((offset < 0).any()):
        raise ValueError("offset must be >= 0")
    return offset.to(device=device, dtype=torch.long).reshape(-1, 1)


@dataclass(frozen=True, eq=False)
class Positions:
    """Where every token is: position inside its own sequence and the sequence it belongs to.

    Build one with a constructor rather than by hand: :meth:`from_length`,
    :meth:`from_padding_mask`, :meth:`from_segments`, :meth:`from_lengths`, :meth:`from_grids`;
    give tokens coordinates with :meth:`with_coords`; continue one for KV-cache decoding with
    :meth:`continued` or an ``offset``.

    Attributes:
        pos: ``(b, n)`` int64, the token's position inside its own sequence (0 for padding).
        seg: ``(b, n)`` int64, the token's sequence id within its row; ``-1`` for padding.
        coords: ``(b, n, a)`` int64 coordinates, one per axis, or None (one axis: ``pos``).
            Padding tokens have coordinates 0. Only multi-axis schemes read them.
        log_decay: ``(b, n, c)`` float, or None: per channel (a head), the cumulative log decay
            ``Σ log f_l`` over the tokens ``l`` of the token's segment at positions up to its own
            (:meth:`with_log_decay`); 0 for padding. Set per attention layer from its input (the
            ``contextualize`` hook); only decay schemes (``forgetting``) read it.

    ``b`` may be 1 for a batch whose rows all share the same positions.
    """

    pos: Tensor
    seg: Tensor
    #: Static promise that ``pos[r, t] == t + c`` for one shared ``c``, one segment, no padding
    #: (set by :meth:`from_length` with an int offset). Lets kernels use index arithmetic, like the
    #: Music Transformer skew, instead of gathers. Never inferred from data.
    contiguous: bool = False
    #: Static bound on ``|pos_i - pos_j|`` for two tokens of the same row, or None if unknown.
    #: Every constructor knows it (positions are ranks inside a row: ``n - 1``), so kernels can
    #: size relative tables to the distances that can occur without reading the data.
    #: It bounds pairs of *these* tokens only: a query and a key of two different ``Positions``
    #: (cross-attention) may be farther apart.
    span: int | None = None
    coords: Tensor | None = None
    log_decay: Tensor | None = None
    #: What :meth:`derived` keeps: by key, the keys' ``Positions`` (weakly) and the value.
    _derived: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int_tensor("pos", self.pos, 2)
        _check_int_tensor("seg", self.seg, 2)
        if self.pos.shape != self.seg.shape:
            raise ValueError(
                f"pos and seg must have the same shape, got {tuple(self.pos.shape)} "
                f"and {tuple(self.seg.shape)}"
            )
        if self.coords is not None:
            _check_int_tensor("coords", self.coords, 3)
            if self.coords.shape[:2] != self.pos.shape or self.coords.shape[2] < 1:
                raise ValueError(
                    f"coords must have shape (b, n, a) with (b, n) = {tuple(self.pos.shape)} "
                    f"and a >= 1, got {tuple(self.coords.shape)}"
                )
        if self.log_decay is not None:
            _check_decay("log_decay", self.log_decay, tuple(self.pos.shape))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_length(
        cls, n: int, *, offset: int | Tensor = 0, device: torch.device | str | None = None
    ) -> Positions:
        """Positions ``offset, offset+1, …`` for ``n`` tokens, one sequence per row.

        Returns a batch-1 value (broadcasts over any batch) unless ``offset`` is per row.
        """
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        batch = offset.numel() if isinstance(offset, Tensor) else 1  # as_offset checks the rest
        off = as_offset(offset, batch=batch, device=device)
        pos = torch.arange(n, device=off.device).unsqueeze(0) + off
        return cls(pos, torch.zeros_like(pos), contiguous=off.shape[0] == 1, span=max(n - 1, 0))

    @classmethod
    def from_padding_mask(cls, mask: Tensor, *, offset: int | Tensor = 0) -> Positions:
        """Positions from a ``(b, n)`` boolean mask, True for real tokens, False for padding.

        Works for left, right or any padding: a real token's position is the number of real tokens
        before it in its row (plus ``offset``).
        """
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = token), got dtype {mask.dtype}")
        if mask.ndim != 2:
            raise ValueError(f"mask must have shape (b, n), got shape {tuple(mask.shape)}")
        seg = torch.where(mask, 0, PAD_SEGMENT).long()
        return cls.from_segments(seg, offset=offset)

    @classmethod
    def from_segments(cls, segment_ids: Tensor, *, offset: int | Tensor = 0) -> Positions:
        """Positions for packed rows from ``(b, n)`` integer segment ids (``-1`` for padding).

        A token's position is the number of earlier tokens in its row with the same segment id, so
        positions restart at every document and skip padding. Tokens of different segments never
        attend to each other. ``offset`` (scalar or per row) is added to every position.
        """
        _check_int_tensor("segment_ids", segment_ids, 2)
        seg = segment_ids.long()
        if bool((seg < PAD_SEGMENT).any()):
            raise ValueError("segment_ids must be >= 0, or -1 for padding")
        b, n = seg.shape
        off = as_offset(offset, batch=b, device=seg.device)
        idx = torch.arange(n, device=seg.device).expand(b, n)
        # Rank of each token among the tokens of its segment, in order of appearance: a stable
        # sort by segment id groups each segment with its tokens in row order; within a group the
        # rank is (sorted index - index where the group starts).
        order = torch.sort(seg, dim=-1, stable=True).indices
        sorted_seg = torch.gather(seg, -1, order)
        starts = torch.ones_like(sorted_seg, dtype=torch.bool)
        starts[:, 1:] = sorted_seg[:, 1:] != sorted_seg[:, :-1]
        group_start = torch.cummax(torch.where(starts, idx, 0), dim=-1).values
        rank = torch.empty_like(seg).scatter_(-1, order, idx - group_start)
        pos = torch.where(seg == PAD_SEGMENT, 0, rank + off)
        # Ranks lie in [0, n-1] and the offset is per row, so |Δpos| <= n - 1 within a row.
        return cls(pos, seg, span=max(n - 1, 0))

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[Sequence[int]], n: int, *, device: torch.device | str | None = None
    ) -> Positions:
        """Positions for packed rows from per-row document lengths, padding the rest of each row.

        ``from_lengths([[3, 2], [4]], n=5)`` packs documents of 3 and 2 tokens into row 0 and one of
        4 tokens (then one padding token) into row 1.
        """
        rows = []
        for r, row in enumerate(lengths):
            ids: list[int] = []
            for s, length in enumerate(row):
                if isinstance(length, bool) or not isinstance(length, int) or length < 0:
                    raise ValueError(
                        f"lengths[{r}][{s}] must be a non-negative int, got {length!r}"
                    )
                ids += [s] * length
            if len(ids) > n:
                raise ValueError(f"lengths[{r}] sums to {len(ids)} tokens, more than n={n}")
            rows.append(ids + [PAD_SEGMENT] * (n - len(ids)))
        if not rows:
            raise ValueError("lengths must hold at least one row")
        return cls.from_segments(torch.tensor(rows, dtype=torch.long, device=device))

    @classmethod
    def from_grids(
        cls,
        grids: Sequence[Sequence[Sequence[int]]],
        n: int,
        *,
        device: torch.device | str | None = None,
    ) -> Positions:
        """Positions for packed rows of grids (images, videos), padding the rest of each row.

        Each grid is one segment; its tokens come in row-major order, so a token's coordinates
        are its multi-index in the grid and its position its flat rank (causal attention then
        follows raster order). ``from_grids([[(2, 3), (1, 2)], [(3, 3)]], n=9)`` packs a 2×3 and a
        1×2 image into row 0 (then one padding token) and a 3×3 image into row 1.

        Args:
            grids: per row, the shapes of its grids, every shape with the same number of axes.
            n: tokens per row.
        """
        for r, row in enumerate(grids):
            for s, shape in enumerate(row):
                if not isinstance(shape, Sequence) or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in shape
                ):
                    raise ValueError(
                        f"grids[{r}][{s}] must be a shape of non-negative ints, got {shape!r}"
                    )
        axes = {len(shape) for row in grids for shape in row}
        if len(axes) != 1 or 0 in axes:
            raise ValueError(
                "grids must hold at least one grid, and every grid the same number (>= 1) of "
                f"axes; got {[[tuple(shape) for shape in row] for row in grids]}"
            )
        (a,) = axes
        lengths, parts = [], []
        for row in grids:
            lengths.append([math.prod(shape) for shape in row])
            for shape in row:
                axis_ranges = [torch.arange(x, device=device) for x in shape]
                grid = torch.meshgrid(*axis_ranges, indexing="ij")
                parts.append(torch.stack(grid, -1).reshape(-1, a))
        positions = cls.from_lengths(lengths, n, device=device)
        coords = torch.zeros(positions.batch, n, a, dtype=torch.long, device=positions.device)
        coords[positions.valid] = torch.cat(parts).to(positions.device)
        return positions.with_coords(coords)

    def with_coords(self, coords: Tensor) -> Positions:
        """A copy with explicit coordinates ``(b, n, a)`` (any layout: e.g. M-RoPE's text, image
        and video tokens in one row); padding tokens get coordinates 0. A batch-1 value expands
        to the coordinates' batch, and batch-1 coordinates to this value's batch."""
        _check_int_tensor("coords", coords, 3)
        b = max(self.batch, coords.shape[0])
        base = self.expand(b)
        if coords.shape[0] == 1 and b > 1:
            coords = coords.expand(b, -1, -1)
        checked = Positions(base.pos, base.seg, base.contiguous, base.span, coords.long())
        zeroed = torch.where(checked.valid.unsqueeze(-1), checked.coords, 0)
        return Positions(base.pos, base.seg, base.contiguous, base.span, zeroed, base.log_decay)

    def with_log_decay(self, log_f: Tensor, *, cached: Positions | None = None) -> Positions:
        """A copy whose tokens carry the cumulative log decay of their own sequence.

        Token ``t`` gets ``c_t = Σ log_f_l`` over the tokens ``l`` of its segment at positions
        ``<= p_t``, so that ``c_i - c_j = Σ_{p_j < p_l <= p_i} log_f_l`` for a query ``i`` and a
        key ``j`` of one segment (the Forgetting Transformer's bias, Lin et al., 2025). The sums
        restart at every segment (packed documents) and skip padding, whose ``log_f`` is ignored
        (NaN included) and whose value is 0; a non-finite ``log_f`` makes the rest of its own
        segment NaN and nothing else.

        Args:
            log_f: ``(b|1, n, c)`` float, per token and channel (a head), e.g. ``log σ(w·x + b)``.
            cached: the positions of earlier tokens of these rows with their ``log_decay`` (a KV
                cache's): a token continues the value of the cached token of its segment with the
                largest position. New tokens come after the cached tokens of their segment (as
                in decoding), so decoding by one token or by chunks gives the full forward's
                values.

        Precision: the sums run in float64 and are kept in float64 (float32 on MPS, which has no
        float64), so ``c_i - c_j`` loses nothing to the growth of ``c`` with the sequence's length
        (in float32, a ``c`` of ``-10^4`` would be known to ``10^-3`` only).

        Shapes: returns positions of batch ``b = max(b, self.batch)``, ``log_decay (b, n, c)``.
        """
        _check_decay("log_f", log_f, None)
        b = max(self.batch, log_f.shape[0])
        if log_f.shape[1] != len(self) or log_f.shape[0] not in (1, b):
            raise ValueError(
                f"log_f must have shape (b, n, c) with (b|1, n) = {tuple(self.pos.shape)}, got "
                f"{tuple(log_f.shape)}"
            )
        base = self.expand(b)
        acc = torch.float32 if log_f.device.type == "mps" else torch.float64
        step = torch.where(base.valid.unsqueeze(-1), log_f.expand(b, -1, -1).to(acc), 0.0)
        if cached is not None and len(cached):
            width = None if cached.log_decay is None else cached.log_decay.shape[-1]
            if width != log_f.shape[-1]:
                raise ValueError(
                    f"cached positions must carry a log_decay of {log_f.shape[-1]} channels "
                    f"(those of earlier calls), got {width} (None: no log_decay)"
                )
            if cached.batch not in (1, b):
                raise ValueError(f"cached positions have batch {cached.batch}, expected {b}")
            old = cached.expand(b)
            # Every cached token restarts the running sum at its own value, so a new token adds
            # its segment's log_f to the value of the latest cached token before it.
            anchors = torch.where(old.valid.unsqueeze(-1), old.log_decay.to(acc), 0.0)
            restart = torch.cat([old.valid, torch.zeros_like(base.valid)], 1)
            total = _segment_cumsum(
                torch.cat([anchors, step], 1),
                torch.cat([old.seg, base.seg], 1),
                torch.cat([old.pos, base.pos], 1),
                restart,
            )
            decay = total[:, len(old) :]
        elif base.contiguous:  # one sequence per row, in order: a plain running sum
            decay = step.cumsum(1)
        else:
            decay = _segment_cumsum(step, base.seg, base.pos)
        decay = torch.where(base.valid.unsqueeze(-1), decay, 0.0)
        return Positions(base.pos, base.seg, base.contiguous, base.span, base.coords, decay)

    # ------------------------------------------------------------------ views
    @property
    def batch(self) -> int:
        return self.pos.shape[0]

    def __len__(self) -> int:
        return self.pos.shape[1]

    @property
    def device(self) -> torch.device:
        return self.pos.device

    @property
    def valid(self) -> Tensor:
        """``(b, n)`` bool: True for real tokens, False for padding."""
        return self.seg != PAD_SEGMENT

    @property
    def num_axes(self) -> int | None:
        """Coordinates per token, or None when the positions have one axis (no ``coords``)."""
        return None if self.coords is None else self.coords.shape[-1]

    def to(self, device: torch.device | str) -> Positions:
        coords = None if self.coords is None else self.coords.to(device)
        decay = None if self.log_decay is None else self.log_decay.to(device)
        return Positions(
            self.pos.to(device), self.seg.to(device), self.contiguous, self.span, coords, decay
        )

    def detach(self) -> Positions:
        """The same positions with ``log_decay`` detached from its graph (a stop-gradient memory
        keeps no graph of earlier segments)."""
        if self.log_decay is None:
            return self
        return Positions(
            self.pos, self.seg, self.contiguous, self.span, self.coords, self.log_decay.detach()
        )

    def expand(self, batch: int) -> Positions:
        """The same positions for ``batch`` rows (only a batch-1 value can expand)."""
        if self.batch == batch:
            return self
        if self.batch != 1:
            raise ValueError(f"cannot expand Positions of batch {self.batch} to batch {batch}")
        coords = None if self.coords is None else self.coords.expand(batch, -1, -1)
        decay = None if self.log_decay is None else self.log_decay.expand(batch, -1, -1)
        return Positions(
            self.pos.expand(batch, -1),
            self.seg.expand(batch, -1),
            self.contiguous,
            self.span,
            coords,
            decay,
        )

    def __getitem__(self, tokens: slice) -> Positions:
        """The positions of a slice of tokens, e.g. one block of queries: ``positions[i0:i1]``."""
        if not isinstance(tokens, slice):
            raise TypeError(
                f"Positions can be sliced along tokens only, got {type(tokens).__name__}"
            )
        contiguous = self.contiguous and tokens.step in (None, 1)
        coords = None if self.coords is None else self.coords[:, tokens]
        decay = None if self.log_decay is None else self.log_decay[:, tokens]
        return Positions(
            self.pos[:, tokens], self.seg[:, tokens], contiguous, self.span, coords, decay
        )

    def cat(self, other: Positions) -> Positions:
        """Concatenate along the token axis (cached keys followed by new keys).

        Both or neither must have coordinates, with the same number of axes; likewise a
        ``log_decay`` with the same number of channels."""
        if self.num_axes != other.num_axes:
            raise ValueError(
                "cannot concatenate positions with different coordinate axes: "
                f"{self.num_axes} and {other.num_axes} (None: no coords)"
            )
        widths = [None if p.log_decay is None else p.log_decay.shape[-1] for p in (self, other)]
        if widths[0] != widths[1]:
            raise ValueError(
                "cannot concatenate positions with different log_decay channels: "
                f"{widths[0]} and {widths[1]} (None: no log_decay)"
            )
        b = max(self.batch, other.batch)
        a, o = self.expand(b), other.expand(b)
        coords = None if a.coords is None else torch.cat([a.coords, o.coords], 1)
        decay = None
        if a.log_decay is not None:
            dtype = torch.promote_types(a.log_decay.dtype, o.log_decay.dtype)
            decay = torch.cat([a.log_decay.to(dtype), o.log_decay.to(dtype)], 1)
        return Positions(
            torch.cat([a.pos, o.pos], 1),
            torch.cat([a.seg, o.seg], 1),
            coords=coords,
            log_decay=decay,
        )

    def continued(self, n: int) -> Positions:
        """Positions of ``n`` new tokens that continue each row's last sequence (KV decoding).

        The new tokens join the segment of the row's last real token, at the next positions. A row
        with no real token yet starts segment 0 at position 0.

        With coordinates, new token ``t`` has the coordinate ``c + 1 + t`` on every axis, ``c`` the
        largest coordinate (any axis) of the row's last segment: M-RoPE's rule for text after an
        image or video (Wang et al., 2024, "Qwen2-VL", §2.1; Hugging Face's ``rope_deltas``).
        A ``log_decay`` is not continued: each attention layer computes its new tokens' values from
        its own input (:meth:`with_log_decay` with ``cached=``).
        """
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"n must be an int, got {type(n).__name__} ({n!r})")
        n = int(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        valid = self.valid
        has_any = valid.any(-1, keepdim=True)
        # Last real token of each row: the largest index among real tokens.
        idx = torch.arange(len(self), device=self.device).expand_as(self.pos)
        last = torch.where(valid, idx, -1).max(-1, keepdim=True).values.clamp_min(0)
        last_pos = torch.gather(self.pos, 1, last)
        last_seg = torch.gather(self.seg, 1, last)
        start = torch.where(has_any, last_pos + 1, 0)
        seg = torch.where(has_any, last_seg, 0)
        new = torch.arange(n, device=self.device).unsqueeze(0)
        coords = None
        if self.coords is not None:
            in_last = (valid & (self.seg == last_seg)).unsqueeze(-1)
            low = torch.iinfo(self.coords.dtype).min
            top = torch.where(in_last, self.coords, low).amax(dim=(1, 2)).unsqueeze(-1)
            first = torch.where(has_any, top + 1, 0)
            coords = (first + new).unsqueeze(-1).expand(-1, -1, self.coords.shape[-1]).clone()
        return Positions(start + new, seg.expand(-1, n).clone(), coords=coords)

    def __getstate__(self) -> dict:  # pickle and deepcopy: what derived() keeps is left out
        return {**self.__dict__, "_derived": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def derived(self, keys: Positions | None, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value ``build()`` gives, a function of these positions and ``keys`` (None: these)
        alone: built once and kept as long as both live, so the layers of a model, which share
        one ``Positions`` a step, build it once (a backend's renumbered positions, its kernels'
        block ranges). Rebuilt when a tensor of either was changed in place; built anew, not
        kept, under ``torch.compile`` (the graph computes it). Built outside inference mode, so
        that a value kept from an inference call serves calls with autograd too.
        """
        if torch.compiler.is_compiling():
            return build()
        keys = self if keys is None else keys
        slot, versions = (key, id(keys)), (_versions(self), _versions(keys))
        hit = self._derived.get(slot)
        if hit is not None and hit[0]() is keys and hit[1] == versions:  # not a reused id
            return hit[2]
        with torch.inference_mode(False):
            value = build()
        # One entry per key and keys object, dropped with the keys (a cache's, a context's).
        dropped = functools.partial(_forget, self._derived, slot)
        self._derived[slot] = (weakref.ref(keys, dropped), versions, value)
        return value

    # ------------------------------------------------------------------ pairs
    def distance(self, keys: Positions | None = None) -> Tensor:
        """Relative distance ``k_pos - q_pos`` for every query/key pair, shape ``(b, i, j)``."""
        keys = self if keys is None else keys
        return keys.pos.unsqueeze(-2) - self.pos.unsqueeze(-1)

    def allowed(self, keys: Positions | None = None, *, causal: bool = False) -> Tensor:
        """Which query/key pairs may attend, shape ``(b, i, j)`` bool.

        A pair may attend when both are real tokens of the same segment and, if ``causal``, the key
        is not after the query (``k_pos <= q_pos``).
        """
        keys = self if keys is None else keys
        q_seg, k_seg = self.seg.unsqueeze(-1), keys.seg.unsqueeze(-2)
        ok = (q_seg == k_seg) & (q_seg != PAD_SEGMENT)
        if causal:
            ok = ok & (self.distance(keys) <= 0)
        return ok

    def __repr__(self) -> str:
        coords = "" if self.coords is None else f", coords={self.coords.tolist()}"
        if self.log_decay is not None:
            coords += f", log_decay=<{tuple(self.log_decay.shape)} {self.log_decay.dtype}>"
        return f"Positions(pos={self.pos.tolist()}, seg={self.seg.tolist()}{coords})"


def _forget(derived: dict, slot: tuple, ref: weakref.ref) -> None:
    """Drop ``slot``'s entry once its keys are gone (unless a newer entry took the slot)."""
    entry = derived.get(slot)
    if entry is not None and entry[0] is ref:
        del derived[slot]


def _versions(p: Positions) -> tuple[int, int]:
    """The in-place version counters of ``p``'s ``pos`` and ``seg`` (an inference tensor keeps
    none: -1)."""
    return tuple(-1 if t.is_inference() else t._version for t in (p.pos, p.seg))


def _check_decay(name: str, t: Tensor, shape: tuple[int, ...] | None) -> None:
    """A float ``(b, n, c)`` tensor, ``(b, n) == shape`` when a shape is given."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if t.ndim != 3 or (shape is not None and tuple(t.shape[:2]) != shape):
        want = "(b, n, c)" if shape is None else f"(b, n, c) with (b, n) = {shape}"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _segment_cumsum(
    values: Tensor, seg: Tensor, pos: Tensor, restart: Tensor | None = None
) -> Tensor:
    """Running sums of ``values (b, n, c)`` over each segment's tokens in position order.

    The sum restarts at every segment and at every token where ``restart (b, n)`` is True (that
    token's value starts it). A non-finite value makes the rest of its run NaN, never another run:
    the running sums are taken over the finite values and the non-finite ones are counted apart.
    """
    b, n, c = values.shape
    if n == 0:
        return values
    # Lexicographic (segment, position) order: a stable sort by position, then by segment.
    order = torch.sort(pos, dim=1, stable=True).indices
    by_seg = torch.sort(torch.gather(seg, 1, order), dim=1, stable=True).indices
    order = torch.gather(order, 1, by_seg)
    sorted_seg = torch.gather(seg, 1, order)
    starts = torch.ones_like(sorted_seg, dtype=torch.bool)
    starts[:, 1:] = sorted_seg[:, 1:] != sorted_seg[:, :-1]
    if restart is not None:
        starts = starts | torch.gather(restart, 1, order)
    wide = order.unsqueeze(-1).expand(b, n, c)
    v = torch.gather(values, 1, wide)
    bad = ~torch.isfinite(v)
    clean = torch.where(bad, 0.0, v)
    idx = torch.arange(n, device=values.device).expand(b, n)
    first = torch.cummax(torch.where(starts, idx, 0), dim=1).values.unsqueeze(-1).expand(b, n, c)
    total = clean.cumsum(1)
    runs = total - (torch.gather(total, 1, first) - torch.gather(clean, 1, first))
    nbad = bad.to(torch.int64).cumsum(1)
    poisoned = nbad - (torch.gather(nbad, 1, first) - torch.gather(bad.to(torch.int64), 1, first))
    runs = torch.where(poisoned > 0, torch.nan, runs)
    return runs.new_zeros(b, n, c).scatter(1, wide, runs)


def promised_distance_range(queries: Positions, keys: Positions) -> tuple[int, int] | None:
    """The range of :func:`distance_range` that the positions promise, with no device value
    read: self-attention's ``(-span, span)`` (:attr:`Positions.span`) or, for contiguous
    positions, ``(1 - n, n - 1)``; None for queries and keys of two ``Positions``."""
    if queries is not keys:
        return None
    if queries.span is not None:  # |p_j - p_i| <= span within a row
        return -queries.span, queries.span
    if queries.contiguous:  # p_j - p_i = j - i
        return 1 - len(queries), len(queries) - 1
    return None


def distance_range(queries: Positions, keys: Positions) -> tuple[int, int]:
    """``(lo, hi)`` with every ``k_pos - q_pos`` between real tokens of one row of these queries
    and keys in ``[lo, hi]``; ``(0, 0)`` when no row has both.

    Self-attention (``queries is keys``) reads it from what the positions promise, with no device
    sync: ``(-span, span)`` from :attr:`Positions.span` (every constructor's: padded and packed
    rows included), ``(1 - n, n - 1)`` for contiguous positions. Otherwise one device sync reads
    the values. A sync stalls the host until the GPU drains, so a training step could no longer
    issue its work ahead of the GPU.

    Read from the values, padding's position (0) does not widen it, nor do other rows'
    positions, so a table over the range stays the size of the real distances at any offset,
    per-row offsets included; callers clamp the index of a pair with padding (masked anyway).
    """
    if queries.pos.numel() == 0 or keys.pos.numel() == 0:  # no tokens, or an empty batch
        return 0, 0
    promised = promised_distance_range(queries, keys)
    if promised is not None:
        return promised
    far = torch.iinfo(torch.int64).max // 4  # beyond any position; differences stay in range

    def extremes(p: Positions) -> tuple[Tensor, Tensor]:  # (b|1,) each
        real = p.seg != PAD_SEGMENT
        return torch.where(real, p.pos, far).amin(1), torch.where(real, p.pos, -far).amax(1)

    (q_lo, q_hi), (k_lo, k_hi) = extremes(queries), extremes(keys)
    both = (q_lo != far) & (k_lo != far)  # rows with a real query and a real key
    lo = torch.where(both, k_lo - q_hi, far).min()
    hi = torch.where(both, k_hi - q_lo, -far).max()
    lo, hi = torch.stack((lo, hi)).tolist()
    return (0, 0) if lo == far else (lo, hi)


def dense_segment_ids(seg: Tensor) -> Tensor:
    """``(b, n)`` int64: each row's segment ids (padding's ``-1`` included) renumbered ``0, 1, …``
    in their order, so a table indexed by segment has ``n`` slots whatever the ids' values.

    A stable sort by id, a new group wherever the id changes, scattered back.
    """
    order = torch.sort(seg, dim=-1, stable=True).indices
    sorted_seg = torch.gather(seg, -1, order)
    starts = torch.ones_like(sorted_seg, dtype=torch.bool)
    starts[:, 1:] = sorted_seg[:, 1:] != sorted_seg[:, :-1]
    return torch.empty_like(seg).scatter_(-1, order, starts.long().cumsum(-1) - 1)


def sequence_lengths(*parts: Positions) -> tuple[Tensor, ...]:
    """The length of the sequence every token belongs to, over the tokens of ``parts`` together.

    A sequence is one segment of one row; its length is one more than the largest position any of
    its tokens in ``parts`` has (queries and keys of one attention call, or everything a KV cache
    has seen), so a packed document gets its own length and a decoded row its length so far.
    Padding tokens get 0. Used by length-dependent RoPE scalings (dynamic NTK, LongRoPE).

    Returns:
        one ``(b, n_p)`` int64 tensor per part (``b`` the largest batch of the parts).
    """
    b = max(p.batch for p in parts)
    parts = tuple(p.expand(b) for p in parts)
    pos = torch.cat([p.pos for p in parts], 1)
    seg = torch.cat([p.seg for p in parts], 1)
    group = dense_segment_ids(seg)
    last = torch.zeros_like(seg).scatter_reduce_(-1, group, pos, "amax", include_self=False)
    lengths = torch.where(seg == PAD_SEGMENT, 0, torch.gather(last, -1, group) + 1)
    return tuple(lengths.split([len(p) for p in parts], dim=1))


def resolve_positions(
    batch: int,
    n: int,
    *,
    positions: Positions | None = None,
    padding_mask: Tensor | None = None,
    segment_ids: Tensor | None = None,
    cached: Positions | None = None,
    device: torch.device | None = None,
    prefix: str = "",
) -> Positions:
    """The :class:`Positions` of ``n`` new tokens in ``batch`` rows, from whichever the caller gave.

    At most one of ``positions``, ``padding_mask`` (True = token) and ``segment_ids`` may be given.
    With none, the tokens continue ``cached`` (the KV cache's positions) or start at 0. With a
    non-empty cache, a mask or segment ids would not say where the new tokens continue, so pass
    ``positions`` (e.g. ``cache.positions.continued(n)``) or nothing.

    ``prefix`` goes before the argument names in error messages, so that a caller whose arguments
    are called e.g. ``context_positions`` gets errors that name them (``prefix="context_"``).
    """
    names = {a: prefix + a for a in ("positions", "padding_mask", "segment_ids")}
    given = [
        names[name]
        for name, v in (
            ("positions", positions),
            ("padding_mask", padding_mask),
            ("segment_ids", segment_ids),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(f"pass at most one of {', '.join(names.values())}; got {given}")
    if cached is not None and len(cached) and given and given[0] != names["positions"]:
        raise ValueError(
            f"{given[0]} cannot be combined with a non-empty KV cache: pass positions= "
            "(e.g. cache.positions.continued(n)) or nothing to continue each row"
        )
    for name, mask in (("padding_mask", padding_mask), ("segment_ids", segment_ids)):
        if mask is None:
            continue
        if not isinstance(mask, Tensor):
            raise TypeError(f"{names[name]} must be a torch.Tensor, got {type(mask).__name__}")
        if mask.ndim != 2 or tuple(mask.shape) != (batch, n):
            raise ValueError(
                f"{names[name]} must have shape (b, n) = ({batch}, {n}), got {tuple(mask.shape)}"
            )
    if padding_mask is not None and padding_mask.dtype != torch.bool:
        raise TypeError(
            f"{names['padding_mask']} must be a bool tensor (True = token), got dtype "
            f"{padding_mask.dtype}"
        )
    if padding_mask is not None:
        positions = Positions.from_padding_mask(padding_mask)
    elif segment_ids is not None:
        positions = Positions.from_segments(segment_ids)
    elif positions is None:
        if cached is not None and len(cached):
            if cached.batch not in (1, batch):
                raise ValueError(
                    f"the cache holds {cached.batch} rows; the new tokens come in {batch} rows "
                    f"(input batch {batch}, expected {cached.batch}); pass {cached.batch} rows or "
                    "start a new cache"
                )
            positions = cached.continued(n)
        else:
            positions = Positions.from_length(n, device=device)
    if not isinstance(positions, Positions):
        raise TypeError(f"{names['positions']} must be a Positions, got {type(positions).__name__}")
    if len(positions) != n or positions.batch not in (1, batch):
        raise ValueError(
            f"{names['positions']} have shape (b, n) = {tuple(positions.pos.shape)}; expected "
            f"({batch}, {n}) or (1, {n})"
        )
    if device is not None and positions.device != torch.device(device):
        positions = positions.to(device)
    return positions
