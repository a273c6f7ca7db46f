"""Training, evaluation, generation and the command line, on a tiny generated data set."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relpos import TransformerConfig
from relpos.cli import main
from relpos.music import VOCAB_SIZE, load_token_data, sample_chorale
from relpos.training import TrainConfig, load_checkpoint, lr_at, save_checkpoint, train

ROOT = Path(__file__).resolve().parents[1]
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


def test_an_interrupted_run_resumes_to_the_same_weights(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, steps=10, eval_every=4)
    data = load_token_data(cfg.data, max_shift=cfg.max_shift, progress=False)
    train(cfg, tmp_path / "straight", progress=False, data=data)
    first = train(cfg, tmp_path / "resumed", progress=False, data=data, stop_after=3)
    assert first["interrupted"] and first["step"] == 3
    assert load_checkpoint(tmp_path / "resumed" / "last.pt")["step"] == 3
    train(None, tmp_path / "resumed", resume=True, progress=False, data=data)
    a = load_checkpoint(tmp_path / "straight" / "last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "last.pt")
    assert b["step"] == 10
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=0, msg=k)
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
