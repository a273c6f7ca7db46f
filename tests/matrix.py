"""The default run's share of a test matrix: a pairwise cover of its parametrised cases.

A test marked ``@pytest.mark.matrix`` (scheme × backend × layout × dtype, ...) runs in
``make test`` only on a subset of its cases in which every pair of parameter values that the
whole matrix holds still meets at least once (every scheme with every backend, every backend with
every layout, ...), so that no behaviour is left without a test; ``make test-all``
(``--full-matrix``) runs every case. The cover is chosen greedily and deterministically from the
collected cases (it never runs a case the full matrix does not hold). ``tests/conftest.py``
applies it, and splits a Keras test's cover between the suite's three backends.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

Case = dict[str, Hashable]


def _pairs(case: Case) -> set[tuple]:
    items = sorted(case.items())
    if len(items) == 1:
        return {(items[0],)}
    return set(itertools.combinations(items, 2))


def pairwise_cover(cases: Sequence[Case]) -> list[int]:
    """Indices of a subset of ``cases`` holding every pair of ``(name, value)`` that some case
    holds (every single value, for one-parameter cases), in the order given.

    Greedy: repeatedly take the case that covers the most pairs not yet covered (the first of
    equals). Each case is ``{parameter: value id}``; cases may have different parameters.
    """
    wanted = [_pairs(c) for c in cases]
    left = set().union(*wanted) if wanted else set()
    chosen: set[int] = set()
    while left:
        best = max(range(len(cases)), key=lambda i: -1 if i in chosen else len(wanted[i] & left))
        chosen.add(best)
        left -= wanted[best]
    return sorted(chosen)
