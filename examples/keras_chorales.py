"""Train ``relpos.keras.transformer.Transformer`` on the JSB chorales with ``model.fit`` (JAX), and
optionally the PyTorch trainer for the same wall-clock budget, and print both validation NLLs.

Run from the repository root (one thread each, as on a shared 2-core machine)::

    OMP_NUM_THREADS=1 XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \\
        .venv/bin/python examples/keras_chorales.py --minutes 3 --torch-baseline

Both sides use what ``relpos train`` uses: the same chorales, splits and tokens
(:func:`relpos.music.load_token_data`: transposed copies of the training chorales, the validation
chorales as written), random training windows that start on whole time steps
(:func:`relpos.training.random_windows`), the demo's model (Music Transformer attention, 3 layers,
128 wide, 4 heads) and optimiser (AdamW, warm-up then cosine decay over ``--steps``, clipping at
1), and the same score: validation NLL in nats per token, every token of every validation chorale
scored once in windows of ``--context`` tokens (:func:`relpos.training.eval_windows`).

Budget: each side trains for ``--minutes`` of wall-clock time or ``--steps`` steps, whichever
comes first; validation runs once, after the budget. The Keras clock starts after its first step,
which compiles the train step (its time is printed apart); the PyTorch trainer is stopped by a
timed SIGTERM, which it handles as Ctrl-C (it finishes the step and writes ``last.pt``; a
background job ignores SIGINT).

Data: ``--data`` (default: ``jsb``, the standard JSB split that ships with relpos; ``music21`` or
a JSB JSON file also work). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported

# Before Keras, which imports TensorFlow where it is installed: PyTorch's optimisers load Triton
# (through torch._dynamo), and Triton's LLVM aborts the process ("registered more than once")
# when TensorFlow's came first; in this order both load.
import torch._dynamo  # noqa: F401, I001

import keras
import numpy as np

from relpos.keras.transformer import Transformer
from relpos.music import VOCAB_SIZE, load_token_data
from relpos.runtime import flush_denormals
from relpos.training import eval_windows, random_windows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="jsb", help="'jsb' (shipped), 'music21' or a JSB JSON file")
    p.add_argument("--minutes", type=float, default=3.0, help="training budget of each side")
    p.add_argument("--steps", type=int, default=600, help="step cap (and the lr schedule's length)")
    p.add_argument("--torch-baseline", action="store_true", help="also train the PyTorch model")
    p.add_argument("--scheme", default="music", help='a name, or JSON: \'{"name": "t5"}\'')
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--max-shift", type=int, default=5, help="transposition augmentation")
    p.add_argument("--log-every", type=int, default=25, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.scheme = json.loads(args.scheme) if args.scheme.startswith("{") else args.scheme
    return args


# ----------------------------------------------------------------------------- Keras


def batches(data, args):
    """Endless ``(x, y, sample_weight)`` batches of random windows, as the PyTorch trainer draws."""
    rng = np.random.default_rng(args.seed)
    while True:
        w = random_windows(data.train, args.batch_size, args.context, rng, grid=data.grid)
        tokens = w.tokens.astype("int32")
        yield tokens[:, :-1], tokens[:, 1:], w.mask[:, 1:].astype("float32")


class Budget(keras.callbacks.Callback):
    """Stops training after ``seconds`` (counted from the end of the first step) or ``steps``."""

    def __init__(self, seconds: float, steps: int) -> None:
        super().__init__()
        self.seconds, self.steps = seconds, steps
        self.begin = self.start = None
        self.done = 0

    def on_train_begin(self, logs=None):
        self.begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.start is None:
            self.start = time.perf_counter()  # the first step compiled the train step
        if self.done >= self.steps or self.elapsed >= self.seconds:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        print(f"  keras step {self.done:4d}  train loss {logs['loss']:.4f}  {self.elapsed:6.1f} s")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start if self.start is not None else 0.0


def keras_valid_nll(model, seqs, context, grid, batch_size=32) -> float:
    """Nats per token over ``seqs``, every token scored once (as relpos.training.evaluate_nll)."""
    w = eval_windows(seqs, context, grid=grid)
    total, count = 0.0, 0
    for b in w.batches(batch_size):
        tokens = np.zeros((batch_size, context + 1), "int32")  # one shape: one compilation
        tokens[: len(b)] = b.tokens
        logits = np.asarray(model.predict_on_batch(tokens[:, :-1]), "float64")[: len(b)]
        targets, keep = b.tokens[:, 1:], b.mask[:, 1:]
        top = logits.max(-1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
        total, count = total + float(((lse - picked) * keep).sum()), count + int(keep.sum())
    return total / count


def train_keras(args, data) -> dict:
    keras.utils.set_random_seed(args.seed)
    model = Transformer(
        VOCAB_SIZE, args.d_model, args.num_heads, args.num_layers, dropout=args.dropout,
        scheme=args.scheme,
    )  # fmt: skip
    model.build((None, args.context))
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, max(args.steps - args.warmup, 1), alpha=0.1, warmup_target=args.lr,
        warmup_steps=args.warmup,
    )  # fmt: skip
    optimizer = keras.optimizers.AdamW(
        schedule, weight_decay=0.01, beta_1=0.9, beta_2=0.98, epsilon=1e-8, global_clipnorm=1.0
    )
    optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])  # as ndim < 2 in torch
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True,
        reduction="mean_with_sample_weight",  # nats per real target
    )
    model.compile(optimizer=optimizer, loss=loss)
    budget = Budget(60 * args.minutes, args.steps)
    model.fit(
        batches(data, args), steps_per_epoch=args.log_every,
        epochs=math.ceil(args.steps / args.log_every), callbacks=[budget], shuffle=False, verbose=0,
    )  # fmt: skip
    train_s, first_s = budget.elapsed, budget.start - budget.begin
    t = time.perf_counter()
    nll = keras_valid_nll(model, data.valid, args.context, data.grid)
    return {
        "steps": budget.done, "train_s": train_s, "first_step_s": first_s,
        "valid_nll": nll, "valid_s": time.perf_counter() - t, "params": model.count_params(),
    }  # fmt: skip


# ----------------------------------------------------------------------------- PyTorch


def train_torch(args, data) -> dict:
    from relpos.models import Transformer as TorchTransformer
    from relpos.models import TransformerConfig
    from relpos.training import TrainConfig, evaluate_nll, load_checkpoint, train

    model_cfg = TransformerConfig(
        VOCAB_SIZE, args.d_model, args.num_heads, args.num_layers, dropout=args.dropout,
        scheme=args.scheme,
    )  # fmt: skip
    cfg = TrainConfig(
        model=model_cfg, data=args.data, context=args.context, batch_size=args.batch_size,
        steps=args.steps, lr=args.lr, warmup=args.warmup, eval_every=args.steps,
        max_shift=args.max_shift, seed=args.seed,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        timer = threading.Timer(60 * args.minutes, os.kill, (os.getpid(), signal.SIGTERM))
        t = time.perf_counter()
        timer.start()
        try:
            summary = train(cfg, run_dir, progress=False, device="cpu", data=data)
        finally:
            timer.cancel()
        train_s = time.perf_counter() - t
        model = TorchTransformer(cfg.model)
        model.load_state_dict(load_checkpoint(Path(run_dir) / "last.pt")["model"])
    t = time.perf_counter()
    nll = evaluate_nll(model, data.valid, context=cfg.context, grid=data.grid)
    return {
        "steps": summary["step"], "train_s": train_s, "valid_nll": nll,
        "valid_s": time.perf_counter() - t, "params": model.num_parameters(),
    }  # fmt: skip


def main() -> None:
    args = parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show at once, even when piped
    flushed = flush_denormals()  # as the relpos command line does, before any thread starts
    data = load_token_data(args.data, max_shift=args.max_shift, progress=False)
    print(
        f"data: {args.data}\n  {len(data.train)} training sequences (with transpositions), "
        f"{len(data.valid)} validation chorales; scheme {args.scheme}, d_model {args.d_model}, "
        f"{args.num_layers} layers, context {args.context}, batch {args.batch_size}; budget "
        f"{args.minutes:g} min or {args.steps} steps per side; flush-to-zero {flushed}"
    )
    print(f"Keras ({keras.backend.backend()}) model.fit:")
    k = train_keras(args, data)
    print(
        f"  keras: {k['steps']} steps in {k['train_s']:.1f} s (+ {k['first_step_s']:.1f} s for "
        f"the first, compiling), {k['params']:,} parameters; valid NLL {k['valid_nll']:.4f} "
        f"({k['valid_s']:.0f} s)"
    )
    rows = [("keras/" + keras.backend.backend(), k)]
    if args.torch_baseline:
        print("PyTorch trainer (relpos.training.train):")
        t = train_torch(args, data)
        print(
            f"  torch: {t['steps']} steps in {t['train_s']:.1f} s, {t['params']:,} parameters; "
            f"valid NLL {t['valid_nll']:.4f} ({t['valid_s']:.0f} s)"
        )
        rows.append(("torch", t))
    print("\nvalidation NLL (nats per token, every validation token once):")
    for name, r in rows:
        print(f"  {name:12s} {r['valid_nll']:.4f}   ({r['steps']} steps, {r['train_s']:.0f} s)")


if __name__ == "__main__":
    main()
