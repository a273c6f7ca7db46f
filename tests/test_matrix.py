"""The default run's pairwise cover of a test matrix (``tests/matrix.py``) keeps every pair."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from tests.matrix import pairwise_cover


def _pairs(case):
    return set(itertools.combinations(sorted(case.items()), 2))


@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    drop=st.sets(st.integers(0, 200), max_size=20),
)
def test_every_pair_of_the_matrix_is_kept(sizes, drop):
    names = [f"p{k}" for k in range(len(sizes))]
    full = [dict(zip(names, idx, strict=True)) for idx in itertools.product(*map(range, sizes))]
    cases = [c for n, c in enumerate(full) if n not in drop] or full[:1]  # holes, as skips make
    keep = pairwise_cover(cases)
    assert keep == sorted(set(keep)) and all(0 <= k < len(cases) for k in keep)
    if len(names) == 1:
        assert {cases[k]["p0"] for k in keep} == {c["p0"] for c in cases}
    else:
        assert set().union(*(_pairs(cases[k]) for k in keep)) == set().union(*map(_pairs, cases))


def test_a_three_way_matrix_shrinks_deterministically():
    cases = [
        {"scheme": s, "backend": b, "layout": lay}
        for s, b, lay in itertools.product(range(10), range(4), range(3))
    ]
    cover = pairwise_cover(cases)
    assert 40 <= len(cover) <= 60  # 10 × 4 pairs at least; far below 120
    assert pairwise_cover(list(cases)) == cover
