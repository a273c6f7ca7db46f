"""Training, evaluation, generation and the command line, on a tiny generated data set."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relpos import Transformer, TransformerConfig
from relpos.atomic import atomic_path, stale_temporaries
from relpos.cli import main
from relpos.music import VOCAB_SIZE, ChoraleSplits, load_chorales, load_token_data, sample_chorale
from relpos.training import (
    TokenDataset,
    TrainConfig,
    WindowGrid,
    evaluate_nll,
    load_checkpoint,
    lr_at,
    param_groups,
    save_checkpoint,
    set_lr,
)
from relpos.training import loop as training_loop
from relpos.training import train as train_on
from relpos.training.ema import WeightAverage
from relpos.training.loop import RUN_FILES, TrainingDiverged, accumulate_gradients
from relpos.training.windows import random_windows

ROOT = Path(__file__).resolve().parents[1]


def train(cfg, run_dir, *, data=None, resume=False, **kw):
    """:func:`relpos.training.train` on ``data``, or on the chorales the run's config names (what
    ``relpos train`` loads and passes it)."""
    if data is None:
        if cfg is None:
            source = TrainConfig.from_dict(load_checkpoint(Path(run_dir) / "last.pt")["config"])
        else:
            source = cfg
        data = load_token_data(source.data, max_shift=source.max_shift, progress=False)
    return train_on(cfg, run_dir, data=data, resume=resume, **kw)


BIN = Path(sys.executable).parent


def chorale(rng: np.random.Generator, steps: int) -> list[list[int]]:
    """A plausible four-voice texture: a random walk per voice inside its range."""
    centre = np.array([67, 60, 55, 48])
    walk = np.cumsum(rng.integers(-2, 3, size=(steps, 4)), axis=0).clip(-5, 5)
    out = (centre + walk).tolist()
    for t in rng.choice(steps, size=steps // 8, replace=False):
        out[t][3] = -1  # a few silent bass steps
    return out


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    data = {
        split: [chorale(rng, int(rng.integers(24, 48))) for _ in range(k)]
        for split, k in (("train", 6), ("valid", 2), ("test", 2))
    }
    path = tmp_path_factory.mktemp("data") / "tiny.json"
    path.write_text(json.dumps(data))
    return path


def tiny_config(data: Path, **kw) -> TrainConfig:
    model = TransformerConfig(
        vocab_size=VOCAB_SIZE,
        d_model=32,
        num_heads=2,
        num_layers=1,
        scheme={"name": "music", "max_distance": 64},
        dropout=0.1,
    )
    fields = {
        "data": str(data),
        "context": 32,
        "batch_size": 4,
        "steps": 8,
        "eval_every": 4,
        "warmup": 2,
        "max_shift": 2,
        **kw,
    }
    return TrainConfig(model=model, **fields)


TINY_FLAGS = [
    "--d-model",
    "32",
    "--num-heads",
    "2",
    "--num-layers",
    "1",
    "--context",
    "32",
    "--batch-size",
    "4",
    "--steps",
    "6",
    "--eval-every",
    "3",
    "--warmup",
    "2",
    "--no-progress",
]


def test_lr_schedule_warms_up_then_decays_to_the_floor(tiny_data):
    cfg = tiny_config(tiny_data, steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lr_at(100, cfg) == pytest.approx(1e-4)


def test_the_positional_parameters_train_at_their_own_learning_rate(tiny_data, tmp_path):
    """``position_lr_scale``: every parameter of a scheme (here T5's tables) sits in a group at
    that multiple of the schedule, the rest at 1, weight decay still on matrices only; Adam's
    first step moves each table entry by exactly that learning rate (its update is ±lr at step
    1); a run, stopped and resumed, holds the scaled rate; at a scale of 1 the groups are the
    usual two."""
    torch.manual_seed(0)
    t5 = {"name": "t5", "num_buckets": 8, "max_distance": 16}
    cfg = tiny_config(tiny_data, position_lr_scale=10.0, weight_decay=0.0)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scheme=t5))
    model = Transformer(cfg.model)
    tables = {id(p) for n, p in model.named_parameters() if n.endswith("scheme.table")}
    groups = param_groups(model, cfg)
    assert len(tables) == cfg.model.num_layers
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(
        id(p) for p in model.parameters()
    )
    for g in groups:
        positional = {id(p) in tables for p in g["params"]}
        assert positional == {g["lr_scale"] == 10.0}
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    set_lr(opt, 0, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, VOCAB_SIZE, (2, 16))
    model(tokens).logsumexp(-1).sum().backward()
    opt.step()
    for n, p in model.named_parameters():
        if n.endswith("scheme.table"):
            moved = (p.detach() - before[n]).abs()
            touched = p.grad != 0
            assert touched.any()
            torch.testing.assert_close(
                moved[touched],
                torch.full_like(moved[touched], 10 * lr_at(0, cfg)),
                rtol=1e-2,
                atol=0,
            )
    run, cfg = tmp_path / "run", dataclasses.replace(cfg, steps=4)
    assert train(cfg, run, progress=False, stop_after=2)["interrupted"]
    assert train(None, run, resume=True, progress=False)["step"] == 4  # the scale survives
    saved = load_checkpoint(run / "last.pt")["optimizer"]["param_groups"]
    ratios = sorted(g["lr"] / lr_at(3, cfg) for g in saved)
    assert ratios == pytest.approx([1.0, 1.0, 10.0])  # T5's tables are matrices: one group
    plain = param_groups(model, dataclasses.replace(cfg, position_lr_scale=1.0))
    assert [(g["weight_decay"], g["lr_scale"]) for g in plain] == [(0.0, 1.0), (0.0, 1.0)]


def test_a_run_writes_its_folder(tiny_data, tmp_path):
    summary = train(tiny_config(tiny_data), tmp_path / "run", progress=False)
    run = tmp_path / "run"
    assert summary["step"] == 8 and not summary["interrupted"]
    for name in ("config.json", "metrics.jsonl", "last.pt", "best.pt", "learning_curve.png"):
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "valid_nll" in r] == [4, 8]
    assert all(math.isfinite(r["train_loss"]) for r in records if "train_loss" in r)
    assert TrainConfig.load(run / "config.json") == tiny_config(tiny_data)
    assert not list(run.glob(".*tmp*")), "temporary files left behind"


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
        ),
    ],
)
def test_an_interrupted_run_resumes_to_the_same_weights(tiny_data, tmp_path, device):
    """Dropout is on: the resumed session continues the generators (CUDA's too, where dropout
    draws on the GPU), so it draws the masks the straight run drew."""
    cfg = tiny_config(tiny_data, steps=10, eval_every=4)
    data = load_token_data(cfg.data, max_shift=cfg.max_shift, progress=False)
    train(cfg, tmp_path / "straight", progress=False, data=data, device=device)
    first = train(cfg, tmp_path / "resumed", progress=False, data=data, stop_after=3, device=device)
    assert first["interrupted"] and first["step"] == 3
    assert load_checkpoint(tmp_path / "resumed" / "last.pt")["step"] == 3
    train(None, tmp_path / "resumed", resume=True, progress=False, data=data, device=device)
    a = load_checkpoint(tmp_path / "straight" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "last.pt")
    assert b["step"] == 10
    mapped = load_checkpoint(tmp_path / "resumed" / "last.pt", mmap=True)  # what --resume reads
    assert mapped["config"] == b["config"]
    assert all(torch.equal(mapped["model"][name], t) for name, t in b["model"].items())
    # On CUDA the backward's atomic adds may round differently run to run; other dropout masks
    # would move the weights by far more.
    tol = 0 if device == "cpu" else 1e-5
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=tol, atol=tol, msg=k)
    steps = [json.loads(x)["step"] for x in (tmp_path / "resumed" / "metrics.jsonl").open()]
    assert steps == sorted(steps), "metrics after the resumed checkpoint were not dropped"


def test_a_failed_checkpoint_write_keeps_the_last_good_one(tiny_data, tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"step": 1, "model": {}, "optimizer": {}, "config": {}})

    def broken_save(obj, f, *a, **k):
        Path(f).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": 2, "model": {}, "optimizer": {}, "config": {}})
    assert load_checkpoint(path)["step"] == 1
    assert list(tmp_path.iterdir()) == [path]


def test_corrupt_and_missing_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00not a checkpoint")
    with pytest.raises(ValueError, match="corrupt or not a relpos checkpoint"):
        load_checkpoint(bad)
    torch.save({"weights": torch.zeros(2)}, bad)
    with pytest.raises(ValueError, match="expected keys"):
        load_checkpoint(bad)
    # One flipped bit inside a weight: torch.load would read it as a wrong number.
    good = tmp_path / "good.pt"
    save_checkpoint(
        good, {"step": 1, "model": {"w": torch.ones(256)}, "optimizer": {}, "config": {}}
    )
    raw = bytearray(good.read_bytes())
    at = raw.find(torch.ones(256).numpy().tobytes())  # the tensor's bytes, stored uncompressed
    raw[at + 500] ^= 0x40
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="does not match its checksum"):
        load_checkpoint(bad)


def test_cli_train_eval_generate(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(tiny_data), *TINY_FLAGS]) == 0
    assert main(["eval", "--run-dir", str(run), "--no-progress"]) == 0
    result = json.loads((run / "eval.json").read_text())
    assert math.isfinite(result["valid_nll"]) and math.isfinite(result["test_nll"])
    assert 0 < result["valid_nll"] < math.log(VOCAB_SIZE) + 1
    out = tmp_path / "song.mid"
    assert (
        main(
            [
                "generate",
                "--run-dir",
                str(run),
                "--length",
                "8",
                "--prime-steps",
                "4",
                "--prime-from",
                "valid:1",
                "--top-k",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.is_file() and out.with_suffix(".musicxml").is_file()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # the piano roll
    text = capsys.readouterr().out
    assert "valid:" in text and str(out) in text
    # The same run again without --resume would overwrite it: refused.
    assert main(["train", "--run-dir", str(run), "--data", str(tiny_data), *TINY_FLAGS]) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_sampling_keeps_the_satb_order(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, steps=2)
    train(cfg, tmp_path / "run", progress=False)
    from relpos import Transformer

    model = Transformer(cfg.model)
    model.load_state_dict(load_checkpoint(tmp_path / "run" / "last.pt")["model"])
    prime = np.array([[67, 60, 55, 48]] * 3, dtype=np.int16)
    out = sample_chorale(model, 10, temperature=1.5, seed=3, prime=prime)
    assert out.shape == (13, 4) and np.array_equal(out[:3], prime)
    assert np.all((out == -1) | ((out >= 24) & (out <= 96)))
    again = sample_chorale(model, 10, temperature=1.5, seed=3, prime=prime)
    assert np.array_equal(out, again), "sampling with a seed is not reproducible"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--scheme", "rotary9"], "unknown scheme 'rotary9'"),
        (["--scheme", "t5", "--scheme-arg", "buckets=8"], r"unknown key\(s\) \['buckets'\]"),
        (["--scheme-arg", "max_distance"], "expects KEY=VALUE"),
        (["--d-model", "30", "--num-heads", "4"], r"d_model \(30\) must be divisible"),
        (["--steps", "0"], "steps must be >= 1"),
        (["--batch-size", "-2"], "batch_size must be >= 1"),
        (["--position-lr-scale", "0"], "--position-lr-scale: position_lr_scale must be"),
    ],
)
def test_cli_bad_configuration(tiny_data, tmp_path, capsys, flags, message):
    argv = ["train", "--run-dir", str(tmp_path / "r"), "--data", str(tiny_data), *TINY_FLAGS]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("relpos train: error:")
    assert __import__("re").search(message, err), err


def test_cli_bad_files(tmp_path, capsys):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"train": "not chorales"}))
    assert main(["train", "--run-dir", str(tmp_path / "r"), "--data", str(wrong), *TINY_FLAGS]) == 2
    assert str(wrong) in capsys.readouterr().err
    assert main(["eval", "--run-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "best.pt").write_bytes(b"garbage")
    assert main(["generate", "--run-dir", str(tmp_path / "corrupt")]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(tmp_path / "missing"), "--resume"]) == 2


# A hang guard only: every subprocess here ends on its own in seconds; none is timed.
HANG_GUARD_S = 600


def _relpos(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Run the ``relpos`` command line in a subprocess with one thread, as from a terminal.

    A shell starts a background job with SIGINT ignored, and an ignored signal stays ignored
    across exec (so Ctrl-C would not reach the run, which then trains on); SIGINT is handled
    here while the child starts, so the child starts with the default action.
    """
    argv = [str(BIN / "relpos"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"relpos {args[0]} hung for {HANG_GUARD_S} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_ctrl_c_leaves_a_checkpoint_to_resume_from(tiny_data, tmp_path):
    # The loop sends itself SIGINT after step 5 (RELPOS_TEST_SIGNAL_AT_STEP), through the same
    # handler as a Ctrl-C, so the stop does not depend on how fast the machine runs.
    flags = [*TINY_FLAGS, "--steps", "12", "--eval-every", "4"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    done = _relpos("train", "--run-dir", str(straight), "--data", str(tiny_data), *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    done = _relpos(
        "train",
        "--run-dir",
        str(run),
        "--data",
        str(tiny_data),
        *flags,
        RELPOS_TEST_SIGNAL_AT_STEP="5",
    )
    assert done.returncode == 130, done.stderr[-3000:]
    assert "finishing this step" in done.stderr and "--resume" in done.stderr
    state = load_checkpoint(run / "last.pt")
    assert state["step"] == 5
    cfg = TrainConfig.from_dict(state["config"])
    assert cfg.steps == 12
    done = _relpos("train", "--run-dir", str(run), "--resume", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(run / "last.pt")
    assert a["step"] == b["step"] == 12
    assert a["best_valid_nll"] == b["best_valid_nll"]
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)


def test_torchrun_two_cpu_processes(tiny_data, tmp_path):
    run = tmp_path / "ddp"
    argv = [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "--standalone",  # a free port, so that parallel test runs do not meet
        "-m",
        "relpos.cli",
        "train",
        "--run-dir",
        str(run),
        "--data",
        str(tiny_data),
        *TINY_FLAGS,
        "--batch-size",
        "4",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    state = load_checkpoint(run / "last.pt")
    assert state["step"] == 6 and len(state["numpy_rng"]) == 2
    assert sum(1 for _ in (run / "metrics.jsonl").open()) >= 2


def test_cli_train_from_a_config_file(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, steps=2, eval_every=2)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert (
        main(["train", "--config", str(path), "--run-dir", str(tmp_path / "r"), "--no-progress"])
        == 0
    )
    assert TrainConfig.load(tmp_path / "r" / "config.json") == cfg
    path.write_text(json.dumps({**cfg.to_dict(), "epochs": 3}))
    assert main(["train", "--config", str(path), "--run-dir", str(tmp_path / "r2")]) == 2
    path.write_text("{not json")
    assert main(["train", "--config", str(path), "--run-dir", str(tmp_path / "r3")]) == 2


# ----------------------------------------------------------------------------- failure safety (#21)


def _strict_json(line: str):
    """``json.loads`` that refuses NaN / Infinity, as every JSON reader but Python's does."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def test_a_non_causal_model_is_refused(tiny_data, tmp_path, capsys):
    cfg = tiny_config(tiny_data)
    d = cfg.to_dict()
    with pytest.raises(ValueError, match=r"model\.causal is false"):
        TrainConfig.from_dict({**d, "model": {**d["model"], "causal": False}})
    for flag in ("no", 0, None):  # "no" used to read as true
        with pytest.raises(TypeError, match=r"model\.causal must be true or false"):
            TrainConfig.from_dict({**d, "model": {**d["model"], "causal": flag}})
    with pytest.raises(TypeError, match=r"causal must be a bool"):  # built in Python: the
        TrainConfig(model=TransformerConfig(vocab_size=VOCAB_SIZE, causal="no"))  # model refuses
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**d, "model": {**d["model"], "causal": False}}))
    assert main(["train", "--config", str(path), "--run-dir", str(tmp_path / "r")]) == 2
    assert "model.causal is false" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"lr": "x"}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"lr": 0}, "lr"),
        ({"lr": True}, "lr"),
        ({"betas": [0.9]}, "betas"),
        ({"betas": "ab"}, "betas"),
        ({"betas": [0.9, 1.5]}, r"betas\[1\]"),
        ({"betas": [None, 0.98]}, r"betas\[0\]"),
        ({"weight_decay": "x"}, "weight_decay"),
        ({"weight_decay": -1}, "weight_decay"),
        ({"min_lr_ratio": 2}, "min_lr_ratio"),
        ({"grad_clip": float("nan")}, "grad_clip"),
        ({"grad_clip": "1"}, "grad_clip"),
        ({"data": 5}, "data"),
        ({"data": ""}, "data"),
        ({"extra": []}, "extra"),
        ({"context": "32"}, "context"),
        ({"steps": True}, "steps"),
        ({"model": 5}, "model"),
        ({"model": "dropout"}, "dropout"),
        ({"model": "backend"}, "backend"),
        ({"accumulate": 0}, "accumulate"),
        ({"accumulate": 3}, r"batch_size \(4\)"),
        ({"ema": 1.5}, "ema"),
        ({"position_lr_scale": 0}, "position_lr_scale"),
        ({"position_lr_scale": "10"}, "position_lr_scale"),
        ({"ema": 1}, "ema"),
        ({"patience": -1}, "patience"),
        ({"autocast": "yes"}, "autocast"),
    ],
)
def test_config_errors_name_the_field(tiny_data, change, field):
    d = tiny_config(tiny_data).to_dict()
    if change.get("model") == "dropout":
        change = {"model": {**d["model"], "dropout": "x"}}
    elif change.get("model") == "backend":
        change = {"model": {**d["model"], "backend": 3}}
    with pytest.raises((TypeError, ValueError), match=rf"^(model\.)?{field} must"):
        TrainConfig.from_dict({**d, **change})


def test_config_numbers_are_stored_as_floats(tiny_data):
    d = tiny_config(tiny_data).to_dict()
    cfg = TrainConfig.from_dict({**d, "lr": 1, "betas": [0, 0.5], "grad_clip": 0})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.betas == (0.0, 0.5)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
    tiny_data, tmp_path, monkeypatch
):
    real, calls = training_loop.window_loss, [0]

    def nan_from_step_6(net, tokens, mask):
        loss, n = real(net, tokens, mask)
        calls[0] += 1
        return (loss * math.nan if calls[0] >= 6 else loss), n

    monkeypatch.setattr(training_loop, "window_loss", nan_from_step_6)
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="diverged at step 6: the training loss is nan") as e:
        train(tiny_config(tiny_data, steps=8, eval_every=4), run, progress=False)
    assert "last.pt still holds step 4" in str(e.value)
    assert isinstance(e.value, ValueError)  # so the command line reports one line, status 2
    last, best = load_checkpoint(run / "last.pt"), load_checkpoint(run / "best.pt")
    assert last["step"] == best["step"] == 4
    for t in last["model"].values():
        assert torch.isfinite(t).all()
    records = [_strict_json(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) <= 5
    assert not list(run.glob(".*tmp*"))


def test_a_diverging_lr_ends_with_a_clear_error_and_no_nan_checkpoint(tiny_data, tmp_path, capsys):
    argv = ["train", "--data", str(tiny_data), *TINY_FLAGS]
    assert main([*argv, "--run-dir", str(tmp_path / "inf"), "--lr", "inf"]) == 2
    assert "lr must be a finite number > 0, got inf" in capsys.readouterr().err
    run = tmp_path / "huge"
    # Step 1 sends the weights to ~1e30; the validation after it is not finite.
    assert main([*argv, "--run-dir", str(run), "--lr", "1e30", "--eval-every", "1"]) == 2
    err = capsys.readouterr().err
    assert "training diverged at step 1: the validation NLL is nan" in err, err
    assert not (run / "last.pt").exists() and not (run / "best.pt").exists()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        _strict_json(line)


def test_metrics_never_hold_bare_nan(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train_loss": NaN}\n{"step": 2, "valid_nll": 1.5}\n')
    m = training_loop._Metrics(path, training_loop._read_metrics(path, 2))
    m.write({"step": 3, "train_loss": math.inf, "lr": 1e-3})
    rows = [_strict_json(x) for x in path.read_text().splitlines()]
    assert rows == [
        {"step": 1, "train_loss": None},
        {"step": 2, "valid_nll": 1.5},
        {"step": 3, "train_loss": None, "lr": 1e-3},
    ]


def _dataset(train_, valid, grid=None) -> TokenDataset:
    seqs = [np.arange(4, 40, dtype=np.int64)]
    return TokenDataset(
        train=seqs if train_ is None else train_,
        valid=seqs if valid is None else valid,
        test=[],
        grid=grid or WindowGrid(),
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_dataset([], None), "the train split is empty"),
        (_dataset(None, []), "the valid split is empty"),
        (_dataset(None, [np.array([5]), np.array([], np.int64)]), "valid split has fewer than 2"),
        (_dataset([np.array([5])], None), "train split has fewer than 2"),
        (_dataset([np.array([5, VOCAB_SIZE])], None), f"token id {VOCAB_SIZE}, outside"),
        (_dataset(None, [np.array([5, -1])]), "valid\\[0\\] holds token id -1"),
        (_dataset(None, None, WindowGrid(step=40)), r"context \(32\) is shorter than one step"),
        (_dataset(None, None, WindowGrid(pad=VOCAB_SIZE)), "pad id"),
    ],
)
def test_bad_data_is_refused_before_step_1(tiny_data, tmp_path, data, message):
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        train(tiny_config(tiny_data), run, progress=False, data=data)
    assert not run.exists(), "a refused run left files behind"


def test_an_empty_validation_split_in_a_data_file_is_refused_at_once(tmp_path, capsys):
    rng = np.random.default_rng(1)
    path = tmp_path / "novalid.json"
    path.write_text(json.dumps({"train": [chorale(rng, 30)], "valid": [], "test": []}))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(path), *TINY_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "the valid split is empty" in err and str(path) in err
    assert not run.exists()


@pytest.mark.parametrize("name", ["best.pt", "config.json", "metrics.jsonl", "eval.json"])
def test_a_folder_holding_a_run_is_not_overwritten(tiny_data, tmp_path, name):
    run = tmp_path / "run"
    run.mkdir()
    (run / name).write_text("someone else's")
    with pytest.raises(FileExistsError, match=rf"already holds a run \({re.escape(name)}\)"):
        train(tiny_config(tiny_data), run, progress=False)
    assert (run / name).read_text() == "someone else's"
    assert sorted(p.name for p in run.iterdir()) == [name]


def test_the_data_path_is_stored_absolute(tiny_data, tmp_path, monkeypatch, capsys):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "tiny.json").write_bytes(tiny_data.read_bytes())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    train(tiny_config(Path("tiny.json"), steps=2, eval_every=2), "run", progress=False)
    absolute = str(tmp_path / "here" / "tiny.json")
    run = tmp_path / "here" / "run"
    assert TrainConfig.load(run / "config.json").data == absolute
    assert load_checkpoint(run / "last.pt")["config"]["data"] == absolute
    monkeypatch.chdir(tmp_path / "elsewhere")  # eval and --resume find the data from anywhere
    assert main(["eval", "--run-dir", str(run), "--no-progress"]) == 0
    assert json.loads((run / "eval.json").read_text())["data"] == absolute
    cfg = tiny_config(tiny_data)
    assert TrainConfig(model=cfg.model, data="music21").with_absolute_data().data == "music21"
    local = TrainConfig(model=cfg.model, data="./music21").with_absolute_data().data
    assert local == str(tmp_path / "elsewhere" / "music21")


def test_sigterm_is_handled_like_ctrl_c(tiny_data, tmp_path, monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv("RELPOS_TEST_SIGNAL_AT_STEP", "3")
    monkeypatch.setenv("RELPOS_TEST_SIGNAL", "SIGTERM")
    cfg = tiny_config(tiny_data, steps=8, eval_every=4)
    data = load_token_data(cfg.data, max_shift=cfg.max_shift, progress=False)
    summary = train(cfg, tmp_path / "run", progress=False, data=data)
    assert summary["interrupted"] and summary["step"] == 3
    assert summary["signal"] == "SIGTERM" and summary["exit_status"] == 143
    assert load_checkpoint(tmp_path / "run" / "last.pt")["step"] == 3
    assert signal.getsignal(signal.SIGTERM) is before, "the handler was not restored"
    monkeypatch.delenv("RELPOS_TEST_SIGNAL_AT_STEP")
    done = train(None, tmp_path / "run", resume=True, progress=False, data=data)
    assert done["step"] == 8 and done["exit_status"] == 0 and done["signal"] is None


def test_stale_temporaries_are_cleaned_at_start_and_resume(tiny_data, tmp_path):
    # The pattern matches the names atomic_path really gives.
    with atomic_path(tmp_path / "last.pt") as live:
        assert stale_temporaries(tmp_path, RUN_FILES) == [live]
        live.write_text("x")
    with atomic_path(tmp_path / "learning_curve.png", suffix=".png") as live:
        assert stale_temporaries(tmp_path, RUN_FILES) == [live]
        live.write_text("x")
    cfg = tiny_config(tiny_data, steps=4, eval_every=2)
    run = tmp_path / "run"
    run.mkdir()
    stale = [".last.pt.ab_d1234.tmp", ".learning_curve.png.x9y8z7w6.tmp.png"]
    kept = [
        ".notes.txt.abcd1234.tmp",  # not a run file
        ".last.pt.abc.tmp",  # not tempfile's name
        "last.pt.abcd1234.tmp",  # no leading dot
        ".best.pt.abcd1234.tmp",  # a link, below
        ".config.json.abcd1234.tmp",  # a folder
    ]
    for name in stale + kept[:3]:
        (run / name).write_text("left by a killed writer")
    (run / kept[3]).symlink_to(tmp_path / "last.pt")
    (run / kept[4]).mkdir()
    train(cfg, run, progress=False, stop_after=2)  # a new run: the temporaries are not a run
    assert not any((run / n).exists() for n in stale)
    assert all((run / n).exists() or (run / n).is_symlink() for n in kept)
    (run / stale[0]).write_text("killed again")
    train(None, run, resume=True, progress=False)
    assert not (run / stale[0]).exists()
    assert (tmp_path / "last.pt").read_text() == "x"


def test_an_out_of_vocabulary_pitch_names_the_file_and_chorale(tmp_path):
    path = tmp_path / "low.json"
    ok = [[60, 55, 52, 48]]
    path.write_text(
        json.dumps({"train": [ok], "valid": [ok, [ok[0], [60, 55, 52, 10]]], "test": []})
    )
    for load in (load_chorales, lambda p: load_token_data(str(p), max_shift=0, progress=False)):
        with pytest.raises(ValueError, match="valid chorale 1") as e:
            load(path)
        msg = str(e.value)
        assert str(path) in msg and "valid chorale 1 (valid/001), step 1, voice 3 (bass)" in msg
        assert "pitch 10 is outside the token vocabulary 24..96" in msg
    with pytest.raises(ValueError, match=r"train\[0\] \(bwv1, from x\.json\): values must be"):
        ChoraleSplits([np.array([[200, 1, 1, 1]])], [], [], ["bwv1"], [], [], source="x.json")


class _Foreign:
    """A class a checkpoint must not smuggle in."""


def test_checkpoint_errors_never_advise_weights_only_false(tmp_path):
    bad = tmp_path / "foreign.pt"
    torch.save({"format": 1, "step": 0, "model": _Foreign(), "optimizer": {}, "config": {}}, bad)
    with pytest.raises(ValueError, match="holds Python objects") as e:
        load_checkpoint(bad)
    assert "_Foreign" in str(e.value)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x80\x02garbage")
    with pytest.raises(ValueError, match="corrupt or not a relpos checkpoint") as e2:
        load_checkpoint(garbage)
    for err in (e, e2):
        assert "weights_only" not in str(err.value) and "trust" not in str(err.value)


# ----------------------------------------------------------------------------- recipe features


def test_weight_average_equals_the_hand_computed_average():
    model = torch.nn.Linear(3, 2)
    average = WeightAverage(model, decay=0.8)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for t in range(1, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        average.update(model)
        d = min(0.8, (1 + t) / (10 + t))  # the ramp, then the decay
        for k, v in model.state_dict().items():
            want[k] = d * want[k] + (1 - d) * v
    assert average.updates == 29
    for k, v in average.model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6, msg=k)
    assert not any(p.requires_grad for p in average.model.parameters())


def test_micro_batches_add_up_to_the_whole_batchs_gradient(tiny_data):
    data = load_token_data(str(tiny_data), max_shift=2, progress=False)
    cfg = tiny_config(tiny_data)
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(cfg.model, dropout=0.0))
    w = random_windows(data.train, 8, cfg.context, np.random.default_rng(0), grid=data.grid)
    tokens, mask = torch.from_numpy(w.tokens), torch.from_numpy(w.mask)
    grads = {}
    for k in (1, 2, 4, 8):
        model.zero_grad(set_to_none=True)
        loss, n = accumulate_gradients(model, tokens, mask, micro_batches=k)
        grads[k] = {name: p.grad.clone() for name, p in model.named_parameters()}
        if k == 1:
            want = loss
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        assert n == int(mask[:, 1:].sum())
    for k in (2, 4, 8):
        for name, g in grads[1].items():
            torch.testing.assert_close(grads[k][name], g, rtol=1e-4, atol=1e-6, msg=f"{k}: {name}")


def test_validation_and_evaluation_use_the_weight_average(tiny_data, tmp_path, capsys):
    cfg = tiny_config(tiny_data, ema=0.9, steps=6, eval_every=3)
    data = load_token_data(cfg.data, max_shift=cfg.max_shift, progress=False)
    train(cfg, tmp_path / "run", progress=False, data=data)
    state = load_checkpoint(tmp_path / "run" / "best.pt")
    assert state["ema"]["updates"] == state["step"]
    averaged, trained = Transformer(cfg.model).eval(), Transformer(cfg.model).eval()
    averaged.load_state_dict(state["ema"]["model"])
    trained.load_state_dict(state["model"])
    nll = evaluate_nll(averaged, data.valid, context=cfg.context, grid=data.grid)
    assert nll == pytest.approx(state["valid_nll"], rel=1e-6)
    assert evaluate_nll(trained, data.valid, context=cfg.context, grid=data.grid) != pytest.approx(
        nll, rel=1e-6
    )
    # `relpos eval` reads the average too.
    assert (
        main(["eval", "--run-dir", str(tmp_path / "run"), "--splits", "valid", "--no-progress"])
        == 0
    )
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["valid_nll"] == pytest.approx(nll, rel=1e-5)


def test_a_resumed_run_continues_the_average_and_the_patience(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, ema=0.9, patience=5, steps=10, eval_every=2)
    data = load_token_data(cfg.data, max_shift=cfg.max_shift, progress=False)
    train(cfg, tmp_path / "straight", progress=False, data=data)
    train(cfg, tmp_path / "resumed", progress=False, data=data, stop_after=5)
    train(None, tmp_path / "resumed", resume=True, progress=False, data=data)
    a = load_checkpoint(tmp_path / "straight" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "last.pt")
    assert a["ema"]["updates"] == b["ema"]["updates"] == 10
    assert a["evals_since_best"] == b["evals_since_best"]
    for k, v in a["ema"]["model"].items():
        torch.testing.assert_close(b["ema"]["model"][k], v, rtol=0, atol=0, msg=k)


def test_early_stopping_keeps_the_best_checkpoint(tiny_data, tmp_path, monkeypatch):
    # Validation NLLs chosen by the test: the best at the second validation, then none better.
    nlls = iter([3.0, 2.0, 2.5, 2.2, 9.0, 9.0])
    monkeypatch.setattr(training_loop, "evaluate_nll", lambda *a, **k: next(nlls))
    cfg = tiny_config(tiny_data, steps=12, eval_every=2, patience=2)
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["stopped_early"] and not summary["interrupted"] and summary["exit_status"] == 0
    assert summary["step"] == 8 and summary["best_valid_nll"] == 2.0
    best = load_checkpoint(tmp_path / "run" / "best.pt")
    assert best["step"] == 4 and best["valid_nll"] == 2.0
    assert load_checkpoint(tmp_path / "run" / "last.pt")["step"] == 8
    # Resuming (or rerunning `relpos demo`) a run that stopped early trains no further.
    again = train(None, tmp_path / "run", resume=True, progress=False)
    assert again["stopped_early"] and again["step"] == 8 and again["best_valid_nll"] == 2.0
    assert load_checkpoint(tmp_path / "run" / "last.pt")["step"] == 8


def test_bfloat16_autocast_trains_with_float32_weights(tiny_data, tmp_path):
    summary = train(tiny_config(tiny_data, autocast=True, steps=2, eval_every=2), tmp_path / "r")
    assert math.isfinite(summary["best_valid_nll"])
    state = load_checkpoint(tmp_path / "r" / "last.pt")
    assert all(v.dtype == torch.float32 for v in state["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("native", [False, True])
def test_autocast_auto_follows_native_bfloat16(tiny_data, tmp_path, monkeypatch, native):
    """``autocast="auto"`` is on exactly where the device computes bfloat16 natively (faked here
    both ways); the config keeps ``"auto"``, the summary says what ran."""
    import relpos.training.loop as loop_mod

    monkeypatch.setattr(loop_mod, "native_bf16", lambda device: native)
    cfg = tiny_config(tiny_data, autocast="auto", steps=1, eval_every=1)
    assert train(cfg, tmp_path / "r")["autocast"] is native
    assert TrainConfig.load(tmp_path / "r" / "config.json").autocast == "auto"


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    import relpos.runtime as runtime

    assert set(runtime.bf16_instructions()) <= set(runtime.BF16_FLAGS)  # this machine's, read
    monkeypatch.setattr(runtime, "bf16_instructions", lambda: [])
    assert not runtime.native_bf16("cpu")
    monkeypatch.setattr(runtime, "bf16_instructions", lambda: ["avx512_bf16"])
    assert runtime.native_bf16("cpu") and not runtime.native_bf16("meta")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], False),
        (["--autocast"], True),
        (["--autocast", "auto"], "auto"),
        (["--autocast", "off"], False),
        (["--autocast=on", "--no-autocast"], False),
    ],
)
def test_autocast_flag_takes_on_off_auto(tiny_data, tmp_path, flags, expected):
    run = tmp_path / "run"
    base = [*TINY_FLAGS, "--steps", "1", "--eval-every", "1", "--warmup", "1"]
    assert main(["train", "--run-dir", str(run), "--data", str(tiny_data), *base, *flags]) == 0
    assert TrainConfig.load(run / "config.json").autocast == expected


def test_recipe_flags_reach_the_config(tiny_data, tmp_path):
    run = tmp_path / "run"
    flags = [*TINY_FLAGS, "--steps", "2", "--eval-every", "2"]
    extra = ["--accumulate", "2", "--ema", "0.99", "--patience", "3", "--autocast"]
    assert main(["train", "--run-dir", str(run), "--data", str(tiny_data), *flags, *extra]) == 0
    cfg = TrainConfig.load(run / "config.json")
    assert (cfg.accumulate, cfg.ema, cfg.patience, cfg.autocast) == (2, 0.99, 3, True)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_recipes_load_and_fit_the_vocabulary(path):
    """Every ``configs/*.json`` is a valid ``TrainConfig`` for the chorales' vocabulary whose data
    is a name (``jsb``: shipped inside the package) or a file inside the repository, so that it
    runs from any fresh clone."""
    cfg = TrainConfig.load(path)
    assert cfg.model.vocab_size == VOCAB_SIZE
    if cfg.data not in ("jsb", "music21"):
        assert not Path(cfg.data).is_absolute()
        assert (ROOT / cfg.data).resolve().is_relative_to(ROOT), cfg.data


@pytest.mark.parametrize("name", ["jsb-music.json", "jsb-music-timing.json"])
def test_a_shipped_recipe_trains_from_the_packaged_split(name, tiny_data, tmp_path):
    """The recipe's config (its model as shipped; shorter windows and one step) trains from the
    packaged ``jsb`` split with nothing beside the repository; ``relpos eval`` records its
    schemes (the timing recipe's per-layer ones too)."""
    cfg = TrainConfig.load(ROOT / "configs" / name)
    assert cfg.data == "jsb"
    quick = dataclasses.replace(cfg, context=32, batch_size=2, warmup=1, max_shift=0, ema=0.0)
    summary = train(quick, tmp_path / "run", progress=False, stop_after=1)
    assert summary["step"] == 1
    assert load_checkpoint(tmp_path / "run" / "last.pt")["config"]["data"] == "jsb"
    run = ["--run-dir", str(tmp_path / "run"), "--checkpoint", "last", "--data", str(tiny_data)]
    assert main(["eval", *run, "--splits", "valid", "--no-progress"]) == 0
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert (result["scheme"], result["layer_schemes"]) == (
        cfg.model.scheme,
        cfg.model.layer_schemes,
    )


def test_the_jsb_recipe_is_shipped():
    assert (ROOT / "configs" / "jsb-music.json").is_file()


def test_the_trainer_takes_its_data_and_knows_no_music(tiny_data, tmp_path):
    """``relpos.training`` imports nothing of ``relpos.music``; ``train`` needs its ``data``."""
    code = "import sys, relpos.training; print('relpos.music' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    with pytest.raises(TypeError, match="data"):
        train_on(tiny_config(tiny_data), tmp_path / "run", progress=False)
    with pytest.raises(TypeError, match="data must be a TokenDataset, got str"):
        train_on(tiny_config(tiny_data), tmp_path / "run", progress=False, data=str(tiny_data))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("scheme", ["music", "sinusoidal"])
@pytest.mark.parametrize(("context", "stride"), [(8, 8), (8, 3), (8, 1), (5, 2)])
def test_sliding_evaluation_equals_a_loop_over_tokens(scheme, context, stride):
    """``evaluate_nll(stride=)`` against a loop from the definition: windows start every
    ``stride`` tokens (any token may start one: the default grid), window ``k`` reads tokens
    ``[k·stride, min(k·stride + context, n - 1))``, and each token is predicted by the first
    window that reaches it, from that window's tokens before it alone (no batch, no padding)."""
    torch.manual_seed(0)
    spec = {"name": "music", "max_distance": 4} if scheme == "music" else {"name": "sinusoidal"}
    cfg = TransformerConfig(vocab_size=20, d_model=16, num_heads=2, num_layers=2, scheme=spec)
    model = Transformer(cfg).eval()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 20, n) for n in (1, 2, 6, 9, 17, 23)]
    total, count = 0.0, 0
    with torch.no_grad():
        for seq in seqs:
            n, starts = len(seq), range(0, max(len(seq) - 1, 1), stride)
            stops = [min(s + context, n - 1) for s in starts]
            for p in range(1, n):
                start = next(s for s, e in zip(starts, stops, strict=False) if e >= p)
                logits = model(torch.as_tensor(seq[start:p])[None])[0, -1]
                total -= torch.log_softmax(logits.double(), -1)[seq[p]].item()
                count += 1
    got = evaluate_nll(model, seqs, context=context, stride=stride, batch_size=3)
    assert got == pytest.approx(total / count, rel=1e-5)
    if stride < context:  # not vacuous: the overlap changes the figure
        assert got != pytest.approx(evaluate_nll(model, seqs, context=context), rel=1e-5)
