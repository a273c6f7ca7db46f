"""Run the Keras suite once per backend, each in its own process, side by side.

``make test`` calls this after the PyTorch suite. Each process gets one thread (the backends'
kernels are small here; one JAX/XLA compile per op dominates), its output is printed whole once
it ends, and the exit status is non-zero if any backend failed.

    python tests/keras/run_backends.py [jax tensorflow torch] [-- pytest args]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

BACKENDS = ("jax", "tensorflow", "torch")
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    names = (argv[: argv.index("--")] if "--" in argv else argv) or list(BACKENDS)
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        print(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "tests/keras", "-q", "-p", "no:cacheprovider", *extra]
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for name in names:
            log = open(Path(tmp) / f"{name}.log", "w+")  # closed once read, below
            env = {**os.environ, **ONE_THREAD, "KERAS_BACKEND": name}
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
            runs.append((name, proc, log))
        failed = []
        for name, proc, log in runs:
            code = proc.wait()
            log.seek(0)
            print(f"===== Keras suite, KERAS_BACKEND={name}: exit {code}")
            print(log.read(), end="", flush=True)
            log.close()
            if code:
                failed.append(name)
    if failed:
        print(f"Keras suite failed on: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
