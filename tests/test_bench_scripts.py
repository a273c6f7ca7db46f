"""The scripts in benchmarks/ refuse a bad argument in argparse's way (status 2, naming the flag)
before any work, and answer ``--help``. Each is loaded as a module and its ``main`` called with
arguments that are refused (or ``--help``): nothing is measured or trained."""

from __future__ import annotations

import pytest

from tests.helpers import benchmark_script


def exits(main, argv: list[str], capsys, status: int = 2) -> str:
    """Run ``main(argv)``; assert it exits with ``status``; its stderr (stdout for status 0)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == status
    out = capsys.readouterr()
    return out.out if status == 0 else out.err


def test_flex_kernel_options_has_a_help_and_checks_its_scheme(capsys):
    flex_kernel_options = benchmark_script("flex_kernel_options")
    text = exits(flex_kernel_options.main, ["--help"], capsys, status=0)
    assert "FlexAttention block sizes" in text and "SCHEME" in text
    err = exits(flex_kernel_options.main, ["bogus"], capsys)
    assert "invalid choice: 'bogus'" in err


def test_band_engines_refuses_bad_counts_and_unknown_cases(capsys):
    band_engines = benchmark_script("band_engines")
    for flag in ("--repeats", "--length", "--batch"):
        err = exits(band_engines.main, [flag, "0"], capsys)
        assert f"argument {flag}: expected an integer >= 1, got 0" in err
    err = exits(band_engines.main, ["--cases", "zzz"], capsys)
    assert "--cases: no case name starts with 'zzz'" in err and "'t5 causal'" in err


def test_chorale_study_names_the_flag_it_refuses(tmp_path, capsys):
    study = benchmark_script("chorale_study")
    argv = ["--data", str(tmp_path / "data.json"), "--out", str(tmp_path / "out")]
    for flag in ("--parallel", "--threads", "--steps"):
        err = exits(study.main, [*argv, flag, "0"], capsys)
        assert f"argument {flag}: expected an integer >= 1, got 0" in err
    err = exits(study.main, [*argv, "--seeds", ","], capsys)
    assert "--seeds: expected at least one seed" in err
    # --steps sets the demo model's budget; a config's own steps count, so it is refused beside it.
    config = ["--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "out")]
    err = exits(study.main, [*config, "--steps", "50"], capsys)
    assert "--steps 50 with --config" in err
    assert "refused beside it" in exits(study.main, ["--help"], capsys, status=0)
    assert not (tmp_path / "out").exists()
