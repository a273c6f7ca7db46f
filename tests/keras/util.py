"""Shared helpers of the Keras suite: conversions, the layouts every property is checked on, and
gradients on the active backend. Imports no torch: the suite's JAX part runs without it."""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest
from keras import ops

BACKEND = keras.backend.backend()
#: JAX and TensorFlow compile every op once per shape in an eager call (seconds a case), while
#: Keras ops compute the same math on every backend: there the large parametrized tests share
#: their cases by default (``every_other``: a third each), all of them under ``make test-all``.
COMPILED = BACKEND in ("jax", "tensorflow")

#: Layouts of a (3, n) batch: which tokens are real, and how rows are split into documents.
LAYOUTS = ("plain", "left", "right", "packed")


def every_other(cases: list, ids=None, slow=None) -> list:
    """``cases`` as ``pytest.param`` s, shared by the compiled backends: JAX runs cases 0, 3, 6,
    ..., TensorFlow cases 1, 4, 7, ..., the rest marked ``slow`` there (the torch backend, which
    computes eagerly and fast, runs them all). So every case runs on the torch backend and a
    third of them on each compiled one by default, and neighbouring variants of one parameter
    (causal or not, one shape or another) fall to different backends. A case is a tuple of
    arguments, or one argument; ``slow(case)`` true marks it ``slow`` on every backend."""
    share = {"jax": 0, "tensorflow": 1}.get(BACKEND)
    params = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        slow_here = COMPILED and i % 3 != share
        slow_here = slow_here or (slow is not None and slow(case))
        marks = (pytest.mark.slow,) if slow_here else ()
        params.append(pytest.param(*values, marks=marks, id=None if ids is None else ids(case)))
    return params


def on_compiled(backend: str):
    """A decorator for a test of XLA's compiled path that ``make test`` runs on one compiled
    backend (``jax`` or ``tensorflow``): ``slow`` on the other, as :func:`every_other` shares
    cases."""
    if COMPILED and BACKEND != backend:
        return pytest.mark.slow
    return lambda test: test


def np_(x) -> np.ndarray:
    if isinstance(x, keras.Variable):
        x = x.value
    return np.asarray(ops.convert_to_numpy(x))


def kt(x, dtype=None):
    """A numpy array or torch tensor as a Keras backend tensor."""
    torch = sys.modules.get("torch")  # a torch tensor exists only where torch is loaded
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.numpy()
    return ops.convert_to_tensor(x, dtype=dtype)


def layout(kind: str, b: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Padding mask ``(b, n)`` bool and segment ids ``(b, n)`` (-1 padding) of one layout."""
    rng = np.random.default_rng(seed)
    mask = np.ones((b, n), dtype=bool)
    seg = np.zeros((b, n), dtype=np.int32)
    for r in range(b):
        pad = int(rng.integers(1, n // 2 + 1)) if r else 0  # row 0 stays full
        if kind == "left":
            mask[r, :pad] = False
        elif kind == "right":
            mask[r, n - pad :] = False
        elif kind == "packed":
            cut = sorted(rng.choice(np.arange(1, n), size=2, replace=False))
            seg[r] = np.searchsorted(cut, np.arange(n), side="right")
            mask[r, n - pad :] = False
    seg = np.where(mask, seg, -1).astype(np.int32)
    return {"mask": mask, "seg": seg}


def decode(layer, x, mask, prompt: int) -> np.ndarray:
    """Prefill the first ``prompt`` tokens of ``x (b, n, D)`` into an empty keras-hub cache of
    ``n`` slots (token ``t`` in slot ``t``), then feed one token a step; ``mask (b, n)`` marks the
    real tokens. Returns every call's outputs, ``(b, n, D)``."""
    b, n, _ = x.shape
    slots = np.arange(n)[None]
    cache = layer.empty_cache(b, n, "float32")
    out, cache = layer(
        kt(x[:, :prompt]), cache=cache, cache_update_index=0, cache_mask=kt(mask & (slots < prompt))
    )
    steps = [np_(out)]
    for t in range(prompt, n):
        out, cache = layer(
            kt(x[:, t : t + 1]),
            cache=cache,
            cache_update_index=t,
            cache_mask=kt(mask & (slots <= t)),
        )
        steps.append(np_(out))
    return np.concatenate(steps, 1)


def grads(fn, variables):
    """Gradients of the scalar ``fn()`` with respect to Keras ``variables`` on this backend."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = fn()
        return tape.gradient(loss, [v.value for v in variables])
    if BACKEND == "torch":
        import torch

        loss = fn()
        return list(torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True))
    import jax

    # Keras variables are read at trace time: differentiate through a stateless scope.
    def loss_of(vals):
        with keras.StatelessScope(state_mapping=list(zip(variables, vals, strict=True))):
            return fn()

    return jax.grad(loss_of)([v.value for v in variables])


def traced(fn):
    """``fn`` compiled as a Keras model's step would be (``jax.jit``, ``tf.function``), so its
    tensors are traced and data-dependent checks cannot read them; None on torch (eager)."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return None
