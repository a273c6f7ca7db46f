"""pytest configuration: hypothesis profile (deterministic, no deadline: oracles are slow), the
default run's share of each test matrix (``tests/matrix.py``; ``--full-matrix`` runs every
case), and no test leaks process-wide floating-point state into the next. Imports no torch: the
Keras suite's JAX part runs in a Keras user's install without it (``tests/run_suites.py``)."""

import os
import sys

import pytest
from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=15, derandomize=True)
settings.register_profile("thorough", deadline=None, max_examples=200)
settings.load_profile("default")

# cuBLAS is deterministic only with a fixed workspace (the tests that turn on deterministic mode
# on CUDA), which must be set before its first use in the process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _keep_denormals():
    """``relpos bench`` run in-process turns on flush-to-zero (for the whole process when the
    thread pool has one thread); switch it back off, or later tests see subnormals as 0 (and
    hypothesis refuses to draw floats). Only where torch is loaded: nothing else sets it."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_flush_denormal(False)


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms`` for the test to set, restored afterwards."""
    import torch

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield torch.use_deterministic_algorithms
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (many small ops: threads only add overhead)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        help="run every case of the tests marked `matrix` (default: a pairwise cover of them)",
    )
    parser.addoption(
        "--keras-user-install",
        action="store_true",
        help="the run is in a Keras user's install (.venv-keras), which must hold no torch "
        "(tests/keras/test_no_torch.py)",
    )


def pytest_collection_modifyitems(config, items):
    """Skip the bidirectional cases of a causal-only scheme (FIRE refuses to be built so); keep
    a pairwise cover of each ``matrix`` test's cases unless ``--full-matrix``."""
    from tests.specs import causal_only

    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        spec = params.get("spec")
        if params.get("causal") is False and isinstance(spec, dict) and causal_only(spec):
            item.add_marker(pytest.mark.skip(reason=f"{spec['name']} is causal only"))
    if not config.getoption("--full-matrix"):
        _keep_pairwise_covers(config, items)


def _keep_pairwise_covers(config, items) -> None:
    """Deselect the cases of each ``matrix`` test outside its pairwise cover. In the Keras suite,
    which runs once per backend, the three backends share the cover: each runs every third of its
    cases (all of them where it has fewer than three), so every case runs on some backend."""
    from tests.matrix import pairwise_cover

    backends = ("jax", "tensorflow", "torch")
    seed = backends.index(os.environ.get("KERAS_BACKEND", "jax"))
    groups: dict[str, list[int]] = {}
    for n, item in enumerate(items):
        if item.get_closest_marker("matrix") is not None and hasattr(item, "callspec"):
            groups.setdefault(item.nodeid.split("[")[0], []).append(n)
    dropped: set[int] = set()
    for members in groups.values():
        # By value, not index: a tuple of parameters given together (("spec", "backend"),
        # CASES) is one parametrize call whose indices would make every case unique.
        cases = [{k: repr(v) for k, v in items[n].callspec.params.items()} for n in members]
        keep = pairwise_cover(cases)
        if items[members[0]].nodeid.startswith("tests/keras/") and len(keep) >= len(backends):
            keep = keep[seed :: len(backends)]
        dropped.update(n for k, n in enumerate(members) if k not in set(keep))
    if dropped:
        config.hook.pytest_deselected(items=[items[n] for n in sorted(dropped)])
        items[:] = [item for n, item in enumerate(items) if n not in dropped]
