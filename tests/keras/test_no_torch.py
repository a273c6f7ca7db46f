"""``relpos.keras`` needs no PyTorch (issue 44): a Keras user's install (``relpos[keras]`` and
JAX: ``.venv-keras``, where tests/run_suites.py runs this suite's JAX part) holds none; with torch
made unimportable, every Keras attention scheme builds and runs on JAX, and torch is never loaded.
``import relpos`` alone needs none either, and a PyTorch name then says how to install it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import pytest

pytest.importorskip("jax")
if keras.backend.backend() != "jax":  # the subprocesses run JAX whatever the suite's backend
    pytest.skip("run once, in the JAX suite", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]

#: Makes ``import torch`` (and every ``torch.*``) fail, as on a machine without it.
NO_TORCH = """
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def _run(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    code = NO_TORCH + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_the_keras_users_install_holds_no_torch(request):
    """Where the suite runs in a Keras user's install (``--keras-user-install``), torch is not
    installed: neither ``relpos[keras]`` nor JAX pulled it in, so the tests run beside this one
    needed none."""
    if not request.config.getoption("--keras-user-install"):
        pytest.skip("not in a Keras user's install (tests/run_suites.py runs the suite in one)")
    assert importlib.util.find_spec("torch") is None, "relpos[keras] installed torch"


@pytest.mark.slow  # make test runs the suite's JAX part in an install without torch (run_suites)
def test_keras_runs_every_scheme_without_torch():
    result = _run(
        """
        import numpy as np
        import relpos.keras as rk
        from relpos.keras.schemes import KERAS_SCHEMES

        x = np.random.default_rng(0).normal(size=(1, 3, 8)).astype("float32")
        for name in sorted(KERAS_SCHEMES):
            layer = rk.RelativeMultiHeadAttention(2, 4, scheme=name, causal=True)
            out = layer(x, x)
            assert tuple(out.shape) == (1, 3, 8), (name, out.shape)
            assert np.isfinite(np.asarray(out)).all(), name
        assert "torch" not in sys.modules
        print("ran", len(KERAS_SCHEMES))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ran 15" in result.stdout


def test_import_relpos_needs_no_torch_and_names_the_extra():
    result = _run(
        """
        import relpos
        assert relpos.T5Config is relpos.spec.t5.T5Config
        relpos.config_from_dict({"name": "rope", "theta": 500.0})
        assert "torch" not in sys.modules
        try:
            relpos.MultiheadAttention
        except ImportError as error:
            print(error)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'pip install "relpos[torch]"' in result.stdout
