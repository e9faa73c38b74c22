"""End to end: a temporary git repo, real DVC and real Snakemake, on a tiny params file.

Checks the outputs, that reruns are no-ops in both directions, that a params edit reruns
exactly the stages downstream of it, and that `dvc exp` shows runs side by side.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from project_copy import copy_project

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
TINY = {
    "train": {"steps": 12, "batch_per_proc": 32, "warmup_steps": 2, "checkpoint_every": 5, "log_every": 4,
              "timestep_sampler": "loss-second-moment"},
    "diffusion": {"timesteps": 50},
    "introspect": {"every": 4, "steps": [1]},
    "sample": {"per_class": 3, "respacing": "ddim5", "batch_size": 16},
    "evaluator": {"epochs": 1},
    "evaluate": {"bpd_images": 4},
}

pytestmark = pytest.mark.slow


def run(repo: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
           "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def deep_update(d: dict, u: dict) -> dict:
    for k, v in u.items():
        d[k] = deep_update(d.get(k, {}), v) if isinstance(v, dict) else v
    return d


def set_param(repo: Path, section: str, key: str, value) -> None:
    path = repo / "params.yaml"
    p = yaml.safe_load(path.read_text())
    p[section][key] = value
    path.write_text(yaml.safe_dump(p, sort_keys=False))


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("e2e")
    copy_project(repo)
    params = deep_update(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(repo, "git", "init", "-q", "-b", "main")
    run(repo, "dvc", "init", "-q")
    shutil.copy2(ROOT / ".dvc" / "config", repo / ".dvc" / "config")  # the project's cache link types
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "tiny pipeline")
    return repo


def test_dvc_repro_builds_every_output(repo):
    out = run(repo, "dvc", "repro").stdout
    assert ran_stages(out) == {"prepare", "fit_evaluator", "train", "sample", "evaluate", "report"}

    manifest = json.loads((repo / "data/prepared/manifest.json").read_text())
    assert manifest["source"] == "digits" and manifest["num_classes"] == 10
    # Outputs are hard links into DVC's cache (.dvc/config), not second copies: a big dataset is stored once.
    for f in (repo / "data/prepared").iterdir():
        assert f.stat().st_nlink == 2 and f.stat().st_mode & 0o222 == 0, f  # read-only: edits cannot reach the cache
    model_files = {p.name for p in (repo / "models/ddpm").iterdir()}
    assert {"model.safetensors", "ema_0.999.safetensors", "config.json"} <= model_files
    assert (repo / "samples/grid.png").stat().st_size > 0
    metrics = json.loads((repo / "metrics.json").read_text())
    for key in ("class_accuracy", "fid", "floor_fid", "recall", "bpd", "evaluator_test_accuracy"):
        assert isinstance(metrics[key], float), key
    assert metrics["n_gen"] == 30
    # per-step training plots (dvclive) and the gradient tables
    loss = pd.read_csv(repo / "reports/train/live/plots/metrics/loss.tsv", sep="\t")
    assert loss["step"].tolist() == [4, 8, 12]
    grads = pd.read_parquet(repo / "reports/introspect/param_grads")
    assert set(grads["step"]) == {1, 4, 8, 12}  # steps count updates: the first (steps: [1]), every 4th, the last
    assert list((repo / "reports/figures").glob("*.png"))
    # resolved params beside the outputs
    config = json.loads((repo / "models/ddpm/config.json").read_text())
    assert config["params"]["train"]["steps"] == 12


def test_second_repro_is_a_noop(repo):
    out = run(repo, "dvc", "repro").stdout
    assert ran_stages(out) == set()
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout
    # and Snakemake agrees that there is nothing to do
    assert "Nothing to be done" in run(repo, "snakemake", "-n").stdout


def test_lr_edit_reruns_train_and_downstream_only(repo):
    set_param(repo, "train", "lr", 1e-3)
    status = run(repo, "dvc", "status", "--json").stdout
    assert set(json.loads(status)) == {"train"}
    out = run(repo, "dvc", "repro").stdout
    assert ran_stages(out) == {"train", "sample", "evaluate", "report"}


def test_snakemake_runs_what_dvc_would_and_leaves_dvc_clean(repo):
    set_param(repo, "sample", "seed", 7)
    dry = run(repo, "snakemake", "-n").stdout
    assert "sample" in dry and "evaluate" in dry and "train" not in re.findall(r"rule (\w+):", dry)
    run(repo, "snakemake", "--cores", "all", "--resources", "gpu=4")
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout
    assert ran_stages(run(repo, "dvc", "repro").stdout) == set()
    assert "Nothing to be done" in run(repo, "snakemake", "-n").stdout
    for rule in ("sample", "evaluate"):
        assert (repo / f"logs/dvc/{rule}.log").exists()


def test_snakemake_and_dvc_describe_the_same_dag(repo):
    dvc_edges = set(re.findall(r'"([^"]+)" -> "([^"]+)"', run(repo, "dvc", "dag", "--dot").stdout))
    dot = run(repo, "snakemake", "--rulegraph", "--forceall", "--quiet", "all").stdout
    labels = dict(re.findall(r'(\d+)\[label = "([^"]+)"', dot))
    smk_edges = {(labels[a], labels[b]) for a, b in re.findall(r"(\d+) -> (\d+)", dot)}
    smk_edges = {(a, b) for a, b in smk_edges if "all" not in (a, b)}
    # DVC draws dependency -> dependent, as Snakemake does
    assert dvc_edges == smk_edges


def test_dvc_experiments_show_runs_side_by_side(repo):
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "baseline")
    run(repo, "dvc", "exp", "run", "-S", "train.lr=0.004", "-n", "lr4e-3")
    table = run(repo, "dvc", "exp", "show", "--csv", "--no-pager").stdout
    rows = list(csv.DictReader(io.StringIO(table)))
    by_name = {r["Experiment"] or r["rev"]: r for r in rows}
    assert "lr4e-3" in by_name
    assert float(by_name["lr4e-3"]["train.lr"]) == pytest.approx(0.004)
    baseline = next(r for r in rows if r["rev"] == "main")
    assert float(baseline["train.lr"]) == pytest.approx(1e-3)
    for row in (baseline, by_name["lr4e-3"]):
        assert row["class_accuracy"] != "" and row["fid"] != ""
