"""The command line as a user meets it: help texts, one-line errors, exit codes, nothing written."""
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpmrepro.cli import main

STAGES = ["prepare", "fit-evaluator", "train", "sample", "evaluate", "report"]


def test_group_help_lists_every_stage():
    out = CliRunner().invoke(main, ["--help"]).output
    for stage in STAGES + ["info"]:
        assert stage in out


@pytest.mark.parametrize("stage", STAGES)
def test_stage_help_says_what_it_reads_and_writes(stage):
    result = CliRunner().invoke(main, [stage, "--help"])
    assert result.exit_code == 0
    assert "Reads:" in result.output and "Writes:" in result.output and "params" in result.output


@pytest.mark.parametrize("stage", STAGES)
def test_bad_params_exit_2_with_one_line_and_write_nothing(tmp_path, stage):
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  lr: fast\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ddpmrepro.cli", stage, "--params", str(bad), "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"Error: {bad}: train.lr: expected a number, got 'fast'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def test_missing_prepared_data_is_one_clear_line(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("{}\n")
    result = CliRunner().invoke(main, ["train", "--params", str(params), "--data", str(tmp_path / "nope"),
                                       "--checkpoints", str(tmp_path / "ckpt")])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "nope" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_info_lists_presets():
    out = CliRunner().invoke(main, ["info", "--presets"]).output
    assert "ddpm-cifar10" in out and "iddpm-cifar10" in out and "tiny" in out


@pytest.mark.parametrize("args, expected", [([], "--max-restarts=2"), (["--max-restarts", "0"], "--max-restarts=0")])
def test_max_restarts_comes_from_params_or_the_command_line_and_goes_to_torchrun_only(tmp_path, monkeypatch, args,
                                                                                      expected):
    from ddpmrepro import launch

    params = tmp_path / "params.yaml"
    params.write_text("train: {nproc: 2, max_restarts: 2, device: cpu}\n")
    argv = ["train", "--params", str(params), *args]
    launched = []
    monkeypatch.setattr(launch, "run_launcher", lambda cmd: launched.append(cmd) or 0)  # record, start nothing
    monkeypatch.setattr(sys, "argv", ["ddpmrepro", *argv])
    assert CliRunner().invoke(main, argv).exit_code == 0
    (cmd,) = launched
    workers = cmd[cmd.index("ddpmrepro.cli"):]
    assert expected in cmd and not [a for a in workers if a.startswith("--max-restarts")]
