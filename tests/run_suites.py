"""``make test``: the PyTorch suite, the Keras suite once per backend and the Triton kernels'
suite, side by side.

The Keras suites start first, one process per backend (``KERAS_BACKEND=jax|tensorflow|torch``),
and the kernels' suite (``tests/fused``, in Triton's interpreter: ``TRITON_INTERPRET=1``), their
output kept and printed whole when they end; the PyTorch suite runs meanwhile, printing as it
goes. Each suite runs one thread: five suites share the cores, where threads of one suite would
only wait on each other. The exit status is non-zero if any suite failed.

    python tests/run_suites.py [--only torch|keras-jax|keras-tensorflow|keras-torch|fused ...]
                               [--durations [N]] [-- pytest args]

``--durations`` prints each suite's N slowest tests (pytest's ``--durations``) and, at the end,
every suite's wall and CPU time (the CPU time, summed over the suites, is what a busier or smaller
machine stretches).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERAS_BACKENDS = ("jax", "tensorflow", "torch")
#: One thread per suite; XLA (Keras on JAX, TensorFlow's jit_compile) compiles without its
#: expensive optimisations: the suites compile thousands of tiny programs once each, and
#: optimising them took about a fifth of the JAX suite's CPU time.
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "XLA_FLAGS": (
        "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
        "--xla_llvm_disable_expensive_passes=true"
    ),
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
SUITES = ("torch", *(f"keras-{b}" for b in KERAS_BACKENDS), "fused")
#: The background suites: the folder each runs, the environment it adds to ONE_THREAD, its title.
BACKGROUND = {
    **{
        f"keras-{b}": ("tests/keras", {"KERAS_BACKEND": b}, f"Keras suite, KERAS_BACKEND={b}")
        for b in KERAS_BACKENDS
    },
    "fused": ("tests/fused", {"TRITON_INTERPRET": "1"}, "Triton kernels, TRITON_INTERPRET=1"),
}


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
    parser.add_argument(
        "--durations",
        nargs="?",
        type=int,
        const=25,
        metavar="N",
        help="print each suite's N slowest tests (default 25), every suite's wall and CPU time",
    )
    args = parser.parse_args(own)
    if args.durations is not None:
        extra = [f"--durations={args.durations}", *extra]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra]
    failed = []
    start = time.monotonic()
    ends: dict[str, tuple[int, float, float]] = {}  # suite: exit status, wall and CPU seconds
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for suite in args.only:
            if suite == "torch":
                continue
            folder, extra_env, _ = BACKGROUND[suite]
            log = open(Path(tmp) / f"{suite}.log", "w+")  # closed once printed, below
            env = {**os.environ, **ONE_THREAD, **extra_env}
            proc = subprocess.Popen(
                [*pytest, folder], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            runs.append((suite, proc, log))
        procs = {suite: proc for suite, proc, _ in runs}
        if "torch" in args.only:
            print("===== PyTorch suite", flush=True)
            ignore = [f"--ignore={folder}" for folder, _, _ in BACKGROUND.values()]
            env = {**os.environ, **ONE_THREAD}  # its many small ops gain nothing from threads
            procs["torch"] = subprocess.Popen([*pytest, *sorted(set(ignore))], cwd=ROOT, env=env)
        while len(ends) < len(procs):  # reap each suite as it ends: its own wall and CPU time
            for suite, proc in procs.items():
                if suite in ends:
                    continue
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    cpu = usage.ru_utime + usage.ru_stime  # its reaped children's included
                    ends[suite] = (os.waitstatus_to_exitcode(status), time.monotonic() - start, cpu)
            time.sleep(0.5)
        if "torch" in procs and ends["torch"][0]:
            failed.append("torch")
        for suite, _proc, log in runs:
            code = ends[suite][0]
            log.seek(0)
            print(f"===== {BACKGROUND[suite][2]}: exit {code}")
            print(log.read(), end="", flush=True)
            log.close()
            if code:
                failed.append(suite)
    if args.durations is not None:
        print("===== each suite: wall time (all started together) and CPU time")
        for suite in args.only:
            _, wall, cpu = ends[suite]
            print(f"{suite:18s} {wall / 60:5.1f} min wall {cpu / 60:5.1f} min CPU")
        total = sum(cpu for _, _, cpu in ends.values())
        print(
            f"{'all':18s} {(time.monotonic() - start) / 60:5.1f} min wall {total / 60:5.1f} min CPU"
        )
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
