"""Small C kernels for the CPU, built on first use with the system's C compiler.

A kernel here is plain C (no PyTorch headers): it compiles in well under a second with ``cc -O3
-march=native`` and is loaded with :mod:`ctypes`, which releases the GIL during a call. The
shared object is cached under ``$RELPOS_CACHE/native`` (default ``~/.cache/relpos/native``),
named by a hash of the source, the compiler command and the CPU's flags, so a cache shared
between machines never runs code built for another CPU. It is written to a temporary file and
renamed, so concurrent builds are safe.

Where there is no compiler, the build fails, or ``RELPOS_NATIVE=0`` is set, :func:`load` returns
``None`` (with one warning for a failed build) and callers use their PyTorch path, which computes
the same function.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from ..cachedir import default_cache_dir
from ..runtime import cpu_flags

__all__ = ["NATIVE_ENV_VAR", "NativeBuildWarning", "load"]

#: Set to ``0`` to turn the C kernels off (the PyTorch paths run instead).
NATIVE_ENV_VAR = "RELPOS_NATIVE"

_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c99")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


class NativeBuildWarning(UserWarning):
    """A C kernel could not be built or loaded; the PyTorch path runs instead."""


def _build(name: str) -> ctypes.CDLL:
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler!r} is not on PATH)")
    key = hashlib.sha256(
        source.read_bytes() + repr((compiler, _FLAGS, cpu_flags())).encode()
    ).hexdigest()[:16]
    target = default_cache_dir() / "native" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *_FLAGS, str(source), "-o", tmp],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def load(name: str, signatures: dict[str, list[type]]) -> ctypes.CDLL | None:
    """The C kernel ``native/<name>.c``, built and cached on first use, its functions typed by
    ``signatures`` (argument types; they return nothing); ``None`` where it cannot be (no
    compiler, a failed build: one :class:`NativeBuildWarning`) or ``$RELPOS_NATIVE`` is ``0``."""
    if os.environ.get(NATIVE_ENV_VAR, "1") == "0":
        return None
    with _lock:
        if name not in _loaded:
            try:
                lib = _build(name)
                for function, argtypes in signatures.items():
                    getattr(lib, function).argtypes = argtypes
                    getattr(lib, function).restype = None
                _loaded[name] = lib
            except OSError as exc:
                warnings.warn(
                    f"relpos: the C kernel {name!r} is not available ({exc}); "
                    "using the PyTorch path (same results, slower)",
                    NativeBuildWarning,
                    stacklevel=2,
                )
                _loaded[name] = None
        return _loaded[name]
