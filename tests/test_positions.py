"""Positions: every constructor gives each token its position inside its own sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from relpos import Positions
from relpos.positions import distance_range, promised_distance_range

lengths = st.lists(st.integers(0, 7), min_size=1, max_size=4)


def test_from_length_is_a_broadcastable_range():
    p = Positions.from_length(4, offset=3)
    assert p.pos.tolist() == [[3, 4, 5, 6]] and p.seg.tolist() == [[0, 0, 0, 0]]
    assert p.batch == 1 and p.contiguous


@given(lengths, st.integers(0, 3), st.booleans())
def test_padding_mask_positions_count_real_tokens(lens, extra, left):
    n = max(lens) + extra
    mask = torch.zeros(len(lens), n, dtype=torch.bool)
    for r, length in enumerate(lens):
        if left:
            mask[r, n - length :] = True
        else:
            mask[r, :length] = True
    p = Positions.from_padding_mask(mask)
    for r, length in enumerate(lens):
        assert p.pos[r][mask[r]].tolist() == list(range(length))
        assert p.seg[r][~mask[r]].eq(-1).all()
        assert p.pos[r][~mask[r]].eq(0).all()


@given(st.lists(lengths, min_size=1, max_size=3), st.integers(0, 2))
def test_packed_positions_restart_at_every_document(rows, extra):
    n = max(sum(r) for r in rows) + extra
    p = Positions.from_lengths(rows, n)
    for r, docs in enumerate(rows):
        expected = [t for length in docs for t in range(length)]
        assert p.pos[r, : len(expected)].tolist() == expected
        assert p.seg[r, len(expected) :].eq(-1).all()


def test_segments_may_be_interleaved_with_padding():
    p = Positions.from_segments(torch.tensor([[-1, 4, 4, -1, 4, 2, 2]]))
    assert p.pos.tolist() == [[0, 0, 1, 0, 2, 0, 1]]
    allowed = p.allowed(causal=True)[0]
    assert allowed[4].tolist() == [False, True, True, False, True, False, False]
    assert not allowed[0].any() and not allowed[:, 0].any()


def test_offset_per_row_and_continuation():
    p = Positions.from_padding_mask(
        torch.tensor([[0, 1, 1], [1, 1, 1]]).bool(), offset=torch.tensor([5, 0])
    )
    assert p.pos.tolist() == [[0, 5, 6], [0, 1, 2]]
    c = p.continued(2)
    assert c.pos.tolist() == [[7, 8], [3, 4]] and c.seg.tolist() == [[0, 0], [0, 0]]
    empty = Positions.from_padding_mask(torch.zeros(1, 3, dtype=torch.bool)).continued(1)
    assert empty.pos.tolist() == [[0]] and empty.seg.tolist() == [[0]]


def test_distance_and_causal_mask():
    p = Positions.from_segments(torch.tensor([[0, 0, 1, 1]]))
    assert p.distance()[0].tolist() == [[0, 1, 0, 1], [-1, 0, -1, 0], [0, 1, 0, 1], [-1, 0, -1, 0]]
    assert p.allowed(causal=True)[0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 0, 1, 1],
    ]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: Positions.from_segments(torch.zeros(2, 3)), TypeError, "integers"),
        (
            lambda: Positions.from_segments(torch.zeros(3, dtype=torch.long)),
            ValueError,
            r"shape \(3,\)",
        ),
        (lambda: Positions.from_segments(torch.tensor([[-2, 0]])), ValueError, "-1 for padding"),
        (lambda: Positions.from_padding_mask(torch.ones(2, 3)), TypeError, "bool"),
        (lambda: Positions.from_length(3, offset=-1), ValueError, "offset"),
        (lambda: Positions.from_length(3.0), TypeError, "int"),
        (lambda: Positions.from_lengths([[2, 3]], 4), ValueError, "more than n=4"),
        (
            lambda: Positions(
                torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)
            ),
            ValueError,
            "same shape",
        ),
        (
            lambda: Positions.from_padding_mask(
                torch.ones(2, 3, dtype=torch.bool), offset=torch.tensor([1, 2, 3])
            ),
            ValueError,
            r"shape \(2,\)",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_distance_range_spans_real_tokens_only():
    """Padding sits at position 0; it must not stretch the range of tokens far from 0."""
    mask = torch.tensor([[False, True, True], [True, True, False]])
    qp = Positions.from_padding_mask(mask, offset=100)  # real positions 100, 101 in both rows
    kp = Positions.from_length(4, offset=98)  # 98 … 101
    assert distance_range(qp, kp) == (98 - 101, 101 - 100)
    assert distance_range(qp, qp) == (-2, 2)  # self-attention: the span's (n - 1), not read
    unpromised = Positions(qp.pos, qp.seg)  # the same values, no span: read from them
    assert distance_range(unpromised, unpromised) == (-1, 1)
    nothing = Positions.from_padding_mask(torch.zeros(2, 3, dtype=torch.bool))
    assert distance_range(nothing, kp) == (0, 0) and distance_range(qp, nothing) == (0, 0)
    assert distance_range(Positions.from_length(0), kp) == (0, 0)
    empty_batch = Positions.from_segments(torch.zeros(0, 3, dtype=torch.long))
    assert distance_range(empty_batch, empty_batch) == (0, 0)


def test_distance_range_is_per_row():
    """Rows at far-apart offsets (per-row decoding) keep the range of one row's distances, and a
    row without a real key adds nothing."""
    far_apart = Positions.from_length(3, offset=torch.tensor([0, 10**9]))
    assert distance_range(far_apart, far_apart) == (-2, 2)
    keys = Positions.from_padding_mask(torch.tensor([[True, True], [False, False]]), offset=5)
    queries = Positions.from_length(1, offset=torch.tensor([6, 10**9]))
    assert distance_range(queries, keys) == (-1, 0)


def test_promised_distance_range_is_self_attention_s_only():
    """What the positions promise without their values: self-attention's ``±span`` (every
    constructor's), the length's for hand-built contiguous positions, nothing for two
    ``Positions`` (a cache's queries and keys) or for hand-built ones without a promise."""
    p = Positions.from_segments(torch.tensor([[0, 0, 1, 1, -1]]))
    assert promised_distance_range(p, p) == (-4, 4)
    assert promised_distance_range(p, p[1:]) is None
    contiguous = Positions(p.pos, p.seg, contiguous=True)
    assert promised_distance_range(contiguous, contiguous) == (-4, 4)
    bare = Positions(p.pos, p.seg)
    assert promised_distance_range(bare, bare) is None
    assert distance_range(bare, bare) == (-1, 1)  # read from the values: one row's documents


def test_derived_values_are_built_once_while_the_positions_live():
    """``derived`` keeps a value per key and keys' ``Positions``: built once, rebuilt after an
    in-place change of either's tensors, never handed to another object (a reused id), dropped
    when the keys die, and left out of a pickle or a deep copy."""
    import copy
    import gc
    import pickle
    import weakref

    p = Positions.from_segments(torch.tensor([[0, 0, 1, -1]]))
    other = Positions.from_length(4)
    built = []

    def build():
        built.append(1)
        return torch.ones(len(built))

    first = p.derived(None, "k", build)
    assert p.derived(p, "k", build) is first and len(built) == 1  # None: these positions
    assert p.derived(other, "k", build) is not first and len(built) == 2  # another keys object
    assert p.derived(None, "another key", build) is not first and len(built) == 3
    other.pos.add_(0)  # an in-place change bumps its version: rebuilt
    p.derived(other, "k", build)
    assert len(built) == 4
    for twin in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert torch.equal(twin.pos, p.pos) and twin.span == p.span
        before = len(built)
        twin.derived(None, "k", build)  # nothing kept came along: built for the twin
        assert len(built) == before + 1
    context = Positions.from_length(3)  # keys that die (a cross-attention call's context)
    value = weakref.ref(p.derived(context, "k", lambda: torch.ones(3)))
    del context
    gc.collect()
    assert value() is None  # dropped with its keys: nothing kept for them
    with torch.inference_mode():  # built outside inference mode: usable with autograd later
        kept = p.derived(None, "under inference", lambda: torch.zeros(2))
    assert not kept.is_inference()
