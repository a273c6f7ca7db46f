"""``pip install "relpos[keras]" jax`` installs no PyTorch, and relpos.keras works there.

``make test`` runs this script in a virtual environment of its own (``.venv-keras``) holding only
relpos with its ``keras`` extra and JAX, as a Keras user installs it: it fails where that
environment holds torch (the extra pulled it in) or where any Keras layer needs it. Every Keras
attention scheme runs a padded batch, each layer named like keras-hub's runs, and ``import
relpos`` loads without torch and names the extra a PyTorch name needs. The Keras suite itself
(``tests/keras``, with the PyTorch reference) runs in the main environment.

    KERAS_BACKEND=jax .venv-keras/bin/python tests/install/keras_without_torch.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

CHECKS: list[tuple[str, Callable[[], None]]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append((fn.__name__, fn))
    return fn


@check
def torch_is_not_installed() -> None:
    assert importlib.util.find_spec("torch") is None, "relpos[keras] installed torch"


@check
def every_attention_scheme_runs_a_padded_batch() -> None:
    import numpy as np

    import relpos.keras as rk

    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=bool)  # row 0: left padding
    for name in sorted(rk.KERAS_SCHEMES):
        layer = rk.RelativeMultiHeadAttention(2, 4, scheme=name, causal=True)
        out = np.asarray(layer(x, x, query_mask=mask, value_mask=mask))
        assert out.shape == (2, 5, 8), (name, out.shape)
        assert np.isfinite(out).all(), name
        assert (out[0, :2] == 0).all(), f"{name}: padding must output 0"


@check
def the_keras_hub_named_layers_run() -> None:
    import numpy as np

    import relpos.keras as rk

    x = np.random.default_rng(1).normal(size=(2, 6, 8)).astype("float32")
    for layer in (
        rk.PositionEmbedding(sequence_length=6),
        rk.SinePositionEncoding(),
        rk.RotaryEmbedding(),
    ):
        out = np.asarray(layer(x))
        assert out.shape[-1] == 8 and np.isfinite(out).all(), type(layer).__name__
    tokens = np.array([[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]], dtype="int32")
    embedded = np.asarray(rk.TokenAndPositionEmbedding(10, 6, 8)(tokens))
    assert embedded.shape == (2, 6, 8)
    scores = np.zeros((2, 4, 6, 6), dtype="float32")
    biased = np.asarray(rk.AlibiBias()(scores))
    assert biased.shape == scores.shape and (biased != 0).any()


@check
def import_relpos_needs_no_torch_and_names_the_extra() -> None:
    import relpos

    relpos.config_from_dict({"name": "t5", "num_buckets": 8, "max_distance": 16})
    try:
        relpos.MultiheadAttention  # noqa: B018 (the lazy PyTorch name under test)
    except ImportError as error:
        message = str(error)
    else:
        raise AssertionError("relpos.MultiheadAttention loaded without torch")
    assert 'pip install "relpos[torch]"' in message, message


@check
def nothing_loaded_torch() -> None:
    assert "torch" not in sys.modules


def main() -> int:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    failed = 0
    for name, fn in CHECKS:
        try:
            fn()
        except Exception as error:  # report every check, then fail
            failed += 1
            print(f"FAILED {name}: {type(error).__name__}: {error}")
        else:
            print(f"ok {name}")
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
