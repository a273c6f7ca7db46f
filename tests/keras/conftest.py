"""The Keras suite: runs once per backend, in its own process (``KERAS_BACKEND=jax|tensorflow|
torch``; ``make test`` runs all three). Skipped where Keras is not installed."""

import pytest

keras = pytest.importorskip("keras")


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")
