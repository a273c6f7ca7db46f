"""The command line refuses user mistakes with one line naming the argument, and status 2.

Every call runs ``relpos.cli.main`` in-process on a tiny JSB file; a refused call never reaches
training, so the whole catalogue costs a few seconds. Also here: ``auto`` and evaluation stay
``O(L)`` in memory at a long context (issue 20).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relpos import Positions, Transformer, TransformerConfig, make_scheme
from relpos.attention import auto as auto_mod
from relpos.attention.auto import SDPA_MASK_BUDGET, choose_backend, sdpa_mask_bytes
from relpos.cli import commands, limits, main
from relpos.cli.runs import load_model
from relpos.music import (
    chorale_statistics,
    compare_chorales,
    load_chorales,
    sample_chorale,
    write_midi,
)
from relpos.training import evaluate_nll, load_checkpoint, save_checkpoint
from relpos.training.evaluate import window_loss
from tests.helpers import benchmark_script
from tests.test_backends import MaxNumel

pytestmark = pytest.mark.usefixtures("one_thread")


def chorale(rng: np.random.Generator, steps: int) -> list[list[int]]:
    centre = np.array([67, 60, 55, 48])
    walk = np.cumsum(rng.integers(-2, 3, size=(steps, 4)), axis=0).clip(-5, 5)
    return (centre + walk).tolist()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    data = {
        split: [chorale(rng, int(rng.integers(24, 40))) for _ in range(k)]
        for split, k in (("train", 4), ("valid", 2), ("test", 2))
    }
    path = tmp_path_factory.mktemp("data") / "tiny.json"
    path.write_text(json.dumps(data))
    return path


TINY_FLAGS = [
    *("--d-model", "16", "--num-heads", "2", "--num-layers", "1", "--context", "32"),
    *("--batch-size", "2", "--steps", "2", "--eval-every", "1", "--warmup", "1"),
    "--no-progress",
]


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory) -> Path:
    """A trained run folder (2 steps), shared by the eval and generate cases."""
    folder = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", "--run-dir", str(folder), "--data", str(tiny_data), *TINY_FLAGS]) == 0
    return folder


@pytest.fixture(scope="module")
def nan_checkpoint(run, tmp_path_factory) -> Path:
    state = load_checkpoint(run / "best.pt")
    name = next(iter(state["model"]))
    state["model"][name][0] = float("nan")
    return save_checkpoint(tmp_path_factory.mktemp("nan") / "nan.pt", state)


def refused(capsys, argv: list[str], *patterns: str, status: int = 2) -> str:
    """Run ``argv``; assert the status, and one line on stderr matching every pattern."""
    assert main(argv) == status
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"relpos {argv[0]}: error:" if argv else "relpos: error:"), err
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, err)
    return lines[0]


# ----------------------------------------------------------------------------- the three


@pytest.mark.parametrize("device", ["idee", "meta", "cuda:x"])
def test_a_device_that_is_no_device(tiny_data, tmp_path, capsys, device):
    argv = ["train", "--run-dir", str(tmp_path / "r"), "--data", str(tiny_data), *TINY_FLAGS]
    refused(capsys, [*argv, "--device", device], "--device", re.escape(repr(device)))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_refuse_a_device_that_is_not_there(
    command, tmp_path, capsys, monkeypatch
):
    """``relpos eval/generate --device``: checked before the run folder is read."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [command, "--run-dir", str(tmp_path), "--device"]
    refused(capsys, [*argv, "cuda"], "--device", "not available", "--device cpu")
    refused(capsys, [*argv, "idee"], "--device", "'idee'")


def test_a_device_that_is_not_there(tiny_data, tmp_path, capsys, monkeypatch):
    argv = ["train", "--run-dir", str(tmp_path / "r"), "--data", str(tiny_data), *TINY_FLAGS]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused(capsys, [*argv, "--device", "cuda"], "--device", "not available", "--device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    refused(capsys, [*argv, "--device", "cuda:3"], "--device", "1 CUDA device")


def test_a_long_context_trains_and_evaluates_in_o_l_memory(tiny_data, tmp_path, capsys):
    """The issue's command: validation at context 100,000 used to build a 30 GB (i, j) mask."""
    run = tmp_path / "r"
    flags = ["--d-model", "16", "--num-heads", "2", "--num-layers", "1", "--context", "100000"]
    flags += ["--batch-size", "1", "--steps", "2", "--eval-every", "1", "--no-progress"]
    assert main(["train", "--run-dir", str(run), "--data", str(tiny_data), *flags]) == 0
    assert main(["eval", "--run-dir", str(run), "--no-progress"]) == 0
    assert math.isfinite(json.loads((run / "eval.json").read_text())["valid_nll"])


def test_a_context_the_machine_cannot_hold_is_refused_up_front(
    tiny_data, tmp_path, capsys, monkeypatch
):
    argv = ["train", "--run-dir", str(tmp_path / "r"), "--data", str(tiny_data), *TINY_FLAGS]
    line = refused(capsys, [*argv, "--context", str(10**9)], r"--context 1000000000", "available")
    assert re.search(r"needs about [\d.]+ [TP]B", line), line
    refused(capsys, [*argv, "--d-model", "65536"], "--d-model 65536", "smaller model")
    # An (L, L) backend at a context auto would run in O(L): the hint names --backend auto.
    monkeypatch.setattr(limits, "available_memory", lambda device: 2 * 10**9)
    refused(capsys, [*argv, "--context", "20000", "--backend", "eager"], "--context 20000", "auto")
    assert main([*argv, "--context", "20000", "--steps", "1"]) == 0  # auto: O(L), it fits


# ----------------------------------------------------------------------------- train


TRAIN_CASES = [
    (["--steps", "1e3"], ["argument --steps", "integer|int value"]),
    (["--steps", "0"], ["--steps", "steps must be >= 1"]),
    (["--batch-size", "-2"], ["--batch-size", "batch_size must be >= 1"]),
    (["--context", "2"], ["--context", ">= 4"]),
    (["--num-heads", "0"], ["--num-heads"]),
    (["--num-layers", "0"], ["--num-layers"]),
    (["--d-model", "30", "--num-heads", "4"], ["--d-model/--num-heads", "divisible"]),
    (["--lr", "nan"], ["--lr", "finite"]),
    (["--lr", "-1"], ["--lr"]),
    (["--dropout", "1.5"], ["--dropout"]),
    (["--autocast", "maybe"], ["--autocast", "on, off or auto", "maybe"]),
    (["--no-autocast=on"], ["--no-autocast", "takes no value"]),
    (["--warmup", "-1"], ["--warmup"]),
    (["--warmup", "3"], ["--warmup", "3 is longer than the run's 2 steps"]),
    (["--eval-every", "0"], ["--eval-every"]),
    (["--max-shift", "-1"], ["--max-shift"]),
    (["--seed", "-1"], ["argument --seed"]),
    (["--seed", str(2**64)], ["argument --seed"]),
    (["--backend", "fast"], ["--backend", "unknown backend 'fast'"]),
    (["--scheme", "rotary9"], ["--scheme", "unknown scheme 'rotary9'"]),
    (["--scheme-arg", "max_distance=abc"], ["--scheme-arg", "max_distance"]),
    (["--scheme-arg", "name=t5"], ["--scheme-arg", "--scheme"]),
    (["--scheme-arg", "max_distance"], ["--scheme-arg", "KEY=VALUE"]),
    (["--scheme", "learned", "--scheme-arg", "max_len=16"], ["--context 32", "max_len=16"]),
    (["--data", "{tmp}/missing.json"], ["--data", "does not exist"]),
    (["--data", "{tmp}"], ["--data", "is a folder"]),
    (["--data", "{tmp}/not-json.txt"], ["^relpos train: error: --data: ", "not valid JSON"]),
    (["--run-dir", "{data}"], ["--run-dir", "not a folder"]),
    (["--run-dir", "{data}/sub"], ["--run-dir", "cannot create"]),
    # Issue 45 item 7: permission bits said yes (root), the folder said [Errno 2] at mkdir.
    pytest.param(
        ["--run-dir", "/proc/relpos-x/r"],
        ["--run-dir", "cannot create /proc/relpos-x/r", "cannot write in /proc"],
        marks=pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc"),
        id="--run-dir /proc/relpos-x/r",
    ),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
]


@pytest.mark.parametrize(
    ("flags", "patterns"),
    TRAIN_CASES,
    ids=[c.id if hasattr(c, "id") else " ".join(c[0]) for c in TRAIN_CASES],
)
def test_train_refuses(tiny_data, tmp_path, capsys, flags, patterns):
    flags = [f.format(tmp=tmp_path, data=tiny_data) for f in flags]
    (tmp_path / "not-json.txt").write_text("a chorale\n")
    argv = ["train", "--run-dir", str(tmp_path / "r"), "--data", str(tiny_data), *TINY_FLAGS]
    refused(capsys, argv + flags, *patterns)
    assert not (tmp_path / "r").exists()


def test_a_default_warmup_is_cut_to_the_steps(tiny_data, tmp_path, capsys):
    """The default warm-up (60 steps) in a 2-step run would keep the learning rate under 4 % of
    --lr: it is cut to the steps, with a note."""
    at = TINY_FLAGS.index("--warmup")
    flags = TINY_FLAGS[:at] + TINY_FLAGS[at + 2 :]
    assert main(["train", "--run-dir", str(tmp_path / "r"), "--data", str(tiny_data), *flags]) == 0
    assert "warm-up cut from 60 to the run's 2 steps" in capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "config.json").read_text())["warmup"] == 2


def test_train_refuses_configs_and_resumes(tiny_data, tmp_path, capsys):
    r = ["train", "--run-dir", str(tmp_path / "r")]
    refused(capsys, [*r, "--resume"], "--resume", "last.pt", "does not exist")
    refused(capsys, [*r, "--config", str(tmp_path / "no.json")], "--config", "does not exist")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    refused(capsys, [*r, "--config", str(bad)], "--config", "not valid JSON")
    good = {"model": {"vocab_size": 77, "d_model": 16, "num_heads": 2, "num_layers": 1}}
    bad.write_text(json.dumps({**good, "data": str(tiny_data), "lr": -1}))
    refused(capsys, [*r, "--config", str(bad)], f"--config {re.escape(str(bad))}", "lr")
    bad.write_text(json.dumps({**good, "data": str(tmp_path / "gone.json")}))
    refused(capsys, [*r, "--config", str(bad)], "data in --config", "does not exist")
    bad.write_text(json.dumps({**good, "data": str(bad)}))  # a file, but not chorales
    refused(capsys, [*r, "--config", str(bad)], "data in --config", "'train'")
    refused(capsys, [*r, "--config", str(bad), "--resume"], "--config and --resume")
    # Issue 45 item 7: a partial config named __init__'s missing positional argument.
    bad.write_text(json.dumps({"model": {"d_model": 16}, "data": str(tiny_data)}))
    refused(capsys, [*r, "--config", str(bad)], r"model config needs key\(s\) \['vocab_size'\]")
    bad.write_text(json.dumps({"data": str(tiny_data)}))
    refused(capsys, [*r, "--config", str(bad)], r"train config needs key\(s\) \['model'\]")


def test_an_unwritable_checkpoint_is_found_before_training(tiny_data, tmp_path, capsys):
    """Issue 45 item 7: a folder where ``last.pt`` goes failed at the first checkpoint write,
    after the data, the model and the first steps; now before anything runs, naming the file."""
    run = tmp_path / "r"
    (run / "last.pt").mkdir(parents=True)
    argv = ["train", "--run-dir", str(run), "--data", str(tiny_data), *TINY_FLAGS]
    for args in (argv, [*argv[:3], "--resume"]):
        refused(capsys, args, "--run-dir", re.escape(f"{run / 'last.pt'}: a folder is in its"))
    assert sorted(p.name for p in run.iterdir()) == ["last.pt"]  # the probes left nothing


def test_flags_given_with_config_override_its_fields(tiny_data, tmp_path, capsys):
    """``--config`` plus flags: each flag given replaces its field (the data elsewhere, a shorter
    run, the scheme's distance, autocast off); the flags not given keep the file's values."""
    cfg = tmp_path / "recipe.json"
    model = {"vocab_size": 77, "d_model": 16, "num_heads": 2, "num_layers": 1, "dropout": 0.2}
    scheme = {"name": "music", "max_distance": 64}
    cfg.write_text(
        json.dumps(
            {
                "model": {**model, "scheme": scheme},
                "data": str(tmp_path / "not-here.json"),
                "context": 32,
                "batch_size": 2,
                "steps": 50,
                "eval_every": 1,
                "warmup": 1,
                "lr": 0.003,
                "autocast": True,
            }
        )
    )
    run = tmp_path / "r"
    argv = ["train", "--config", str(cfg), "--run-dir", str(run), "--no-progress"]
    overrides = ["--data", str(tiny_data), "--steps", "2", "--no-autocast"]
    assert main([*argv, *overrides, "--scheme-arg", "max_distance=8"]) == 0
    capsys.readouterr()
    saved = json.loads((run / "config.json").read_text())
    assert Path(saved["data"]) == tiny_data.resolve()
    assert (saved["steps"], saved["autocast"], saved["lr"]) == (2, False, 0.003)
    assert saved["model"]["scheme"] == {**scheme, "max_distance": 8}
    assert saved["model"]["dropout"] == 0.2  # not given: the file's
    # --scheme replaces the scheme; a bad override names its flag.
    assert main([*argv, *overrides, "--run-dir", str(tmp_path / "r2"), "--scheme", "alibi"]) == 0
    capsys.readouterr()
    saved = json.loads((tmp_path / "r2" / "config.json").read_text())
    assert saved["model"]["scheme"]["name"] == "alibi"
    refused(capsys, [*argv, *overrides, "--lr", "-1"], "--lr")
    refused(capsys, [*argv, "--data", str(tmp_path / "gone.json")], "--data", "does not exist")
    refused(capsys, ["train", "--run-dir", str(run), "--resume", "--lr", "0.1"], "--lr", "--resume")


# ----------------------------------------------------------------------------- eval


def test_eval_refuses(run, nan_checkpoint, tiny_data, tmp_path, capsys):
    e = ["eval", "--no-progress"]
    refused(capsys, [*e, "--run-dir", str(tmp_path / "no")], "--run-dir", "does not exist")
    refused(capsys, [*e, "--run-dir", str(tiny_data)], "--run-dir", "not a folder")
    r = [*e, "--run-dir", str(run)]
    refused(capsys, [*r, "--checkpoint", "last2"], "--checkpoint", "does not exist")
    refused(capsys, [*r, "--checkpoint", str(tmp_path)], "--checkpoint", "is a folder")
    refused(capsys, [*r, "--splits", "valid,bogus"], "--splits", "'bogus'")
    refused(capsys, [*r, "--splits", ","], "--splits")
    refused(capsys, [*r, "--data", str(tmp_path / "no.json")], "--data", "does not exist")
    refused(capsys, [*r, "--checkpoint", str(nan_checkpoint)], "--checkpoint", "non-finite")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"garbage")
    refused(capsys, [*r, "--checkpoint", str(corrupt)], "--checkpoint", "corrupt")
    only_last = tmp_path / "only-last"
    only_last.mkdir()
    (only_last / "last.pt").write_bytes((run / "last.pt").read_bytes())
    refused(capsys, [*e, "--run-dir", str(only_last)], "--checkpoint best", "--checkpoint last")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(
        capsys, [*e, "--run-dir", str(empty)], "^relpos eval: error: --run-dir", "no checkpoint"
    )
    assert not (run / "eval.json").exists()


def test_eval_at_another_context_or_stride_keeps_its_own_file(run, tmp_path, capsys):
    """``--context``, ``--stride``: every token still scored once, in longer or overlapping
    windows (tokens see more of their past); the training context's figure stays in eval.json."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    e = ["eval", "--run-dir", str(copy), "--no-progress"]
    assert main([*e, "--context", "32"]) == 0  # the run's own context: eval.json
    trained = json.loads((copy / "eval.json").read_text())
    assert main([*e, "--context", "96"]) == 0
    longer = json.loads((copy / "eval-context96.json").read_text())
    assert (trained["context"], longer["context"]) == (32, 96)
    assert trained["layer_schemes"] is None  # one scheme throughout (the timing recipe lists its)
    assert longer["valid_nll"] != trained["valid_nll"]
    assert json.loads((copy / "eval.json").read_text()) == trained
    refused(capsys, [*e, "--context", "0"], "argument --context")
    refused(capsys, [*e, "--context", "2"], "--context", ">= 4, got 2")
    assert main([*e, "--stride", "16"]) == 0  # overlapping windows: more past per token
    sliding = json.loads((copy / "eval-stride16.json").read_text())
    assert (sliding["context"], sliding["stride"]) == (32, 16)
    assert sliding["valid_nll"] != trained["valid_nll"]
    assert main([*e, "--context", "96", "--stride", "48"]) == 0
    assert json.loads((copy / "eval-context96-stride48.json").read_text())["stride"] == 48
    refused(capsys, [*e, "--stride", "64"], "--stride 64", "4 .* to the context \\(32\\)")
    refused(capsys, [*e, "--stride", "2"], "--stride 2")
    assert json.loads((copy / "eval.json").read_text()) == trained


# ----------------------------------------------------------------------------- generate


def test_generate_refuses(run, nan_checkpoint, tiny_data, tmp_path, capsys):
    g = ["generate", "--run-dir", str(run), "--no-progress"]
    refused(capsys, [*g, "--prime-steps", "-3"], "argument --prime-steps", ">= 0")
    refused(capsys, [*g, "--length", "10000000"], "argument --length", "1..10000")
    refused(capsys, [*g, "--length", "0"], "argument --length")
    for t in ("nan", "inf", "0", "-1", "warm"):
        refused(capsys, [*g, "--temperature", t], "argument --temperature")
    refused(capsys, [*g, "--top-k", "-1"], "argument --top-k")
    refused(capsys, [*g, "--seed", "-1"], "argument --seed")
    refused(capsys, [*g, "--out", str(tmp_path)], "--out", "is a folder")
    refused(capsys, [*g, "--out", str(tmp_path / "x.wav")], "--out", r"\.mid")
    refused(capsys, [*g, "--out", f"{tiny_data}/x.mid"], "--out", "not a folder")
    refused(capsys, [*g, "--prime-from", "bogus"], "--prime-from", "SPLIT:INDEX")  # steps or not
    p = [*g, "--prime-steps", "4", "--prime-from"]
    for bad in ("test:x", "foo", "test:", "test:-1"):
        refused(capsys, [*p, bad], "--prime-from", "SPLIT:INDEX")
    refused(capsys, [*p, "test:9"], "--prime-from", "out of range")
    refused(capsys, [*g, "--prime-steps", "999"], "--prime-steps 999", "only")
    refused(capsys, [*g, "--checkpoint", str(nan_checkpoint)], "--checkpoint", "non-finite")
    refused(capsys, ["generate", "--run-dir", str(tmp_path / "no")], "--run-dir")
    assert not (run / "samples").exists()


def test_generate_shows_progress_and_takes_any_finite_temperature(run, tmp_path, capsys):
    out = tmp_path / "a.mid"
    argv = ["generate", "--run-dir", str(run), "--length", "6", "--out", str(out)]
    assert main([*argv, "--temperature", "1e-30"]) == 0
    assert "6/6" in capsys.readouterr().err  # the progress bar, one tick per step
    assert main([*argv, "--temperature", "1e30", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    for t in ("1e-300", "1e-39", "3.5e38", "1e300"):  # past float32's range: float64 sampling
        assert main([*argv, "--temperature", t, "--no-progress"]) == 0
    capsys.readouterr()
    refused(capsys, [*argv, "--temperature", "5e-324"], "argument --temperature", "at least")
    model = Transformer(TransformerConfig(vocab_size=77, d_model=8, num_heads=2, num_layers=1))
    greedy = sample_chorale(model, 3, top_k=1)
    assert (sample_chorale(model, 3, temperature=1e-300) == greedy).all()  # tiny: greedy
    for seed in range(3):  # top-k 1 is greedy at any temperature: no ties made by scaling
        assert (sample_chorale(model, 3, temperature=1e38, top_k=1, seed=seed) == greedy).all()
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="temperature"):
            sample_chorale(model, 2, temperature=bad)
    with pytest.raises(ValueError, match="num_steps"):
        sample_chorale(model, -3)


def test_generate_samples_several_seeds_and_their_statistics(run, tiny_data, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)  # the shared run keeps no samples (test_generate_refuses)
    g = ["generate", "--run-dir", str(copy), "--length", "6", "--seed", "5", "--no-progress"]
    assert main([*g, "--samples", "3", "--prime-steps", "4", "--stats", "test"]) == 0
    printed = capsys.readouterr().out
    folder = copy / "samples"
    seeds = [5, 6, 7]
    assert sorted(p.name for p in folder.glob("*.mid")) == [f"sample-seed{s}.mid" for s in seeds]
    for s in seeds:
        assert (folder / f"sample-seed{s}.musicxml").is_file()
        assert (folder / f"sample-seed{s}.png").is_file()
    # The same chorales again, from the same checkpoint, prime and seeds: they are the ones written.
    model, *_ = load_model(copy, "best")
    real = load_chorales(tiny_data).split("test")
    full = [sample_chorale(model, 6, seed=s, prime=real[0][:4]) for s in seeds]
    for s, chorale in zip(seeds, full, strict=True):
        write_midi(chorale, tmp_path / "again.mid", tempo_bpm=80)
        assert (tmp_path / "again.mid").read_bytes() == (
            folder / f"sample-seed{s}.mid"
        ).read_bytes()
    expected = compare_chorales(full, real, skip=4)  # the primed prefix is not the model's
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["split"] == "test" and stats["prime_steps"] == 4 and stats["prime_excluded"]
    assert stats["real_chorales"] == len(real) == 2
    assert stats["generated"]["steps"] == 3 * 6
    for side in ("generated", "real"):
        assert stats[side] == pytest.approx(expected[side]), side
    assert stats["pitch_class_distance"] == pytest.approx(expected["pitch_class_distance"])
    assert [x.pop("seed") for x in stats["samples"]] == seeds
    assert stats["samples"] == [pytest.approx(chorale_statistics(c, skip=4)) for c in full]
    assert stats["midi"] == [str(folder / f"sample-seed{s}.mid") for s in seeds]
    for label in ("out of range", "voice crossings", "parallel fifths", "parallel octaves"):
        assert re.search(rf"{label} +[0-9.]+ +[0-9.]+", printed), printed
    assert f"{expected['pitch_class_distance']:.3f}" in printed
    assert "4 primed steps of each excluded" in printed

    # With --out, the statistics go beside it; unprimed, every sampled step counts.
    out = tmp_path / "one" / "a.mid"
    assert main([*g, "--out", str(out), "--stats", "valid"]) == 0
    stats = json.loads(out.with_name("a.stats.json").read_text())
    valid = load_chorales(tiny_data).split("valid")
    expected = compare_chorales([sample_chorale(model, 6, seed=5)], valid)
    assert stats["prime_steps"] == 0 and stats["generated"]["steps"] == 6
    assert stats["real"] == pytest.approx(expected["real"])
    assert stats["generated"] == pytest.approx(expected["generated"])
    assert stats["pitch_class_distance"] == pytest.approx(expected["pitch_class_distance"])


def test_generate_refuses_bad_samples_and_stats(run, tiny_data, tmp_path, capsys):
    g = ["generate", "--run-dir", str(run), "--no-progress"]
    refused(capsys, [*g, "--samples", "0"], "argument --samples", ">= 1", "got 0")
    refused(capsys, [*g, "--samples", "two"], "argument --samples", "integer")
    refused(
        capsys, [*g, "--stats", "nosuchsplit"], "argument --stats", "'nosuchsplit'", "train, valid"
    )
    out = ["--out", str(tmp_path / "a.mid")]
    refused(capsys, [*g, "--samples", "2", *out], "--out", "--samples 2")
    refused(capsys, [*g, "--samples", "2", "--seed", str(commands.MAX_SEED)], "--samples", "seed")
    (tmp_path / "a.stats.json").mkdir()
    refused(capsys, [*g, *out, "--stats", "test"], "--stats", "is a folder")
    # A run whose data has an empty test split: nothing to compare with.
    empty = tmp_path / "empty.json"
    data = json.loads(Path(tiny_data).read_text())
    empty.write_text(json.dumps({**data, "test": []}))
    state = load_checkpoint(run / "best.pt")
    state["config"]["data"] = str(empty)
    checkpoint = save_checkpoint(tmp_path / "empty.pt", state)
    c = ["--checkpoint", str(checkpoint)]
    refused(capsys, [*g, *c, "--stats", "test"], "--stats test", "no chorales", "empty.json")
    assert not (run / "samples").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.stats.json", "empty.json", "empty.pt"]


# ----------------------------------------------------------------------------- other commands


def test_bench_layouts(tmp_path, capsys):
    """``relpos bench --layout``: padded rows (a quarter left padding), packed rows (four
    documents); the baseline stays plain."""
    from relpos.cli import bench

    padded = bench.layout_positions("padded", 2, 16, "cpu")
    assert padded.valid.sum(1).tolist() == [12, 12] and not padded.valid[:, :4].any()
    packed = bench.layout_positions("packed", 2, 16, "cpu")
    assert packed.seg[0].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert packed.pos[0, 4:8].tolist() == [0, 1, 2, 3]  # each document from 0
    out = tmp_path / "b"
    argv = ["--lengths", "32", "--batch", "2", "--schemes", "kerple", "--impls", "sdpa,chunked"]
    argv += ["--layout", "packed", "--repeats", "5", "--warmup", "1", "--no-memory", "--no-plot"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    table = (out / "bench.md").read_text()
    assert "| kerple | chunked | 32 | 2 | causal, packed |" in table
    assert "| none | sdpa-plain | 32 | 2 | causal |" in table
    capsys.readouterr()


def test_bench_tokens_fix_the_batch_times_length(tmp_path, capsys):
    """``--tokens N``: each length L runs with B = N // L; refused beside --batch or below L."""
    from relpos.cli import bench

    argv = ["--schemes", "alibi", "--impls", "sdpa", "--repeats", "5", "--warmup", "1"]
    argv += ["--no-memory", "--no-plot", "--out", str(tmp_path)]
    assert bench.main([*argv, "--lengths", "16,32", "--tokens", "64"]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert {(r["config"]["L"], r["config"]["B"]) for r in rows} == {(16, 4), (32, 2)}
    assert all(r["first_s"] is not None for r in rows)  # the first call, timed
    capsys.readouterr()
    for bad, what in ((["--tokens", "64", "--batch", "2"], "not both"), (["--tokens", "8"], "32")):
        refused(capsys, ["bench", *argv, "--lengths", "16,32", *bad], "--tokens", what)


def test_python_m_bench_checks_its_options_as_relpos_bench_does(tmp_path):
    """``python -m relpos.cli.bench`` (benchmarks/gpu_check.sh's form) refuses a bad option in one
    line naming it, status 2, as ``relpos bench``: the checks live in ``bench.main``."""
    import subprocess

    from relpos.cli import bench
    from relpos.cli.checks import CLIError

    for bad, expected in (
        (["--heads", "0"], "relpos bench: error: --heads: expected an integer >= 1, got 0"),
        (["--device", "bogus"], "relpos bench: error: --device: expected cpu, cuda, cuda:N or "),
    ):
        cmd = [sys.executable, "-m", "relpos.cli.bench", *bad, "--out", str(tmp_path / "b")]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(expected) and len(done.stderr.splitlines()) == 1, done.stderr
    with pytest.raises(CLIError, match="--head-dim: expected an integer >= 1, got 0"):
        bench.main(["--head-dim", "0", "--out", str(tmp_path / "b")])
    assert not (tmp_path / "b").exists()


def test_bench_says_what_it_cannot_run_and_why(tmp_path, capsys):
    """A requested (scheme, impl) the library refuses here is a "skipped: <reason>" line, printed
    and in bench.md, with the library's own reason; where nothing requested runs, --impls is
    refused instead of a table of the baseline alone."""
    argv = ["bench", "--lengths", "16", "--device", "cpu", "--repeats", "5", "--warmup", "1"]
    argv += ["--no-memory", "--no-plot", "--out", str(tmp_path)]
    assert main([*argv, "--schemes", "alibi,cope", "--impls", "chunked"]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "skipped:" in line]
    assert len(skipped) == 1 and skipped[0].startswith("cope   chunked"), out
    assert "cannot add the key bias of scheme CoPE" in skipped[0]
    table = (tmp_path / "bench.md").read_text()
    assert "| alibi | chunked | 16 | 1 | causal |" in table
    assert "* cope / chunked, causal: skipped: the chunked backend cannot add the key bias" in table
    # Refused before anything runs: the folder keeps the tables of the run above.
    for bad, reason in (
        (["--schemes", "alibi", "--impls", "flex"], "flex for alibi .causal.: the flex backend"),
        (["--schemes", "cope", "--impls", "chunked"], "cannot add the key bias of scheme CoPE"),
        (["--schemes", "shaw", "--impls", "naive-shaw", "--layout", "padded"], "--layout plain"),
        (["--schemes", "cope", "--impls", "eager", "--mask", "bidirectional"], "causal only"),
    ):
        refused(
            capsys, [*argv, *bad], r"^relpos bench: error: --impls \S+: none of them runs", reason
        )
    assert (tmp_path / "bench.md").read_text() == table
    # Not asked for: the default --impls print one line; bench.md still lists each with its reason.
    assert main([*argv, "--schemes", "cope"]) == 0
    out = capsys.readouterr().out
    assert "skipped:" not in out and "pairs cannot run here: bench.md lists them" in out, out
    assert "* cope / chunked, causal: skipped:" in (tmp_path / "bench.md").read_text()


def test_bench_records_the_command_as_typed(tmp_path, monkeypatch, capsys):
    """``relpos bench`` with no options records "relpos bench", not "relpos bench bench"."""
    from relpos.cli import bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["relpos", "bench"])
    monkeypatch.setattr(bench, "run", lambda args, log, on_result: [])  # nothing measured
    assert main() == 0
    header = (tmp_path / "bench-results" / "bench.md").read_text()
    assert "Command: `relpos bench`\n" in header
    argv = ["bench", "--lengths", "16", "--out", "my results"]
    assert main(argv) == 0
    assert (
        "Command: `relpos bench --lengths 16 --out 'my results'`"
        in (tmp_path / "my results" / "bench.md").read_text()
    )
    capsys.readouterr()


def test_bench_leaves_no_plot_of_an_earlier_run(tmp_path, monkeypatch, capsys):
    """The tables of a run cut short (or of --no-plot) never sit beside an older bench.png."""
    from relpos.cli import bench

    argv = ["bench", "--lengths", "16", "--schemes", "alibi", "--impls", "sdpa,chunked"]
    argv += ["--device", "cpu", "--repeats", "5", "--warmup", "1", "--no-memory"]
    argv += ["--out", str(tmp_path)]
    (tmp_path / "bench.png").write_bytes(b"an earlier run's plot")
    assert main([*argv, "--no-plot"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]

    (tmp_path / "bench.png").write_bytes(b"an earlier run's plot")
    run_one = bench._run_one
    calls = []

    def stop_at_the_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run_one(*a, **kw)

    monkeypatch.setattr(bench, "_run_one", stop_at_the_second)
    assert main(argv) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["config"]["impl"] for r in rows] == ["sdpa-plain"]
    assert "interrupted" in capsys.readouterr().err


def test_demo_bench_tour_and_no_command_refuse(tiny_data, tmp_path, capsys):
    refused(capsys, ["demo", "--steps", "0"], "argument --steps")
    refused(capsys, ["demo", "--data", str(tmp_path / "no.json")], "--data", "does not exist")
    refused(capsys, ["demo", "--run-dir", str(tiny_data)], "--run-dir", "not a folder")
    # Issue 45 item 7: the steps demo runs spoke as `relpos train:`.
    (tmp_path / "not-json.txt").write_text("a chorale\n")
    argv = ["demo", "--run-dir", str(tmp_path / "d"), "--data", str(tmp_path / "not-json.txt")]
    refused(capsys, argv, "^relpos demo: error: --data", "not valid JSON")
    refused(capsys, ["bench", "--device", "idee"], "--device", "'idee'")
    refused(capsys, ["bench", "--heads", "0"], "--heads")
    refused(capsys, ["bench", "--repeats", "2"], "--repeats")
    refused(capsys, ["bench", "--lengths", "abc"], "--lengths")
    refused(capsys, ["bench", "--out", str(tiny_data)], "--out", "not a folder")
    refused(capsys, ["bench", "--bogus"], "unrecognized arguments")
    refused(capsys, ["tour", "extra"], "unrecognized arguments: extra")
    refused(capsys, [], "required: command")
    assert main(["frob"]) == 2
    assert "invalid choice: 'frob'" in capsys.readouterr().err


def test_our_own_bugs_get_a_traceback_and_a_request_to_report(monkeypatch, capsys):
    def bug(args):
        raise RuntimeError("an internal invariant broke")

    monkeypatch.setattr(commands, "cmd_tour", bug)
    assert main(["tour"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "an internal invariant broke" in err
    assert "bug in relpos" in err and "report" in err

    def oom(args):
        raise MemoryError

    monkeypatch.setattr(commands, "cmd_tour", oom)
    refused(capsys, ["tour"], "out of memory", "--context")


# ----------------------------------------------------------------------------- O(L) memory


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "music"])
def test_auto_never_builds_a_huge_mask(name):
    """A padded batch at L = 200,000: sdpa would build a 160 GB (L, L) mask; auto takes chunked."""
    n = 200_000
    scheme = make_scheme(name, d_model=8, num_heads=2, causal=True)
    pos = Positions.from_padding_mask(torch.ones(1, n, dtype=torch.bool))
    q = torch.zeros(1, 2, 1, 4).expand(1, 2, n, 4)
    assert sdpa_mask_bytes(scheme, q, pos, pos) >= 4 * n * n
    for grad in (False, True):
        assert choose_backend(scheme, q, pos, pos, needs_grad=grad) == "chunked"


def test_the_mask_budget_boundary():
    """Below the budget the table holds (alibi, padded: sdpa); past it, chunked."""
    alibi = make_scheme("alibi", d_model=8, num_heads=2, causal=True)
    for n, expected in ((2048, "sdpa"), (4096, "chunked")):
        pos = Positions.from_padding_mask(torch.ones(1, n, dtype=torch.bool))
        q = torch.zeros(1, 2, 1, 4).expand(1, 2, n, 4)
        assert (sdpa_mask_bytes(alibi, q, pos, pos) > SDPA_MASK_BUDGET) == (n == 4096)
        assert choose_backend(alibi, q, pos, pos, needs_grad=True) == expected
    # Bidirectional, every token real: sdpa needs no mask at all, at any length.
    nope = make_scheme("nope", d_model=8, num_heads=2, causal=False)
    pos = Positions.from_padding_mask(torch.ones(1, 8192, dtype=torch.bool))
    q = torch.zeros(1, 2, 1, 4).expand(1, 2, 8192, 4)
    assert sdpa_mask_bytes(nope, q, pos, pos, causal=False) == 0
    assert choose_backend(nope, q, pos, pos, needs_grad=False, causal=False) == "sdpa"
    assert auto_mod.SDPA_MASK_BUDGET == 64 * 2**20  # documented in docs/training.md


def test_evaluation_of_a_long_sequence_never_builds_an_l_by_l_tensor():
    """One sequence of 16,384 tokens, evaluated in one window: every op's output stays O(L)."""
    n = 16_384
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=77, d_model=8, num_heads=2, num_layers=1, dropout=0.0, scheme="alibi"
    )
    model = Transformer(cfg)
    seq = np.random.default_rng(0).integers(4, 77, n + 1)
    with MaxNumel() as mode:
        nll = evaluate_nll(model, [seq], context=n)
    assert math.isfinite(nll)
    assert mode.max < n * n // 64, mode.max  # the logits (n × 77) are the largest


def test_trailing_padding_changes_no_loss():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=77, d_model=8, num_heads=2, num_layers=1, dropout=0.0)
    model = Transformer(cfg).eval()
    tokens = torch.randint(4, 77, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False
    padded = torch.cat([tokens, torch.zeros(2, 500, dtype=torch.long)], 1)
    padded_mask = torch.cat([mask, torch.zeros(2, 500, dtype=torch.bool)], 1)
    with torch.no_grad():
        loss, n = window_loss(model, tokens, mask)
        loss_padded, n_padded = window_loss(model, padded, padded_mask)
    assert n == n_padded == 11 + 8
    torch.testing.assert_close(loss, loss_padded)


# ----------------------------------------------------------------------------- the scheme study
def test_the_study_script_runs_seeds_side_by_side_and_skips_finished_runs(tiny_data, tmp_path):
    """``benchmarks/chorale_study.py --config``: every scheme × seed is a run folder with its
    evaluation; the table has each scheme's mean and spread; a run stopped before its first
    checkpoint starts over; a second call trains nothing; a call for some seeds tabulates all;
    a cell's own flags (``music-lr10``) replace the file's scheme. Three runs in all."""
    study = benchmark_script("chorale_study")
    cfg = tmp_path / "tiny.json"
    model = {"vocab_size": 77, "d_model": 16, "num_heads": 2, "num_layers": 1}
    model["scheme"] = {"name": "alibi", "heads": [1]}  # the file's own scheme: kept whole
    budget = {"context": 32, "batch_size": 2, "steps": 2, "eval_every": 1, "warmup": 1}
    # The file's data path does not exist here; --data names the copy to use instead.
    cfg.write_text(json.dumps({"model": model, "data": str(tmp_path / "gone.json"), **budget}))
    out = tmp_path / "study"
    argv = ["--config", str(cfg), "--data", str(tiny_data), "--schemes", "alibi,music-lr10"]
    argv += ["--parallel", "2", "--device", "cpu", "--out", str(out)]
    assert study.main([*argv, "--schemes", "alibi", "--seeds", "0,1"]) == 0
    stopped = out / "music-lr10-seed0"  # a run stopped before its first checkpoint starts over
    stopped.mkdir(parents=True)
    (stopped / "config.json").write_text("{}")
    (stopped / "metrics.jsonl").write_text('{"step": 1}\n')
    assert study.main([*argv, "--seeds", "0"]) == 0  # alibi-seed0 is finished: one new run
    rows = json.loads((out / "results.json").read_text())
    # A call for one seed tabulates every finished run in --out (alibi's seed 1 ran apart).
    by_scheme = {r["scheme"]: r for r in rows}  # rows are sorted by validation NLL
    assert {name: r["seeds"] for name, r in by_scheme.items()} == {"alibi": 2, "music-lr10": 1}
    valid = [
        json.loads((out / f"alibi-seed{s}" / "eval.json").read_text())["valid_nll"] for s in (0, 1)
    ]
    assert by_scheme["alibi"]["valid_nll"] == pytest.approx(sum(valid) / 2)
    assert by_scheme["alibi"]["valid_spread"] == pytest.approx(max(valid) - min(valid))
    saved = json.loads((out / "alibi-seed1" / "config.json").read_text())
    assert saved["seed"] == 1 and saved["model"]["scheme"]["heads"] == [1]
    saved = json.loads((out / "music-lr10-seed0" / "config.json").read_text())
    assert saved["position_lr_scale"] == 10.0
    assert saved["model"]["scheme"] == {"name": "music", "max_distance": 512}
    assert (out / "alibi-seed0" / "samples").is_dir()  # the first seed samples a chorale
    assert not (out / "alibi-seed1" / "samples").exists()
    assert "| alibi | 2 |" in (out / "results.md").read_text()
    assert "| music-lr10 | 1 |" in (out / "results.md").read_text()
    for bad in (["--schemes", "bogus"], ["--seeds", "x"], ["--parallel", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit) as stop:
            study.main([*argv, *bad])
        assert stop.value.code == 2
    with pytest.raises(SystemExit) as stop:
        study.main(["--schemes", "nope", "--out", str(out)])  # neither --data nor --config
    assert stop.value.code == 2
    stamp = (out / "music-lr10-seed0" / "eval.json").stat().st_mtime_ns
    (out / "results.json").unlink()
    assert study.main([*argv, "--seeds", "0"]) == 0  # everything finished: nothing runs again
    assert (out / "music-lr10-seed0" / "eval.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "results.json").read_text()) == rows
    # --table-only: the runs' config, metrics and evaluation alone (no checkpoint) give the same
    # table; the model's size comes from the evaluation.
    kept = tmp_path / "kept"
    for run in out.glob("*-seed*"):
        (kept / run.name).mkdir(parents=True)
        for name in ("config.json", "metrics.jsonl", "eval.json"):
            (kept / run.name / name).write_bytes((run / name).read_bytes())
    state = torch.load(out / "alibi-seed0" / "best.pt", weights_only=True)
    size = sum(v.numel() for v in state["model"].values())
    assert json.loads((kept / "alibi-seed0" / "eval.json").read_text())["parameters"] == size
    assert study.main(["--table-only", "--out", str(kept)]) == 0
    assert json.loads((kept / "results.json").read_text()) == rows
    assert (kept / "valid_curves.png").stat().st_size > 0
    # An evaluation from before the size was recorded: the size of the model its config builds.
    for run in kept.glob("*-seed*"):
        result = json.loads((run / "eval.json").read_text())
        del result["parameters"]
        (run / "eval.json").write_text(json.dumps(result))
    assert study.main(["--table-only", "--out", str(kept)]) == 0
    assert json.loads((kept / "results.json").read_text()) == rows
    # One seed shows no spread; two show it.
    lines = {line.split(" | ")[0]: line for line in (kept / "results.md").read_text().splitlines()}
    assert "(" not in lines["| music-lr10"] and lines["| alibi"].count("(") == 2
    (tmp_path / "empty").mkdir()
    assert study.main(["--table-only", "--out", str(tmp_path / "empty")]) == 1
    with pytest.raises(SystemExit) as stop:
        study.main(["--table-only", "--out", str(tmp_path / "missing")])
    assert stop.value.code == 2


def test_ctrl_c_while_the_command_line_loads_is_one_line(tmp_path):
    """Issue 45 item 7: SIGINT in the first second (PyTorch loading) printed a 43-line traceback.
    A real SIGINT, sent as ``relpos.runtime`` (which loads torch) is imported by ``relpos``."""
    import subprocess

    code = (
        "import os, signal, sys\n"
        # A background job (nohup, `&`) starts with SIGINT ignored, and Python then installs no
        # handler: restore the interactive default this test is about.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'relpos.runtime':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Hook())\n"
        "from relpos.cli import main\n"
        "sys.exit(main(['tour']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "relpos: interrupted", done.stderr


def test_bench_times_flex_with_no_score_mod_where_flex_runs(monkeypatch):
    """Where ``flex`` is timed, each shape also times FlexAttention with no ``score_mod`` (scheme
    ``none``, the layout's block mask alone): the kernel family's own cost beside each scheme's.
    Not where flex does not run (its backward on a CPU) or is not asked for."""
    from relpos.cli import bench

    args = argparse.Namespace(impls=["flex", "fused"], layout="packed", device="cpu")
    args.dtype = "float32"
    assert bench._kernel_family_reference(args, 64, 2, True) == []  # CPU: no flex backward
    from relpos.attention import flex

    seen = []
    monkeypatch.setattr(flex, "flex_supports", lambda scheme, **kw: seen.append(scheme) or True)
    want = bench.Config("none", "flex", 64, 2, True, "packed")
    assert bench._kernel_family_reference(args, 64, 2, True) == [want]
    assert [type(s).__name__ for s in seen] == ["NoPE"]  # no score_mod: no logit hook
    args.impls = ["fused"]
    assert bench._kernel_family_reference(args, 64, 2, True) == []
