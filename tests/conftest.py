"""pytest configuration: hypothesis profile (deterministic, no deadline: oracles are slow), and
no test leaks process-wide floating-point state into the next."""

import os

import pytest
import torch
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
    hypothesis refuses to draw floats)."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms`` for the test to set, restored afterwards."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield torch.use_deterministic_algorithms
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (many small ops: threads only add overhead)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(items):
    """Skip the bidirectional cases of a causal-only scheme (FIRE refuses to be built so)."""
    from tests.helpers import causal_only

    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        spec = params.get("spec")
        if params.get("causal") is False and isinstance(spec, dict) and causal_only(spec):
            item.add_marker(pytest.mark.skip(reason=f"{spec['name']} is causal only"))
