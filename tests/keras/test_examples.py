"""The examples (``examples/``) run end to end at a tiny size, in their own processes, as a user
runs them: each once, in the run of the suite on the backend it runs on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parents[2]


def on_backend(backend: str):
    """Runs the test in the suite of ``backend`` only: each example once."""
    return pytest.mark.skipif(
        keras.backend.backend() != backend, reason=f"each example runs once, in the {backend} suite"
    )


def run_example(name: str, *args: str, backend: str) -> str:
    env = {**os.environ, "KERAS_BACKEND": backend, "OMP_NUM_THREADS": "1"}
    # The suite's XLA flags where it runs under tests/run_suites.py (one thread, no expensive
    # optimisations: a third less CPU for an example's compiles), else one thread.
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


@on_backend("jax")
@pytest.mark.torch_reference
def test_keras_chorales_with_the_torch_baseline():
    """Both sides train and report a finite NLL in one process (Keras on JAX, which imports
    TensorFlow where it is installed, then PyTorch's trainer, which loads Triton)."""
    tiny = "--steps 2 --minutes 1 --d-model 16 --num-heads 2 --num-layers 1 --context 16"
    out = run_example("keras_chorales.py", *tiny.split(), "--batch-size", "2", "--warmup", "1",
                      "--torch-baseline", backend="jax")  # fmt: skip
    lines = [line.split() for line in out.splitlines() if line.startswith(("  keras/", "  torch "))]
    assert [line[0] for line in lines] == ["keras/jax", "torch"], out
    assert all(0 < float(line[1]) < 10 for line in lines), out


@on_backend("tensorflow")  # tf.map_fn: TensorFlow, which a JAX user's install lacks
def test_keras_map_fn_migration():
    """The vectorised layer is exact (0) on every layout; ``tf.map_fn`` with index positions is
    not, on the holed batch."""
    out = run_example("keras_map_fn_migration.py", backend="tensorflow")
    rows = [line for line in out.splitlines() if "RelativePositionEmbedding    all" in line]
    assert len(rows) == 3 and all(row.split()[-1] == "0.0000" for row in rows), out
    holes = [line for line in out.splitlines() if "holes" in line and "map_fn" in line]
    assert holes and float(holes[0].split()[-1]) > 0, out
