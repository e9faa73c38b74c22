"""The check_params stage: params.yaml validated and resolved before any other stage runs.

Through the real CLI; the end-to-end behaviour under DVC and Snakemake is in test_pipeline.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpmrepro.params import Params, from_dict
from ddpmrepro.pipeline.check_params import check_params_file

SRC = Path(__file__).resolve().parents[1] / "src"


def check(tmp_path: Path, params: str) -> subprocess.CompletedProcess:
    (tmp_path / "params.yaml").write_text(params)
    return subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "check-params", "--out", "resolved"], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})


def test_writes_every_section_resolved_and_rewrites_only_what_changed(tmp_path):
    assert check(tmp_path, "train:\n  lr: 0.001\n").returncode == 0
    files = {p.stem: p for p in (tmp_path / "resolved").glob("*.yaml")}
    assert set(files) == set(Params().to_dict())
    expected = from_dict({"train": {"lr": 0.001}}).to_dict()
    for name, path in files.items():
        assert yaml.safe_load(path.read_text()) == {name: expected[name]}  # defaults filled in
    mtimes = {name: p.stat().st_mtime_ns for name, p in files.items()}
    os.utime(files["data"], ns=(1, 1))  # a rewrite would show as a new mtime
    proc = check(tmp_path, "train:\n  lr: 0.002\n  steps: 1500\n")
    assert proc.returncode == 0 and "1 resolved section file(s) updated" in proc.stdout
    assert files["data"].stat().st_mtime_ns == 1
    assert yaml.safe_load(files["train"].read_text())["train"]["lr"] == 0.002
    assert all(files[n].stat().st_mtime_ns == mtimes[n] for n in mtimes if n not in ("train", "data"))


@pytest.mark.parametrize("params, message", [
    ("train:\n  bogus_key: 1\n", "params.yaml: train.bogus_key: unknown key"),
    ("trian:\n  lr: 0.1\n", "params.yaml: trian: unknown key"),
    ("sample:\n  eta: lots\n", "params.yaml: sample.eta: expected a number"),
    ("train: [\n", "params.yaml: line"),
])
def test_a_bad_file_is_one_line_exit_2_and_leaves_the_resolved_files_alone(tmp_path, params, message):
    assert check(tmp_path, "{}\n").returncode == 0
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "resolved").iterdir()}
    proc = check(tmp_path, params)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith(f"Error: {message}") and len(proc.stderr.splitlines()) == 1
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "resolved").iterdir()} == before


def test_the_snakefile_check_exits_like_the_stages(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("train:\n  bogus_key: 1\n")
    with pytest.raises(SystemExit) as e:
        check_params_file(tmp_path / "params.yaml")
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"Error: {tmp_path / 'params.yaml'}: train.bogus_key: unknown key")
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.001\n")
    assert check_params_file(tmp_path / "params.yaml").train.lr == 0.001


def test_the_snakefile_refreshes_the_directory_the_stage_writes():
    root = Path(__file__).resolve().parents[1]
    cmd = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["check_params"]["cmd"].split()
    assert f'check_params_file("params.yaml", "{cmd[cmd.index("--out") + 1]}"' in (root / "Snakefile").read_text()


def test_the_snakefile_check_brings_the_resolved_files_up_to_date(tmp_path):
    (tmp_path / "params.yaml").write_text("sample:\n  guidance: 1.5\n")
    check_params_file(tmp_path / "params.yaml", tmp_path / "resolved")
    assert yaml.safe_load((tmp_path / "resolved/sample.yaml").read_text())["sample"]["guidance"] == 1.5
    assert len(list((tmp_path / "resolved").glob("*.yaml"))) == len(Params().to_dict())  # one per section
