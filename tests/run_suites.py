"""``make test``: the PyTorch suite, the Keras suite once per backend and the Triton kernels'
suite, side by side.

The Keras suites start first, one process per backend (``KERAS_BACKEND=jax|tensorflow|torch``),
and the kernels' suite (``tests/fused``, in Triton's interpreter: ``TRITON_INTERPRET=1``) in two
processes (``fused``: the kernels against eager; ``fused-other``: the rest), their output kept
and printed whole when they end; the PyTorch suite runs meanwhile, printing as it goes. Each
suite runs one thread: seven suites share the cores, where threads of one suite would only wait
on each other, and no one suite is left to run alone at the end for long. The exit status is
non-zero if any suite failed.

The Keras suite's JAX part runs in a Keras user's install, ``.venv-keras`` (``relpos[keras]``,
JAX, pytest and Hypothesis: ``make test`` makes it), with ``--keras-user-install``: ``keras-jax``
runs there every test but those against a reference that needs more than that install (marked
``torch_reference``: PyTorch's modules; ``keras_hub_reference``: keras-hub, which pulls
TensorFlow), proving that none of them needs torch (and that the install holds none:
tests/keras/test_no_torch.py). ``keras-jax-reference`` runs those in the main environment. Without
``.venv-keras`` the script stops before running anything and says to run ``make test`` (or to
leave ``keras-jax`` out): a fallback to the main environment would prove nothing. A mark
expression given to pytest (``-m "not slow"``) is and-ed to a suite's own (pytest takes one).

    python tests/run_suites.py [--only torch|keras-jax|keras-jax-reference|keras-tensorflow|
                                       keras-torch|fused|fused-other ...] [--durations [N]]
                               [-- pytest args]

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
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERAS_BACKENDS = ("jax", "tensorflow", "torch")
#: A Keras user's install without torch (the Makefile's KERAS_VENV): the Keras suite's JAX part.
KERAS_VENV = ROOT / ".venv-keras"
#: The Keras tests that need more than that install: the JAX suite runs them in the main one.
REFERENCE = "torch_reference or keras_hub_reference"
#: The kernels against eager: the kernels' suite's larger half, run as a suite of its own.
FUSED_KERNELS = "tests/fused/test_fused.py"
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


@dataclass(frozen=True)
class Suite:
    """A background suite: the folder it runs, the environment it adds to ONE_THREAD, its title,
    the Python it runs in, a mark expression and-ed to the one given, and pytest arguments."""

    folder: str
    env: dict[str, str]
    title: str
    python: Path = Path(sys.executable)
    marks: str | None = None
    args: tuple[str, ...] = field(default=())


BACKGROUND = {
    "keras-jax": Suite(
        "tests/keras",
        {"KERAS_BACKEND": "jax"},
        "Keras suite, KERAS_BACKEND=jax, in a Keras user's install without torch (.venv-keras)",
        python=KERAS_VENV / "bin" / "python",
        marks=f"not ({REFERENCE})",
        args=("--keras-user-install",),
    ),
    "keras-jax-reference": Suite(
        "tests/keras",
        {"KERAS_BACKEND": "jax"},
        "Keras suite, KERAS_BACKEND=jax, the tests against PyTorch and keras-hub",
        marks=REFERENCE,
    ),
    **{
        f"keras-{b}": Suite("tests/keras", {"KERAS_BACKEND": b}, f"Keras suite, KERAS_BACKEND={b}")
        for b in KERAS_BACKENDS[1:]
    },
    # The kernels' suite in two processes: the kernels against eager, the longest of all the
    # suites alone, and the rest (compiles for GPUs, torch.compile, the host's side).
    "fused": Suite(
        FUSED_KERNELS,
        {"TRITON_INTERPRET": "1"},
        f"Triton kernels ({FUSED_KERNELS}), TRITON_INTERPRET=1",
    ),
    "fused-other": Suite(
        "tests/fused",
        {"TRITON_INTERPRET": "1"},
        f"Triton kernels (tests/fused but {FUSED_KERNELS}), TRITON_INTERPRET=1",
        args=(f"--ignore={FUSED_KERNELS}",),
    ),
}
SUITES = ("torch", *BACKGROUND)


def with_marks(args: list[str], marks: str | None) -> list[str]:
    """``args`` with ``marks`` and-ed to the mark expression they give (``-m EXPR`` or
    ``-mEXPR``; pytest reads only the last ``-m``), or ``args`` where ``marks`` is None."""
    if marks is None:
        return args
    rest, given = [], []
    it = iter(args)
    for arg in it:
        if arg == "-m":
            given.append(next(it, ""))
        elif arg.startswith("-m"):
            given.append(arg[2:])
        else:
            rest.append(arg)
    return [*rest, "-m", f"({given[-1]}) and ({marks})" if given else marks]


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
    keras_python = BACKGROUND["keras-jax"].python
    if "keras-jax" in args.only and not keras_python.exists():
        print(
            f"{keras_python.relative_to(ROOT)} not found: the keras-jax suite runs in a Keras "
            "user's install without torch, which `make test` makes (or leave keras-jax out)",
            file=sys.stderr,
        )
        return 2
    if args.durations is not None:
        extra = [f"--durations={args.durations}", *extra]
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    failed = []
    start = time.monotonic()
    ends: dict[str, tuple[int, float, float]] = {}  # suite: exit status, wall and CPU seconds
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for suite in args.only:
            if suite == "torch":
                continue
            run = BACKGROUND[suite]
            log = open(Path(tmp) / f"{suite}.log", "w+")  # closed once printed, below
            env = {**os.environ, **ONE_THREAD, **run.env}
            command = [run.python, *pytest, *with_marks(extra, run.marks), *run.args, run.folder]
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            runs.append((suite, proc, log))
        procs = {suite: proc for suite, proc, _ in runs}
        if "torch" in args.only:
            print("===== PyTorch suite", flush=True)
            ignore = sorted({f"--ignore={run.folder}" for run in BACKGROUND.values()})
            env = {**os.environ, **ONE_THREAD}  # its many small ops gain nothing from threads
            command = [sys.executable, *pytest, *extra, *ignore]
            procs["torch"] = subprocess.Popen(command, cwd=ROOT, env=env)
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
            print(f"===== {BACKGROUND[suite].title}: exit {code}")
            print(log.read(), end="", flush=True)
            log.close()
            if code:
                failed.append(suite)
    if args.durations is not None:
        print("===== each suite: wall time (all started together) and CPU time")
        for suite in args.only:
            _, wall, cpu = ends[suite]
            print(f"{suite:20s} {wall / 60:5.1f} min wall {cpu / 60:5.1f} min CPU")
        total = sum(cpu for _, _, cpu in ends.values())
        print(
            f"{'all':20s} {(time.monotonic() - start) / 60:5.1f} min wall {total / 60:5.1f} min CPU"
        )
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
