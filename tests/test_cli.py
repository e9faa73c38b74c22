"""The command line as a user meets it: help texts, one-line errors, exit codes, nothing written."""
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddpmrepro.cli import main

STAGES = ["prepare", "fit-evaluator", "train", "sample", "bits-per-dim", "evaluate", "report"]


def test_group_help_lists_every_stage():
    """As commands, in the help's command list: the group's docstring names every stage too, so
    searching the whole text would pass with a command gone."""
    out = CliRunner().invoke(main, ["--help"]).output
    listed = out.split("\nCommands:\n", 1)[1].splitlines()
    commands = {line.split()[0] for line in listed if line.startswith("  ") and line.split()}
    assert set(STAGES + ["info", "check-params"]) <= commands



def test_group_help_names_dvc_yamls_stages_in_their_order():
    """The help's "Stages, in pipeline order" line against dvc.yaml (it missed check-params and
    bits-per-dim, which became stages after it was written)."""
    import yaml
    stages = [name.replace("_", "-") for name in
              yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"]]
    out = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    line = out.split("Stages, in pipeline order: ", 1)[1].split(".", 1)[0]
    assert line.split(", ") == stages

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


def test_a_missing_model_is_said_before_sample_waits_for_cpu_cores(tmp_path, monkeypatch):
    """Found from outside: `ddpmrepro sample --model nothere` waited up to two minutes for CPU cores
    (cpu_slots) that concurrent jobs held, then said config.json was not found."""
    from ddpmrepro.runtime import launch

    def claimed(*args, **kwargs):
        raise AssertionError("sample took (or waited for) CPU cores before checking --model")

    monkeypatch.setattr(launch, "check_devices", claimed)
    (tmp_path / "params.yaml").write_text("{}\n")
    result = CliRunner().invoke(main, ["sample", "-p", str(tmp_path / "params.yaml"), "--model", str(tmp_path / "nothere"),
                                       "--out", str(tmp_path / "s")])
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.output.strip().splitlines() == [f"Error: {tmp_path / 'nothere' / 'config.json'}: not found; "
                                                  "train first (`dvc repro train`)"]
    assert not (tmp_path / "s").exists()


def test_info_lists_presets_with_parameter_counts_for_the_params_data():
    root = Path(__file__).resolve().parents[1]
    # Ho et al.'s 35,746,307 and Nichol & Dhariwal's 52,546,438 (learned sigma) at 3x32x32, plus our
    # label table: (10 classes + null) x 4 * 128 time-embedding channels.
    for config, preset, paper in (("ddpm-cifar10", "ddpm-cifar10", 35_746_307),
                                  ("iddpm-cifar10", "iddpm-cifar10", 52_546_438)):
        result = CliRunner().invoke(main, ["info", "--presets", "-p", str(root / "configs" / f"{config}.yaml")])
        assert result.exit_code == 0, result.output
        assert "3x32x32 images" in result.output
        (line,) = [ln for ln in result.output.splitlines() if ln.split()[:1] == [preset]]
        assert line.split()[1] == f"{paper + 11 * 512:,}"
        last = result.output.strip().splitlines()[-1]  # the model this params file trains
        assert f"trains {preset}" in last and last.endswith(f": {paper + 11 * 512:,} parameters")
    # the default params.yaml: 8x8 digits, and every preset is listed with a count
    out = CliRunner().invoke(main, ["info", "--presets", "-p", str(root / "params.yaml")]).output
    assert "1x8x8 images" in out
    for preset in ("tiny", "ddpm-cifar10", "iddpm-cifar10"):
        (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == [preset]]
        assert int(line.split()[1].replace(",", "")) > 100_000


def test_info_defaults_are_the_dataclass_defaults_and_load_back(tmp_path):
    from ddpmrepro import params as P

    out = CliRunner().invoke(main, ["info", "--defaults"]).output
    (tmp_path / "p.yaml").write_text(out)
    assert P.load(tmp_path / "p.yaml") == P.Params()


@pytest.mark.parametrize("command", STAGES + ["info"])
def test_p_is_short_for_params_and_an_empty_params_file_is_refused(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text("# every key commented out\n\n")
    result = CliRunner().invoke(main, [command, "-p", "empty.yaml"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "Error: empty.yaml: the file is empty (no keys); if that is an accident, restore it "
        "(`git checkout -- empty.yaml`); to run on every default, write {} in it (`ddpmrepro info --defaults` "
        "prints them)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.yaml"]


@pytest.mark.parametrize("args, expected", [([], "--max-restarts=2"), (["--max-restarts", "0"], "--max-restarts=0")])
def test_max_restarts_comes_from_params_or_the_command_line_and_goes_to_torchrun_only(tmp_path, monkeypatch, args,
                                                                                      expected):
    from ddpmrepro.runtime import launch

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
