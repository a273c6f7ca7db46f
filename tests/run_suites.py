"""``make test``: the PyTorch suite and the Keras suite once per backend, side by side.

The Keras suites start first, one process per backend (``KERAS_BACKEND=jax|tensorflow|torch``),
one thread each, their output kept and printed whole when they end; the PyTorch suite runs in
the foreground meanwhile, printing as it goes. The exit status is non-zero if any suite failed.

    python tests/run_suites.py [--only torch|jax|tensorflow|keras-torch ...] [-- pytest args]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERAS_BACKENDS = ("jax", "tensorflow", "torch")
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
SUITES = ("torch", *(f"keras-{b}" for b in KERAS_BACKENDS))


def main(argv: list[str]) -> int:
    own, extra = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :])
        if "--" in argv
        else (
            argv,
            [],
        )
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SUITES, default=list(SUITES))
    args = parser.parse_args(own)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra]
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for suite in args.only:
            if suite == "torch":
                continue
            backend = suite.removeprefix("keras-")
            log = open(Path(tmp) / f"{suite}.log", "w+")  # closed once printed, below
            env = {**os.environ, **ONE_THREAD, "KERAS_BACKEND": backend}
            proc = subprocess.Popen(
                [*pytest, "tests/keras"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            runs.append((suite, proc, log))
        if "torch" in args.only:
            print("===== PyTorch suite", flush=True)
            if subprocess.call([*pytest, "--ignore=tests/keras"], cwd=ROOT):
                failed.append("torch")
        for suite, proc, log in runs:
            code = proc.wait()
            log.seek(0)
            print(f"===== Keras suite, KERAS_BACKEND={suite.removeprefix('keras-')}: exit {code}")
            print(log.read(), end="", flush=True)
            log.close()
            if code:
                failed.append(suite)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
