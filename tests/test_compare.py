"""``relpos compare``: the synthetic tasks' data, the grid's resume, bad input, a tiny run.

Every run here is a tiny model for a few steps (seconds in all); the defaults' cost is measured
in ``docs/compare.md``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from relpos.atomic import stale_temporaries
from relpos.attention.flex import flex_available
from relpos.cli import main
from relpos.studies import compare, report, synthetic
from relpos.studies.spec import DEFAULT_SCHEMES, default_spec, parse_scheme, scheme_label
from relpos.studies.tasks import (
    BOS,
    DIGIT0,
    EOS,
    MAX_COUNT,
    PLUS,
    SEP,
    add_digits,
    digits_of,
    held_out_examples,
    make_example,
    sample_batch,
    sequence_length,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# A model and budget small enough for a whole comparison in about a second per cell.
TINY = [
    *("--d-model", "8", "--num-heads", "2", "--num-layers", "1", "--steps", "3"),
    *("--batch-size", "4", "--warmup", "1", "--test-examples", "3"),
    *("--train-length", "3", "--test-lengths", "3,6"),
    "--no-progress",
]


def tiny_spec(**changes):
    fields = dict(
        d_model=8,
        num_heads=2,
        num_layers=1,
        steps=3,
        batch_size=4,
        warmup=1,
        test_examples=3,
        train_length=3,
        test_lengths=(3, 6),
    )
    fields.update(changes)
    return default_spec("copy", **fields)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: contents and modification time (ns)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ----------------------------------------------------------------------------- task data


def split(example) -> tuple[list[int], list[int]]:
    """The input and target digits of an example, checking its framing."""
    p, t = example.prompt, example.target
    assert p[0] == BOS and p[-1] == SEP and t[-1] == EOS
    assert BOS not in p[1:] and SEP not in p[:-1] and EOS not in t[:-1]
    return digits_of(p), digits_of(t)


@pytest.mark.parametrize("length", [1, 2, 7, 30])
def test_copy_reverse_and_sort_targets(length):
    rng = np.random.default_rng(length)
    for _ in range(20):
        x, y = split(make_example("copy", length, rng))
        assert len(x) == length and y == x
        x, y = split(make_example("reverse", length, rng))
        assert len(x) == length and y == x[::-1]
        x, y = split(make_example("sort", length, rng))
        assert len(x) == length and y == sorted(x)


def as_number(digits: list[int]) -> int:
    """A number written least significant digit first."""
    return sum(d * 10**i for i, d in enumerate(digits))


@pytest.mark.parametrize("length", [1, 3, 12])
def test_add_targets_are_the_sums_least_significant_digit_first(length):
    rng = np.random.default_rng(length)
    for _ in range(50):
        e = make_example("add", length, rng)
        x, y = split(e)
        assert list(e.prompt).count(PLUS) == 1 and e.prompt[1 + length] == PLUS
        a, b = x[:length], x[length:]
        assert len(a) == len(b) == length and len(y) == length + 1
        assert as_number(y) == as_number(a) + as_number(b)
    # By hand: 95 + 17 = 112 and 99 + 1 = 100, least significant digit first.
    assert add_digits(np.array([5, 9]), np.array([7, 1])).tolist() == [2, 1, 1]
    assert add_digits(np.array([9, 9]), np.array([1, 0])).tolist() == [0, 0, 1]


@pytest.mark.parametrize("length", [1, 5, 64, 128])
def test_count_writes_every_number_from_the_first_to_the_last(length):
    rng = np.random.default_rng(length)
    for _ in range(20):
        (a, b), y = split(make_example("count", length, rng))
        assert b - a + 1 == length and y == list(range(a, b + 1))
        assert 0 <= a and b < MAX_COUNT
    with pytest.raises(ValueError, match="at most 128"):
        make_example("count", 129, rng)


@pytest.mark.parametrize("task", ["copy", "reverse", "sort", "count", "add"])
def test_batches_hold_lengths_in_range_and_mask_only_the_targets(task):
    batch = sample_batch(task, 64, 9, np.random.default_rng(0), shortest=4)
    assert batch.lengths.min() >= 4 and batch.lengths.max() <= 9
    assert len(set(batch.lengths.tolist())) > 3  # lengths vary
    for row, mask, loss, n in zip(
        batch.tokens, batch.mask, batch.loss_mask, batch.lengths, strict=True
    ):
        total = sequence_length(task, int(n))
        assert mask.sum() == total and mask[:total].all()
        sep = int(np.flatnonzero(row == SEP)[0])
        # Targets (tokens[1:]) are every token after SEP up to EOS: y and EOS, nothing else.
        assert np.flatnonzero(loss).tolist() == list(range(sep, total - 1))
        assert row[total - 1] == EOS


@pytest.mark.parametrize("task", ["copy", "reverse", "sort", "count", "add"])
def test_data_is_a_function_of_the_seed(task):
    one = sample_batch(task, 16, 8, np.random.default_rng([3, 7]))
    two = sample_batch(task, 16, 8, np.random.default_rng([3, 7]))
    other = sample_batch(task, 16, 8, np.random.default_rng([4, 7]))
    assert np.array_equal(one.tokens, two.tokens)
    assert not np.array_equal(one.tokens, other.tokens)
    test = held_out_examples(task, 11, 5, seed=1)
    again = held_out_examples(task, 11, 5, seed=1)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(test, again, strict=True))
    assert all(len(e.tokens) == sequence_length(task, 11) for e in test)


def test_unknown_task_and_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="unknown task 'counting'"):
        make_example("counting", 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="length"):
        make_example("copy", 0, np.random.default_rng(0))


# ----------------------------------------------------------------------------- training, testing


def test_an_interrupted_cell_resumes_to_the_same_weights(tmp_path):
    spec = tiny_spec(steps=6)
    cfg = compare.cell_config(spec, {"name": "rope"}, seed=0)
    whole, _ = synthetic.train_synthetic(cfg, "copy", 3, tmp_path / "a.pt", save_every=100)
    _, info = synthetic.train_synthetic(cfg, "copy", 3, tmp_path / "b.pt", stop_after=4)
    assert not info["finished"] and info["steps"] == 4
    resumed, info = synthetic.train_synthetic(cfg, "copy", 3, tmp_path / "b.pt")
    assert info["finished"] and info["steps"] == 6
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_greedy_decoding_writes_what_the_model_predicts():
    """A model that always predicts digit 7 writes 7s; exact match needs every token and EOS."""
    spec = tiny_spec()
    cfg = compare.cell_config(spec, {"name": "alibi"}, seed=0)
    model = synthetic.Transformer(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.head.weight[DIGIT0 + 7].fill_(1.0)
        model.ln_f.bias.fill_(1.0)
    out = synthetic.decode_greedy(model, np.array([[BOS, DIGIT0, SEP]]), 4)
    assert out.tolist() == [[DIGIT0 + 7] * 4]
    result = synthetic.exact_match(model, "copy", [3], examples=5, seed=0)
    assert result[3]["exact_match"] == 0.0  # no target ends without EOS
    assert 0.0 <= result[3]["token_accuracy"] < 1.0


def test_a_learned_table_past_its_length_is_reported_not_run():
    spec = tiny_spec(test_lengths=(3, 6, 40))
    cfg = compare.cell_config(spec, {"name": "learned", "max_len": 20}, seed=0)
    model = synthetic.Transformer(cfg.model)
    result = synthetic.exact_match(model, "copy", [3, 6, 40], examples=2, seed=0)
    assert result[6]["exact_match"] is not None
    assert result[40]["exact_match"] is None and "learned table holds 20" in result[40]["note"]


# ----------------------------------------------------------------------------- the grid


def count_training(monkeypatch) -> list[str]:
    """Record every cell the trainer runs (by its scheme), still training for real."""
    calls: list[str] = []
    real = synthetic.train_synthetic

    def counted(cfg, *args, **kwargs):
        calls.append(cfg.model.scheme["name"])
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(synthetic, "train_synthetic", counted)
    return calls


def test_a_rerun_skips_finished_cells(tmp_path, monkeypatch):
    calls = count_training(monkeypatch)
    run = tmp_path / "cmp"
    quiet = {"progress": False, "log": lambda line: None}
    first = compare.run_compare(tiny_spec(), ["rope", "nope"], [0], run, **quiet)
    assert calls == ["rope", "nope"] and first["ran"] == 2
    cells = {p: v for p, v in snapshot(run).items() if p.startswith("cells/")}
    again = compare.run_compare(tiny_spec(), ["rope", "nope"], [0], run, **quiet)
    assert calls == ["rope", "nope"] and again["ran"] == 0 and again["skipped"] == 2
    assert {p: v for p, v in snapshot(run).items() if p.startswith("cells/")} == cells
    # Another scheme and another seed run only the new cells; the table holds all of them.
    compare.run_compare(tiny_spec(), ["nope", "alibi"], [0, 1], run, **quiet)
    assert calls == ["rope", "nope", "alibi", "nope", "alibi"]
    results = json.loads((run / "results.json").read_text())
    assert results["schemes"] == ["rope", "nope", "alibi"] and results["seeds"] == [0, 1]
    assert len(results["cells"]) == 5
    assert results["summary"]["nope"]["3"]["n"] == 2


def test_a_cell_killed_mid_training_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "cmp"
    spec = tiny_spec(steps=5)
    real = synthetic.train_synthetic
    steps_run: list[int] = []

    def killed(cfg, *args, **kwargs):  # dies after 3 steps with last.pt at step 2
        kwargs["save_every"] = 2

        def on_step(step, loss):
            steps_run.append(step)
            if step == 3:
                raise KeyboardInterrupt

        kwargs["on_step"] = on_step
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(synthetic, "train_synthetic", killed)
    with pytest.raises(KeyboardInterrupt):
        compare.run_compare(spec, ["rope"], [0], run, progress=False, log=lambda s: None)
    assert not (run / "cells" / "rope-seed0" / "result.json").exists()
    monkeypatch.setattr(synthetic, "train_synthetic", real)
    lines: list[str] = []
    compare.run_compare(spec, ["rope"], [0], run, progress=False, log=lines.append)
    assert "resuming" in lines[0]
    state = torch.load(run / "cells" / "rope-seed0" / "last.pt", weights_only=True)
    assert state["step"] == 5
    assert (run / "cells" / "rope-seed0" / "result.json").is_file()


# ----------------------------------------------------------------------------- command line


def refused(capsys, argv: list[str], *patterns: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("relpos compare: error:"), err
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    return lines[0]


def test_a_tiny_comparison_writes_its_table_results_and_plot(tmp_path, capsys):
    run = tmp_path / "cmp"
    argv = ["compare", "--task", "reverse", "--schemes", "t5,learned:max_len=12"]
    assert main([*argv, "--run-dir", str(run), *TINY]) == 0
    out = capsys.readouterr().out
    for name in ("table.md", "results.json", "curves.png", "compare.json"):
        assert (run / name).is_file(), name
    assert not stale_temporaries(run, ["table.md", "results.json", "curves.png", "compare.json"])
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (run / "table.md").read_text()
    assert table in out
    assert re.search(r"\| t5 \| \d+ \| \d+ \|", table), table
    # The learned table holds 12 positions: length 6 needs 14, reported as n/a with a note.
    assert re.search(r"\| learned:max_len=12 \| \d+ \| n/a \|", table), table
    assert "needs 14 positions; the learned table holds 12" in table
    results = json.loads((run / "results.json").read_text())
    assert results["metric"] == "exact_match" and results["schemes"] == ["t5", "learned:max_len=12"]
    assert results["summary"]["learned:max_len=12"]["6"]["mean"] is None
    assert "relpos compare --task reverse" in results["command"]


def test_the_plot_is_written_atomically(tmp_path, monkeypatch):
    run = tmp_path / "cmp"
    compare.run_compare(tiny_spec(), ["nope"], [0], run, progress=False, log=lambda s: None)
    before = (run / "curves.png").read_bytes()
    import matplotlib.figure

    def broken(self, fname, **kwargs):
        Path(fname).write_bytes(b"half a png")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        report.write_report(run, tiny_spec(), ["nope"], [0], [])
    assert (run / "curves.png").read_bytes() == before
    assert not stale_temporaries(run, ["curves.png"])


BAD = [
    (["--task", "counting"], ["--task", "unknown task 'counting'", "copy, reverse, sort, count"]),
    (["--task", "count", "--test-lengths", "3,200"], ["--test-lengths", "at most 128"]),
    (["--task", "copy", "--schemes", "rope,relative"], ["--schemes", "unknown scheme"]),
    (["--task", "copy", "--schemes", "rope:theta=x"], ["--schemes"]),
    (["--task", "copy", "--schemes", "rope,rope"], ["--schemes", "more than once"]),
    # Issue 45 item 6: an empty value (an unset shell variable) ran the whole default study.
    (["--task", "copy", "--schemes", ""], ["--schemes: expected at least one scheme", "got ''"]),
    (["--task", "copy", "--schemes", " , "], ["--schemes: expected at least one", "got ' , '"]),
    (["--task", "copy", "--test-lengths", "2,6"], ["--test-lengths", r"\[2\] are shorter", "3"]),
    (["--task", "copy", "--test-lengths", "3,x"], ["--test-lengths", "integers"]),
    (["--task", "copy", "--seeds", "-1"], ["--seeds", ">= 0"]),
    (["--task", "copy", "--data", "music21"], ["--data", "does not read it"]),
    (["--task", "copy", "--steps", "0"], ["--steps", ">= 1"]),
    (["--task", "copy", "--lr", "nan"], ["--lr", "finite"]),
    (["--task", "copy", "--schemes", "learned:max_len=4"], ["--schemes", "max_len"]),
    # An explicit warm-up longer than the run: the learning rate would never reach --lr.
    (
        ["--task", "copy", "--steps", "3", "--warmup", "5"],
        ["--warmup/--steps", r"warmup \(5\) is longer than steps \(3\)", "never reach lr"],
    ),
    # Settings whose model cannot be built or that the backend cannot train: refused before
    # compare.json and cells/ are written (they crashed in the first cell), naming the flag.
    pytest.param(
        ["--task", "copy", "--schemes", "rope", "--backend", "flex"],
        ["--backend: flex cannot train rope", "flex backend does not support gradients"],
        marks=pytest.mark.skipif(not flex_available(), reason="no FlexAttention"),
        id="--backend flex (gradients on the CPU)",
    ),
    (
        ["--task", "copy", "--schemes", "shaw", "--backend", "sdpa"],
        ["--backend: sdpa cannot train shaw", "cannot add the value term of scheme ShawRelative"],
    ),
    (
        ["--task", "copy", "--schemes", "cope", "--backend", "chunked"],
        ["--backend: chunked cannot train cope", "cannot add the key bias of scheme CoPE"],
    ),
    (
        ["--task", "copy", "--schemes", "nope,alibi:heads=[7]"],
        [r"--schemes: alibi:heads=\[7\] cannot be built", "head 7 is out of range"],
    ),
    (
        ["--task", "copy", "--schemes", "rope:rotary_dim=64"],
        ["--schemes: rope:rotary_dim=64 cannot be built", "rotary_dim must be even"],
    ),
    (
        ["--task", "copy", "--schemes", "rope", "--d-model", "6", "--num-heads", "2"],
        ["--d-model/--num-heads: rope", "d_model 6 and num_heads 2", "rotary_dim"],
    ),
    (
        ["--task", "copy", "--schemes", "sinusoidal", "--d-model", "9", "--num-heads", "3"],
        ["--d-model/--num-heads: sinusoidal", "even d_model, got 9"],
    ),
]


def without(flags: list[str], names: list[str]) -> list[str]:
    """``flags`` less the options named in ``names`` (with their values)."""
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
        elif f in names:
            skip = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        else:
            out.append(f)
    return out


@pytest.mark.parametrize(
    ("extra", "patterns"),
    BAD,
    ids=[b.id if hasattr(b, "id") else " ".join(b[0]) for b in BAD],
)
def test_bad_input_is_refused_with_nothing_written(tmp_path, capsys, extra, patterns):
    run = tmp_path / "cmp"
    flags = without(TINY, [f for f in extra if f.startswith("--")])
    refused(capsys, ["compare", *extra, "--run-dir", str(run), *flags], *patterns)
    assert not run.exists()


def test_a_scheme_s_json_values_keep_their_commas_and_colons(tmp_path, capsys):
    """A field's JSON value may hold commas and colons (a list of heads, RoPE's scaling dict):
    ``--schemes`` splits schemes and fields outside brackets, braces and quotes only, and the
    label a scheme is tabulated under parses back to it."""
    scaling = 'rope:scaling={"rope_type":"linear","factor":2.0}'
    assert parse_scheme(scaling) == {
        "name": "rope",
        "scaling": {"rope_type": "linear", "factor": 2.0},
    }
    heads = parse_scheme("alibi:heads=[0,1]")
    assert heads == {"name": "alibi", "heads": [0, 1]}
    for scheme in (heads, parse_scheme(scaling)):
        assert parse_scheme(scheme_label(scheme)) == scheme
    run = tmp_path / "cmp"
    argv = ["compare", "--task", "reverse", "--schemes", f"alibi:heads=[0,1],{scaling}"]
    assert main([*argv, "--run-dir", str(run), *TINY]) == 0
    results = json.loads((run / "results.json").read_text())
    assert results["schemes"] == [scheme_label(heads), scheme_label(parse_scheme(scaling))]


def test_a_default_test_length_past_the_task_names_the_train_length(tmp_path, capsys):
    """count makes numbers up to 128: --train-length 40 gives default test lengths up to 160,
    which the user never set; the error names the flag they did set."""
    run = tmp_path / "cmp"
    flags = without(TINY, ["--train-length", "--test-lengths"])
    line = refused(
        capsys,
        ["compare", "--task", "count", "--train-length", "40", "--run-dir", str(run), *flags],
        "^relpos compare: error: --train-length: ",
        "default test lengths 40, 50, 60, 80, 120, 160",
        "at most 128, got 160",
    )
    assert "--test-lengths" not in line
    assert not run.exists()


def test_the_default_warmup_is_capped_at_the_steps():
    assert default_spec("copy").warmup == 100
    assert default_spec("copy", steps=500).warmup == 100
    assert default_spec("copy", steps=3).warmup == 3  # a quick run reaches lr at its last step
    assert default_spec("chorales-extrapolate", steps=20).warmup == 20
    assert default_spec("copy", steps=3, warmup=0).warmup == 0
    with pytest.raises(ValueError, match=r"warmup \(5\) is longer than steps \(3\)"):
        default_spec("copy", steps=3, warmup=5)


def test_unrunnable_schemes_are_refused_by_prepare_with_nothing_written(tmp_path):
    run = tmp_path / "cmp"
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"^backend: sdpa cannot train shaw"):
        compare.prepare(run, tiny_spec(backend="sdpa"), ["nope", "shaw"], [0])
    with pytest.raises(ValueError, match=r"^d_model/num_heads: rope"):
        compare.prepare(run, tiny_spec(d_model=6), ["rope"], [0])
    with pytest.raises(ValueError, match=r"^schemes: alibi:heads=\[7\]"):
        compare.prepare(run, tiny_spec(), ["alibi:heads=[7]"], [0])
    assert not run.exists()
    # Building the models did not move the random state.
    assert torch.equal(torch.get_rng_state(), state)
    # Every scheme the backends can train passes (auto picks a backend that can).
    compare.prepare(run, tiny_spec(), [*DEFAULT_SCHEMES, "cope"], [0])
    compare.prepare(run, tiny_spec(backend="chunked"), ["shaw", "alibi"], [0])
    assert not run.exists()


def test_the_backend_is_asked_about_the_device_the_cells_train_on(monkeypatch):
    """A chorale cell trains on CUDA where there is one: flex trains there (without attention
    dropout), so it is refused only where the cells would train on the CPU."""
    assert compare.cell_device(tiny_spec()).type == "cpu"
    if not flex_available():
        pytest.skip("no FlexAttention")
    spec = tiny_spec(backend="flex")
    with pytest.raises(ValueError, match=r"on cpu.*does not support gradients"):
        compare.check_cell(spec, {"name": "alibi"})
    monkeypatch.setattr(compare, "cell_device", lambda spec: torch.device("cuda"))
    compare.check_cell(spec, {"name": "alibi"})
    with pytest.raises(ValueError, match=r"^backend: flex cannot train alibi .*on cuda"):
        compare.check_cell(tiny_spec(backend="flex", dropout=0.1), {"name": "alibi"})
    with pytest.raises(ValueError, match=r"^backend: flex cannot train shaw"):
        compare.check_cell(spec, {"name": "shaw"})


def test_a_folder_with_cells_to_run_says_so_and_records_its_whole_command(tmp_path, capsys):
    """A rerun that adds a scheme with another seed: each row holds one of the folder's two
    seeds, marked; the cells missing are listed; the recorded command runs all of them."""
    run = tmp_path / "cmp"
    flags = [*without(TINY, ["--warmup"]), "--run-dir", str(run)]  # the default warm-up, capped
    assert main(["compare", "--task", "copy", "--schemes", "rope", *flags]) == 0
    assert main(["compare", "--task", "copy", "--schemes", "nope", "--seeds", "1", *flags]) == 0
    capsys.readouterr()
    table = (run / "table.md").read_text()
    assert re.search(r"^\| rope \| \d+ \[1/2 seeds\] \| \d+ \[1/2 seeds\] \|$", table, re.M), table
    assert re.search(r"^\| nope \| \d+ \[1/2 seeds\] \| \d+ \[1/2 seeds\] \|$", table, re.M), table
    assert "- not finished yet: rope (seed 1), nope (seed 0)" in table
    assert "2 of 4 cell(s) finished" in table
    results = json.loads((run / "results.json").read_text())
    assert results["not_finished"] == [{"scheme": "rope", "seed": 1}, {"scheme": "nope", "seed": 0}]
    assert results["summary"]["rope"]["3"]["seeds"] == 2
    command = results["command"]
    assert "--schemes rope,nope --seeds 0,1" in command and command in table
    assert "--warmup" not in command  # the default, capped at --steps 3
    # The recorded command fills in the missing cells: the whole table, nothing marked.
    argv = shlex.split(command)
    assert argv[:2] == ["relpos", "compare"]
    assert main([*argv[1:], "--no-progress"]) == 0
    table = (run / "table.md").read_text()
    assert "seeds]" not in table and "not finished" not in table and "4 of 4 cell" in table
    assert json.loads((run / "results.json").read_text())["not_finished"] == []


def test_a_folder_of_another_comparison_is_refused_and_kept(tmp_path, capsys):
    run = tmp_path / "cmp"
    argv = ["compare", "--task", "copy", "--schemes", "nope", "--run-dir", str(run)]
    assert main([*argv, *TINY]) == 0
    capsys.readouterr()
    before = snapshot(run)
    refused(capsys, [*argv, *TINY, "--steps", "4"], "--run-dir", "another comparison", "steps: 3")
    refused(capsys, ["compare", "--task", "sort", *argv[3:], *TINY], "--run-dir", "task: 'copy'")
    assert snapshot(run) == before
    # A folder that holds something else (a training run) is not a comparison's.
    other = tmp_path / "train-run"
    other.mkdir()
    (other / "config.json").write_text("{}")
    refused(capsys, ["compare", "--task", "copy", "--run-dir", str(other), *TINY], "not empty")
    assert [p.name for p in other.iterdir()] == ["config.json"]


def test_the_default_comparison_is_the_eight_classic_schemes():
    assert DEFAULT_SCHEMES == (
        "music",
        "shaw",
        "t5",
        "alibi",
        "rope",
        "learned",
        "sinusoidal",
        "nope",
    )
    spec = default_spec("copy")
    assert spec.test_lengths == (16, 20, 24, 32, 48, 64) and spec.train_length == 16
    assert default_spec("chorales-extrapolate").test_lengths == (64, 128, 256, 512)


# ----------------------------------------------------------------------------- chorales


def chorale(rng: np.random.Generator, steps: int) -> list[list[int]]:
    centre = np.array([67, 60, 55, 48])
    walk = np.cumsum(rng.integers(-2, 3, size=(steps, 4)), axis=0).clip(-5, 5)
    return (centre + walk).tolist()


def tiny_chorales(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    data = {
        split: [chorale(rng, int(rng.integers(24, 40))) for _ in range(k)]
        for split, k in (("train", 4), ("valid", 2), ("test", 2))
    }
    path = folder / "tiny.json"
    path.write_text(json.dumps(data))
    return path


def test_chorales_extrapolate_scores_longer_windows(tmp_path, capsys):
    path = tiny_chorales(tmp_path)
    run = tmp_path / "cmp"
    argv = ["compare", "--task", "chorales-extrapolate", "--schemes", "alibi,learned:max_len=40"]
    flags = ["--d-model", "8", "--num-heads", "2", "--num-layers", "1", "--steps", "2"]
    flags += ["--batch-size", "2", "--warmup", "1", "--eval-every", "1", "--no-progress"]
    flags += ["--train-length", "16", "--data", str(path), "--max-shift", "0"]
    assert main([*argv, "--run-dir", str(run), *flags]) == 0
    results = json.loads((run / "results.json").read_text())
    assert results["metric"] == "nll" and results["spec"]["test_lengths"] == [16, 32, 64, 128]
    alibi = results["summary"]["alibi"]
    assert all(alibi[str(n)]["mean"] > 0 for n in (16, 32, 64, 128))
    learned = results["summary"]["learned:max_len=40"]
    assert learned["32"]["mean"] > 0 and learned["64"]["mean"] is None
    assert "learned table holds 40" in (run / "table.md").read_text()
    # The cell is an ordinary trainer run folder.
    assert (run / "cells" / "alibi-seed0" / "best.pt").is_file()
    # A test length shorter than the training windows is refused.
    capsys.readouterr()
    refused(
        capsys,
        [*argv, "--run-dir", str(tmp_path / "other"), *flags, "--test-lengths", "8,32"],
        "--test-lengths",
    )


def test_chorale_data_in_the_wrong_format_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train": "not chorales"}))
    run = tmp_path / "cmp"
    argv = ["compare", "--task", "chorales-extrapolate", "--schemes", "nope"]
    refused(capsys, [*argv, "--run-dir", str(run), "--data", str(bad), "--no-progress"], "--data")
    refused(capsys, [*argv, "--run-dir", str(run), "--data", str(tmp_path / "none.json")], "--data")
    refused(capsys, [*argv, "--run-dir", str(run), "--test-examples", "5"], "--test-examples")
    assert not run.exists()


def test_a_chorale_file_is_kept_as_an_absolute_path(tmp_path, monkeypatch):
    """A rerun from another directory finds the same file, and the same comparison."""
    monkeypatch.chdir(tmp_path)
    spec = default_spec("chorales-extrapolate", data="chorales.json")
    assert spec.data == str(tmp_path / "chorales.json")
    assert default_spec("chorales-extrapolate").data == "music21"
    assert default_spec("chorales-extrapolate", data="jsb").data == "jsb"  # a name, not a path


def test_an_interrupted_chorale_cell_resumes_its_training_run(tmp_path, monkeypatch):
    from relpos.music import load_token_data
    from relpos.studies import extrapolate
    from relpos.training import train

    path = tiny_chorales(tmp_path)
    spec = default_spec(
        "chorales-extrapolate",
        **{"d_model": 8, "num_heads": 2, "num_layers": 1, "steps": 4, "batch_size": 2},
        **{"warmup": 1, "eval_every": 2, "train_length": 16, "data": str(path), "max_shift": 0},
    )
    data = load_token_data(str(path), max_shift=0, progress=False)
    run = tmp_path / "cmp"
    quiet = {"progress": False, "data": data}
    # The trainer stops after 3 steps, as on Ctrl-C: last.pt holds step 3, no result.
    monkeypatch.setattr(extrapolate, "train", lambda *a, **k: train(*a, **k, stop_after=3))
    lines: list[str] = []
    summary = compare.run_compare(spec, ["t5"], [0], run, log=lines.append, **quiet)
    assert summary["interrupted"] and summary["exit_status"] == 130
    cell = run / "cells" / "t5-seed0"
    assert not (cell / "result.json").exists()
    assert torch.load(cell / "last.pt", weights_only=True)["step"] == 3
    monkeypatch.setattr(extrapolate, "train", train)
    lines.clear()
    summary = compare.run_compare(spec, ["t5"], [0], run, log=lines.append, **quiet)
    assert "resuming" in lines[0] and summary["ran"] == 1
    assert torch.load(cell / "last.pt", weights_only=True)["step"] == 4
    assert json.loads((cell / "result.json").read_text())["best_step"] in (2, 4)
