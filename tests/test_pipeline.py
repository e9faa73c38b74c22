"""End to end: a temporary git repo, real DVC and real Snakemake, on a tiny params file.

Checks the outputs, that reruns are no-ops in both directions, that a params edit reruns
exactly the stages downstream of it, that a bad params.yaml stops every front-end before any
output is touched, and that `dvc exp show` / `dvc plots diff` / `snakemake --report` show runs.
"""
from __future__ import annotations

import base64
import dataclasses
import csv
import io
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from ddpmrepro import params as P
from project_copy import BIN, deep_update, run

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def set_param(repo: Path, section: str, key: str, value) -> None:
    path = repo / "params.yaml"
    p = yaml.safe_load(path.read_text())
    p[section][key] = value
    path.write_text(yaml.safe_dump(p, sort_keys=False))


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


@pytest.fixture(scope="module")
def repo(tiny_pipeline) -> Path:
    return tiny_pipeline.repo  # tests/conftest.py: built and run once, shared with tests/test_browser.py


STAGES = {"check_params", "prepare", "fit_evaluator", "train", "sample", "bits_per_dim", "evaluate", "report"}
HEADLINE = ["class_acc", "fid", "floor_fid", "precision", "recall", "bpd", "loss", "evaluator_acc"]


def test_dvc_repro_builds_every_output(repo, tiny_pipeline):
    assert ran_stages(tiny_pipeline.first_repro) == STAGES  # the fixture's `dvc repro`

    manifest = json.loads((repo / "data/prepared/manifest.json").read_text())
    assert manifest["source"] == "digits" and manifest["num_classes"] == 10
    # Outputs are hard links into DVC's cache (.dvc/config), not second copies: a big dataset is stored once.
    for f in (repo / "data/prepared").iterdir():
        assert f.stat().st_nlink == 2 and f.stat().st_mode & 0o222 == 0, f  # read-only: edits cannot reach the cache
    model_files = {p.name for p in (repo / "models/ddpm").iterdir()}
    assert {"model.safetensors", "ema_0.999.safetensors", "config.json"} <= model_files
    assert (repo / "samples/grid.png").stat().st_size > 0
    # the headline (DVC's metric: `dvc exp show` columns) and the details beside it
    metrics = json.loads((repo / "metrics.json").read_text())
    assert list(metrics) == HEADLINE and all(isinstance(v, float) for v in metrics.values())
    detail = json.loads((repo / "reports/metrics_detail.json").read_text())
    assert detail["samples"]["n_gen"] == 30 and detail["floor"]["n_gen"] == 30
    for key, detail_key in (("class_acc", "accuracy"), ("fid", "fid"), ("precision", "precision"), ("recall", "recall")):
        assert metrics[key] == detail["samples"][detail_key], key
    assert metrics["floor_fid"] == detail["floor"]["fid"] and metrics["bpd"] == detail["bpd"]["bpd"]
    assert sorted(detail["per_class"]) == [str(c) for c in range(10)]
    assert sum(c["n"] for c in detail["per_class"].values()) == 30
    per_class_acc = sum(c["accuracy"] * c["n"] for c in detail["per_class"].values()) / 30
    assert per_class_acc == pytest.approx(metrics["class_acc"])  # a second way to the same number
    live = json.loads((repo / "reports/train/live/metrics.json").read_text())
    # the throughput (a timing) in the detail only, from dvclive's TSV: no DVC-cached output holds it
    assert metrics["loss"] == live["loss"] and "images_per_sec" not in live
    assert detail["train"] == {**live, "images_per_sec": detail["train"]["images_per_sec"]}
    assert detail["train"]["images_per_sec"] > 0
    assert detail["inception"]["status"].startswith("skipped") and "inception_fid" not in metrics
    # every params section validated and resolved (defaults filled in) by the first stage
    resolved = {p.stem: yaml.safe_load(p.read_text()) for p in (repo / "reports/params").glob("*.yaml")}
    assert resolved["train"] == {"train": config_params(repo)["train"]} and len(resolved) == len(dataclasses.fields(P.Params))
    # per-step training plots (dvclive) and the gradient tables
    loss = pd.read_csv(repo / "reports/train/live/plots/metrics/loss.tsv", sep="\t")
    assert loss["step"].tolist() == [4, 8, 12]
    grads = pd.read_parquet(repo / "reports/introspect/param_grads")
    assert set(grads["step"]) == {1, 4, 8, 12}  # steps count updates: the first (steps: [1]), every 4th, the last
    assert list((repo / "reports/figures").glob("*.png"))
    # resolved params beside the outputs
    assert config_params(repo)["train"]["steps"] == 12


def config_params(repo: Path) -> dict:
    return json.loads((repo / "models/ddpm/config.json").read_text())["params"]


def test_second_repro_is_a_noop(repo):
    out = run(repo, "dvc", "repro").stdout
    assert ran_stages(out) == set()
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout
    # and Snakemake agrees that there is nothing to do
    assert "Nothing to be done" in run(repo, "snakemake", "-n").stdout


@pytest.mark.parametrize("damage, words", [
    (lambda d: None, None),  # as exported, beside a killed writer's temp file (not a table: not checked)
    (lambda d: _flip_a_byte(sorted((d / "param_grads").glob("part-*.parquet"))[0]), "sha256 differs from"),
    (lambda d: (d / "SHA256SUMS").unlink(), "SHA256SUMS: not found, so the tables cannot be checked"),
    (lambda d: (d / "SHA256SUMS").write_text(""), "not listed in"),  # emptied: no longer turns the check off
    (lambda d: (d / "steps.tsv").unlink(), "steps.tsv: missing (listed in"),
    (lambda d: (d / "steps" / "part-000000099-000000099.parquet").write_bytes(b"x"), "not listed in"),
], ids=["intact", "flipped-byte", "sums-deleted", "sums-emptied", "file-deleted", "file-added"])
def test_the_report_draws_only_the_tables_train_wrote(repo, tmp_path, damage, words):
    """train exports the introspection tables with their SHA256SUMS (`sha256sum -c` accepts it); the
    report checks them first: a damaged, missing, added or unlisted table is one line, no figure.
    (DVC pulled damaged objects from a remote without a word: found from outside.)"""
    tables = tmp_path / "introspect"
    subprocess.run(["cp", "-r", str(repo / "reports/introspect"), str(tables)], check=True)  # copies, not links
    check = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=tables, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    listed = {line.split("  ", 1)[1] for line in (tables / "SHA256SUMS").read_text().splitlines()}
    assert listed == {f.relative_to(tables).as_posix() for f in tables.rglob("*") if f.is_file()} - {"SHA256SUMS"}
    (tables / ".steps.tsv.tmp.123").write_text("a killed writer's temp file is not a table")  # ignored
    damage(tables)
    proc = run(repo, "python", "-m", "ddpmrepro.cli", "report", "--introspect", str(tables), "--live",
               "reports/train/live", "--out", str(tmp_path / "figures"), check=False)
    if words is None:
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"Error: {tables}") and words in proc.stderr, proc.stderr
    assert "dvc repro --force train" in proc.stderr
    assert not (tmp_path / "figures").exists()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def evaluate_by_hand(repo: Path, out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ddpmrepro evaluate` on the pipeline's inputs, writing to `out` (a folder outside the repo)."""
    return run(repo, "python", "-m", "ddpmrepro.cli", "evaluate", "--samples", "samples", "--data", "data/prepared",
               "--evaluator", "models/evaluator", "--live", "reports/train/live", "--out", str(out / "metrics.json"),
               "--detail", str(out / "detail.json"), *extra, check=check)


def test_bits_per_dim_as_a_stage_gives_evaluate_the_numbers_it_computes_itself(repo, tmp_path):
    """The bits_per_dim stage's result read by evaluate (`--bpd`, the pipeline's way) and evaluate
    computing bits/dim itself from the model (by hand, without `--bpd`): the same metrics, bit for bit."""
    evaluate_by_hand(repo, tmp_path, "--model", "models/ddpm")
    assert (tmp_path / "metrics.json").read_bytes() == (repo / "metrics.json").read_bytes()
    assert (tmp_path / "detail.json").read_bytes() == (repo / "reports/metrics_detail.json").read_bytes()
    bpd = json.loads((repo / "reports/bpd.json").read_text())
    assert bpd["bpd"] == json.loads((repo / "metrics.json").read_text())["bpd"]
    assert bpd["weights"] == {"ema_rate": 0.999, "ema_length": 0.0, "ema_step": 0} and bpd["images"] == 4, bpd


@pytest.mark.parametrize("change, words", [
    (lambda b: {**b, "weights": {**b["weights"], "ema_rate": 0.5}}, "made for {"),  # a stale file of other weights
    (lambda b: {**b, "images": b["images"] + 1}, "made for {"),
    (lambda b: {**b, "bpd": float("nan")}, "bpd is nan, not a finite number"),
    (lambda b: [b], "a JSON list, not an object"),
    (None, "not found"),
])
def test_evaluate_refuses_a_bits_per_dim_result_not_made_for_its_params(repo, tmp_path, change, words):
    good = json.loads((repo / "reports/bpd.json").read_text())
    bad = tmp_path / "bpd.json"
    if change is not None:
        bad.write_text(json.dumps(change(good)))
    proc = evaluate_by_hand(repo, tmp_path, "--bpd", str(bad), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"Error: {bad}: "), proc.stderr
    assert words in lines[0] and "rerun `dvc repro bits_per_dim`" in lines[0], lines[0]
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("module, stages", [
    ("src/ddpmrepro/evaluation/report.py", {"report"}),
    ("src/ddpmrepro/evaluation/metrics.py", {"evaluate"}),
    # model/ and training/ are folder deps of check_params too (check_pipeline reads the schedule, the
    # post-hoc EMA's equations, the bucket rule and the model's names): it reruns, rewrites no resolved
    # file, and so sends no other stage back.
    ("src/ddpmrepro/training/ema.py", {"check_params", "train"}),
    # runtime/ is a folder dep of every stage (each command imports part of it): an edit there
    # reruns the stages that do not run launch.py too, the price of a short deps list.
    ("src/ddpmrepro/runtime/launch.py", {"check_params", "prepare", "fit_evaluator", "train", "sample",
                                         "bits_per_dim", "evaluate", "report"}),
    ("src/ddpmrepro/model/unet.py", {"check_params", "train", "sample", "bits_per_dim", "evaluate"}),
    ("src/ddpmrepro/evaluation/bits_per_dim.py", {"bits_per_dim", "evaluate"}),
])
def test_a_code_edit_makes_exactly_the_stages_whose_code_deps_hold_it_stale(repo, module, stages):
    # dvc.yaml names each stage's code by the folders and files it imports (tests/test_stage_deps.py);
    # here real DVC says which stages an edit of one file reaches. evaluation/ is listed file by
    # file, so a new figure (report.py) or metric reruns its own stage and never resamples.
    path = repo / module
    original = path.read_bytes()
    try:
        path.write_bytes(original + b"\n# an edit\n")
        assert set(json.loads(run(repo, "dvc", "status", "--json").stdout)) == stages
    finally:
        path.write_bytes(original)
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout


def snapshot(repo: Path) -> dict[str, bytes]:
    """Every output file DVC or the stages wrote (and params.yaml's resolved sections)."""
    roots = ["models", "reports", "samples", "data/prepared", "metrics.json"]
    files = [f for r in roots for f in ([repo / r] if (repo / r).is_file() else (repo / r).rglob("*"))]
    return {str(f.relative_to(repo)): f.read_bytes() for f in files if f.is_file()}


@pytest.mark.parametrize("typo, key", [
    ({"train": {"bogus_key": 1}}, "train.bogus_key"), ({"trian": {"lr": 0.1}}, "trian"),
    ({"sample": {"eta": "lots"}}, "sample.eta"),
    # Refused by a later stage of these params alone (tests/test_check_params.py lists them all): dvc
    # repro used to retrain the model, then fail in sample; or remove models/ddpm and fail in train.
    ({"train": {"posthoc_ema": []}, "sample": {"ema_length": 0.08}}, "sample.ema_length=0.08"),
    ({"introspect": {"noise_bucket_space": "logsnr", "noise_buckets": 64}}, "introspect.noise_buckets"),
    ({"introspect": {"params": ["nothing.*"]}}, "introspect.params"),
    # The raw data as prepare lists it: DVC removed data/prepared, then prepare refused (found from outside)
    ({"data": {"source": "image_folder", "root": "data/raw/none"}}, "data/raw/none: data.root does not exist"),
])
def test_a_params_typo_stops_every_front_end_before_any_output_is_touched(repo, typo, key):
    # A finished run, then a typo: DVC used to remove the train stage's outputs before the stage's
    # own command refused the file (models/ddpm/ and the dvclive files were gone).
    original = (repo / "params.yaml").read_text()
    before = snapshot(repo)
    assert any(k.startswith("models/ddpm/") for k in before) and "reports/train/live/metrics.json" in before
    (repo / "params.yaml").write_text(yaml.safe_dump(deep_update(yaml.safe_load(original), typo), sort_keys=False))
    try:
        for cmd in (["dvc", "repro"], ["dvc", "exp", "run"], ["snakemake", "--cores", "all"]):
            proc = run(repo, *cmd, check=False)
            assert proc.returncode != 0, cmd
            errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error: ")]
            assert len(errors) == 1 and errors[0].startswith(f"Error: params.yaml: {key}"), (cmd, errors)
            if cmd[0] == "snakemake":
                assert proc.returncode == 2  # as the stages' own commands exit on a bad params.yaml
            else:
                assert ran_stages(proc.stdout) == {"check_params"}, cmd
            assert snapshot(repo) == before, cmd
    finally:
        (repo / "params.yaml").write_text(original)
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout


def test_an_edit_of_an_image_folder_alone_is_refused_before_dvc_removes_the_prepared_data(tmp_path):
    """docs/DATA.md's route for own images: the folder `dvc add`ed and a dependency of check_params and
    prepare. An edit of the folder alone reran check_params, which skipped the listing (the manifest
    was made from these params), then DVC removed data/prepared and prepare refused the folder
    (found from outside: a new class of one image)."""
    import shutil

    from fake_datasets import fake_image_folder
    from project_copy import tiny_project

    repo = tiny_project(tmp_path / "repo")
    fake_image_folder(repo / "data/raw/mine", classes=("a", "b", "c"), per_class=4, size=(8, 8))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["data"].update(source="image_folder", root="data/raw/mine", image_size=8, channels=3)
    params["train"]["batch_per_proc"] = 4  # of 9 training images
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())
    for name in ("check_params", "prepare"):  # as docs/DATA.md says to
        stages["stages"][name]["deps"].append("data/raw/mine")
    (repo / "dvc.yaml").write_text(yaml.safe_dump(stages, sort_keys=False))
    run(repo, "dvc", "add", "-q", "data/raw/mine")
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "own images")
    run(repo, "dvc", "repro", "prepare")
    prepared = {p: p.read_bytes() for p in (repo / "data/prepared").iterdir()}

    (repo / "data/raw/mine/d").mkdir()
    shutil.copy(repo / "data/raw/mine/a/000.png", repo / "data/raw/mine/d/000.png")
    proc = run(repo, "dvc", "repro", "prepare", check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error: ")]
    assert proc.returncode != 0 and ran_stages(proc.stdout) == {"check_params"}, proc.stdout + proc.stderr
    assert len(errors) == 1 and "class 'd': has 1 image(s)" in errors[0], errors
    assert {p: p.read_bytes() for p in (repo / "data/prepared").iterdir()} == prepared

    shutil.copy(repo / "data/raw/mine/b/001.png", repo / "data/raw/mine/d/001.png")  # now a valid class
    run(repo, "dvc", "repro", "prepare")
    assert json.loads((repo / "data/prepared/manifest.json").read_text())["class_names"] == ["a", "b", "c", "d"]


def test_a_training_from_scratch_gives_every_cached_output_its_recorded_hash(repo):
    """Found from outside: dvclive's metrics.json and reports/figures held the throughput, so a fresh
    clone's `make repro` gave them new hashes, its cache never held the versions of the committed
    dvc.lock, and the documented undo (`git reset --hard`, then `dvc checkout`) failed for them.
    Trained again from scratch (its checkpoints moved away), every DVC-cached output of train and
    report gets the hash dvc.lock recorded; only git's timing files (images/s) differ."""
    import shutil

    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    gits = {path for name in ("train", "report") for kind in ("outs", "plots", "metrics")
            for o in stages[name].get(kind) or [] if isinstance(o, dict)
            for path, opts in o.items() if (opts or {}).get("cache") is False}
    assert gits == {"reports/train/live/plots/metrics"}  # the throughput's TSV is there: git's

    def cached_outs(lock: dict) -> dict[str, str]:
        return {o["path"]: o["md5"] for name in ("train", "report") for o in lock["stages"][name]["outs"]
                if o["path"] not in gits}

    # evaluate copies the throughput from git's TSV into the detail file
    tsv = (repo / "reports/train/live/plots/metrics/images_per_sec.tsv").read_text().splitlines()
    detail = json.loads((repo / "reports/metrics_detail.json").read_text())
    assert detail["train"]["images_per_sec"] == float(tsv[-1].split("\t")[1]) > 0
    before = yaml.safe_load((repo / "dvc.lock").read_text())
    lock, throughput = (repo / "dvc.lock").read_bytes(), "\n".join(tsv) + "\n"
    assert "reports/train/live/metrics.json" in cached_outs(before) and "reports/figures" in cached_outs(before)
    kept = repo.parent / "checkpoints-kept"
    shutil.move(repo / "checkpoints", kept)
    try:
        out = run(repo, "dvc", "repro", "-f", "-s", "train").stdout + run(repo, "dvc", "repro", "-f", "-s", "report").stdout
        assert "resuming" not in out  # trained from step 0
        after = yaml.safe_load((repo / "dvc.lock").read_text())
        assert cached_outs(after) == cached_outs(before)
        # and git's: the throughput's TSV changed, but .dvcignore keeps it out of its directory's hash, so
        # dvc.lock is as it was, byte for byte (found from outside: every fresh clone's make repro changed it)
        tsv = (repo / "reports/train/live/plots/metrics/images_per_sec.tsv").read_text()
        assert tsv != throughput and (repo / "dvc.lock").read_bytes() == lock
        live = json.loads((repo / "reports/train/live/metrics.json").read_text())
        assert "images_per_sec" not in live and "loss" in live
    finally:
        shutil.rmtree(repo / "checkpoints", ignore_errors=True)
        shutil.move(kept, repo / "checkpoints")
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout


def test_lr_edit_reruns_train_and_downstream_only(repo):
    set_param(repo, "train", "lr", 1e-3)
    status = run(repo, "dvc", "status", "--json").stdout
    assert set(json.loads(status)) == {"check_params", "train"}  # check_params: any edit of params.yaml
    out = run(repo, "dvc", "repro").stdout
    assert ran_stages(out) == {"check_params", "train", "sample", "bits_per_dim", "evaluate", "report"}
    assert yaml.safe_load((repo / "reports/params/train.yaml").read_text())["train"]["lr"] == 1e-3


def test_an_ema_length_edit_samples_and_evaluates_again_and_never_trains(repo):
    """Post-hoc EMA (docs/POSTHOC_EMA.md): another length is made from the snapshots the train stage
    exported; `dvc exp run -S sample.ema_length=...` does what this `dvc repro` does."""
    set_param(repo, "sample", "ema_length", 0.1)  # a tracked length: the tiny run has few snapshots
    status = run(repo, "dvc", "status", "--json").stdout
    ema_readers = {"check_params", "sample", "bits_per_dim", "evaluate"}  # the stages that read the key
    assert set(json.loads(status)) == ema_readers
    out = run(repo, "dvc", "repro").stdout
    assert ran_stages(out) == ema_readers
    assert yaml.safe_load((repo / "samples/params.yaml").read_text())["sample"]["ema_length"] == 0.1
    # The same length as it stood after step 6 of 12 (`sample.ema_step`: a learning curve from one run)
    at_end = (repo / "samples/samples.npz").read_bytes()
    set_param(repo, "sample", "ema_step", 6)
    assert set(json.loads(run(repo, "dvc", "status", "--json").stdout)) == ema_readers
    assert ran_stages(run(repo, "dvc", "repro").stdout) == ema_readers
    assert json.loads((repo / "reports/bpd.json").read_text())["weights"]["ema_step"] == 6
    assert yaml.safe_load((repo / "samples/params.yaml").read_text())["sample"]["ema_step"] == 6
    assert (repo / "samples/samples.npz").read_bytes() != at_end  # other weights, the same noise
    # Back to sample.ema_rate's weights, again without training (sample's outputs come back from DVC's run cache).
    set_param(repo, "sample", "ema_step", 0)
    set_param(repo, "sample", "ema_length", 0)
    assert ran_stages(run(repo, "dvc", "repro").stdout) <= ema_readers
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout


def test_compiled_training_and_sampling_run_through_dvc_repro_with_a_warm_cache_after(repo, monkeypatch):
    """`train.compile: blocks` and `sample.compile: blocks` (runtime/compilation.py) as a user turns
    them on: the stages that read them rerun, Inductor's cache fills checkpoints/inductor-cache (git-
    and DVC-ignored: the repo stays clean), and turning them off brings the eager outputs back from
    DVC's run cache without training."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the stages choose it, as for a user
    eager_model = (repo / "models/ddpm/model.safetensors").read_bytes()
    set_param(repo, "train", "compile", "blocks")
    set_param(repo, "sample", "compile", "blocks")
    try:
        out = run(repo, "dvc", "repro").stdout
        assert ran_stages(out) == {"check_params", "train", "sample", "bits_per_dim", "evaluate", "report"}
        assert yaml.safe_load((repo / "reports/params/train.yaml").read_text())["train"]["compile"] == "blocks"
        assert any((repo / "checkpoints/inductor-cache").rglob("*.so"))
        assert not run(repo, "git", "status", "--porcelain", "--ignored=no", "checkpoints").stdout.strip()
        metrics = json.loads((repo / "metrics.json").read_text())
        assert 0 <= metrics["class_acc"] <= 1 and metrics["fid"] > 0
        # compiled kernels round differently: another model, near the eager one
        assert (repo / "models/ddpm/model.safetensors").read_bytes() != eager_model
    finally:  # the eager outputs back for the tests after this one, whatever failed above
        set_param(repo, "train", "compile", "none")
        set_param(repo, "sample", "compile", "none")
        out = run(repo, "dvc", "repro").stdout
    assert "train" not in ran_stages(out)  # "Stage 'train' is cached - skipping run, checking out outputs"
    assert (repo / "models/ddpm/model.safetensors").read_bytes() == eager_model


def workspace_files(repo) -> dict[str, tuple[int, str]]:
    """Every file outside .git, .dvc and .snakemake (Snakemake's own records): its mtime and md5."""
    import hashlib

    inner = (".git", ".dvc", ".snakemake")
    return {str(p.relative_to(repo)): (p.stat().st_mtime_ns, hashlib.md5(p.read_bytes()).hexdigest())
            for p in repo.rglob("*") if p.is_file() and p.relative_to(repo).parts[0] not in inner}


def test_snakemake_runs_what_dvc_would_and_leaves_dvc_clean(repo):
    set_param(repo, "sample", "seed", 7)
    before = workspace_files(repo)
    dry = run(repo, "snakemake", "-n").stdout
    # check_params reruns on any edit of params.yaml, but only the stages reading `sample` follow it
    assert set(re.findall(r"rule (\w+):", dry)) - {"all"} == {"check_params", "sample", "evaluate"}
    # a dry run writes nothing, not even check_params' resolved files (found from outside: it did)
    assert workspace_files(repo) == before
    run(repo, "snakemake", "--cores", "all", "--resources", "gpu=4")
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout
    assert ran_stages(run(repo, "dvc", "repro").stdout) == set()
    assert "Nothing to be done" in run(repo, "snakemake", "-n").stdout
    for rule in ("sample", "evaluate"):
        assert (repo / f"logs/dvc/{rule}.log").exists()


def test_a_stage_stale_at_one_snakemake_parse_and_not_at_the_next_is_not_run(repo):
    """An edit that `snakemake -n` saw, then reverted: its stages' stamps were newer than their
    outputs, and Snakemake ran them (DVC no-ops) at every later call, one after another (found
    from outside). DVC would run nothing, so Snakemake must not either."""
    path = repo / "params.yaml"
    original = path.read_text()
    set_param(repo, "train", "lr", 2 * yaml.safe_load(original)["train"]["lr"])  # another value than the last run's
    try:
        dry = run(repo, "snakemake", "-n").stdout
        assert {"check_params", "train"} <= set(re.findall(r"rule (\w+):", dry)), dry[-2000:]
    finally:
        path.write_text(original)
    # `dvc repro` finds nothing to do, or at most check_params' record to refresh
    assert ran_stages(run(repo, "dvc", "repro").stdout) <= {"check_params"}
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout
    assert "Nothing to be done" in run(repo, "snakemake", "-n").stdout



def test_a_stage_that_fails_under_snakemake_says_why_on_its_output(repo):
    """Found from outside: a failed job showed Snakemake's 60-line RuleException, the one-line cause
    only in logs/dvc/<stage>.log. dvc_stage.sh repeats the stage's own error line on stderr. (A
    damaged image is the one refusal check-params cannot make: no image is opened before prepare.)
    DVC removed data/prepared before the stage ran; `dvc checkout` brings it back."""
    from PIL import Image

    original, lock = (repo / "params.yaml").read_text(), (repo / "dvc.lock").read_bytes()
    raw = repo / "data" / "raw" / "damaged"
    for name in ("a", "b"):
        (raw / name).mkdir(parents=True)
        for i in range(3):
            Image.new("L", (8, 8), 40 * i).save(raw / name / f"{i}.png")
    blob = (raw / "b" / "2.png").read_bytes()
    (raw / "b" / "2.png").write_bytes(blob[: len(blob) // 2])
    params = deep_update(yaml.safe_load(original), {"data": {"source": "image_folder", "root": "data/raw/damaged"},
                                                    "train": {"batch_per_proc": 4}})  # of 4 training images
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        proc = run(repo, "snakemake", "--cores", "1", "prepare", check=False)
        assert proc.returncode != 0
        said = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
        assert said and said[0].startswith("Error: data/raw/damaged/b/2.png: not an image file"), proc.stderr[-3000:]
        assert "stage prepare failed (exit 255); from logs/dvc/prepare.log:" in proc.stderr  # 255: dvc's
    finally:
        (repo / "params.yaml").write_text(original)
        (repo / "dvc.lock").write_bytes(lock)  # the check_params job ran, and recorded these params
        import shutil
        shutil.rmtree(repo / "data" / "raw")
        run(repo, "dvc", "checkout")  # data/prepared, which DVC removed
        run(repo, "dvc", "repro", "-s", "check_params")  # reports/params/ (git's, not DVC's cache), as they were
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout

def test_a_training_that_cannot_start_here_stops_a_local_snakemake_before_any_job(repo):
    """Found from outside: `train.device: cuda` on a machine without a GPU (or `train.nodes: 2` outside
    SLURM) was refused by train's own job, after DVC had removed models/ddpm. check_params cannot
    refuse it (a `dvc repro prepare` on a login node with params meant for the cluster is legitimate);
    the Snakefile, which knows the jobs it will run here, stops before the first. A run without train
    goes through."""
    import torch

    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU: train.device: cuda can start here")
    original, lock = (repo / "params.yaml").read_text(), (repo / "dvc.lock").read_bytes()
    before = snapshot(repo)  # reports/params/ too: written at parse time, put back at the refusal
    job_logs = lambda repo: {p.name: p.stat().st_mtime_ns for p in (repo / "logs/dvc").glob("*.log")}  # noqa: E731
    logs_before = job_logs(repo)
    set_param(repo, "train", "device", "cuda")
    set_param(repo, "train", "nodes", 2)
    try:
        proc = run(repo, "snakemake", "--cores", "all", check=False)
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error: ")]
        assert proc.returncode != 0 and len(errors) == 2, proc.stderr[-3000:]
        assert errors[0].startswith("Error: train: train.nodes=2 runs on 2 nodes: in a SLURM allocation"), errors
        assert errors[1].startswith("Error: train: train.device: cuda, but no CUDA device is visible here"), errors
        assert all(e.endswith("(checked before any job ran; nothing was removed)") for e in errors)
        assert not re.search(r"^(local)?rule \w+:", proc.stdout + proc.stderr, re.M), proc.stderr[-3000:]
        assert job_logs(repo) == logs_before  # no job started (each writes logs/dvc/<stage>.log)
        assert snapshot(repo) == before
        ok = run(repo, "snakemake", "--cores", "1", "check_params")  # no train among its jobs: not refused
        assert re.search(r"^(local)?rule check_params:", ok.stdout + ok.stderr, re.M)  # how a job shows above
    finally:
        (repo / "params.yaml").write_text(original)
        (repo / "dvc.lock").write_bytes(lock)  # the check_params job recorded the edited params
        run(repo, "dvc", "repro", "-s", "check_params")  # reports/params/ as they were
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout


def test_snakemake_while_dvc_runs_is_one_line_not_a_traceback(repo):
    """While a `dvc repro` writes an output, DVC's status (which the Snakefile asks at parse time) is
    refused with its lock error: a 13-frame traceback before (found from outside)."""
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from dvc.fs import localfs\nfrom dvc.rwlock import rwlock\n"
         "with rwlock('.dvc/tmp', localfs, 'dvc repro', [], [sys.argv[1]], False):\n"
         "    print('held', flush=True); time.sleep(120)\n", str(repo / "samples")],
        cwd=repo, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run(repo, "snakemake", "-n", check=False)
    finally:
        holder.kill()
        holder.wait()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert any(line.startswith("Error: DVC is running in this project (") and "wait for it to finish" in line
               for line in lines), proc.stderr[-3000:]
    assert "Nothing to be done" in run(repo, "snakemake", "-n").stdout  # once it is gone


def test_snakemake_and_dvc_describe_the_same_dag(repo):
    dvc_edges = set(re.findall(r'"([^"]+)" -> "([^"]+)"', run(repo, "dvc", "dag", "--dot").stdout))
    dot = run(repo, "snakemake", "--rulegraph", "--forceall", "--quiet", "all").stdout
    labels = dict(re.findall(r'(\d+)\[label = "([^"]+)"', dot))
    smk_edges = {(labels[a], labels[b]) for a, b in re.findall(r"(\d+) -> (\d+)", dot)}
    smk_edges = {(a, b) for a, b in smk_edges if "all" not in (a, b)}
    # DVC draws dependency -> dependent, as Snakemake does
    assert dvc_edges == smk_edges


def killed_in_train(repo: Path, *cmd: str) -> None:
    """Runs `cmd` and SIGKILLs its train stage's process as soon as it starts."""
    import psutil

    proc = subprocess.Popen(cmd, cwd=repo, env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"],
                                                "PYTHONPATH": str(repo / "src"), "DVC_NO_ANALYTICS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = False
    while proc.poll() is None and not killed:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "ddpmrepro.cli" in child.cmdline() and "train" in child.cmdline():
                    child.kill()
                    killed = True
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)
    out = proc.communicate(timeout=300)[0]
    assert killed and proc.returncode != 0, f"the train stage ended before it could be killed:\n{out[-2000:]}"


def test_dvc_experiments_show_runs_side_by_side(repo):
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "baseline")
    # The first is killed in its train stage and then run again, as the message says to: DVC left only
    # its .gitignore in reports/train/live, and the rerun was refused (found from outside).
    killed_in_train(repo, "dvc", "exp", "run", "-S", "train.lr=0.004", "-n", "lr4e-3")
    run(repo, "dvc", "exp", "run", "-S", "train.lr=0.004", "-n", "lr4e-3")
    run(repo, "dvc", "exp", "run", "-S", "train.lr=0.002", "-n", "lr2e-3")
    table = run(repo, "dvc", "exp", "show", "--csv", "--no-pager").stdout
    rows = list(csv.DictReader(io.StringIO(table)))
    by_name = {r["Experiment"] or r["rev"]: r for r in rows}
    assert {"lr4e-3", "lr2e-3"} <= set(by_name)
    assert float(by_name["lr4e-3"]["train.lr"]) == pytest.approx(0.004)
    baseline = next(r for r in rows if r["rev"] == "main")
    assert float(baseline["train.lr"]) == pytest.approx(1e-3)
    for row in (baseline, by_name["lr4e-3"]):
        assert row["class_acc"] != "" and row["fid"] != ""
    # The headline is the only DVC metrics file: no per-class, floor or dvclive columns.
    exps = json.loads(run(repo, "dvc", "exp", "show", "--json").stdout)
    metric_files = {f for e in exps for f in ((e.get("data") or {}).get("metrics") or {})}
    assert metric_files == {"metrics.json"}


def only_changed_table(repo: Path, columns: int) -> tuple[list[str], list[str]]:
    """(the changed metric and param columns, the lines `dvc exp show --only-changed` prints at this width)."""
    changed = next(csv.reader(io.StringIO(run(repo, "dvc", "exp", "show", "--only-changed", "--csv").stdout)))
    params = {f"{section}.{key}" for section, keys in yaml.safe_load((repo / "params.yaml").read_text()).items()
              for key in keys}
    wanted = [c for c in changed if c in HEADLINE or c in params]
    proc = subprocess.run(["dvc", "exp", "show", "--only-changed", "--no-pager"], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"],
                                          "COLUMNS": str(columns), "PYTHONPATH": str(repo / "src")})
    return wanted, proc.stdout.splitlines()


# 160 columns, less the 21 that experiments run by `dvc queue` add (State, Executor): tests/test_sweep.py
# checks a queued pair at 160.
@pytest.mark.parametrize("columns", [160, 139])
def test_only_changed_fits_with_the_param_and_every_changed_metric(repo, columns):
    wanted, lines = only_changed_table(repo, columns)
    assert "train.lr" in wanted and "fid" in wanted and "loss" in wanted
    assert max(len(line.rstrip()) for line in lines) <= columns, "\n".join(lines)
    header = next(line for line in lines if "Experiment" in line).split()
    assert [c for c in wanted if c not in header] == [], "\n".join(lines)  # none folded into "…"


def test_the_documented_drop_of_the_dependency_columns_drops_them_and_keeps_the_rest(repo):
    """docs/EXPERIMENTS.md said `--drop '/'`, which DVC matches at the start of a name: nothing dropped
    (found from outside)."""
    (line,) = [ln for ln in (ROOT / "docs" / "EXPERIMENTS.md").read_text().splitlines()
               if ln.startswith("dvc exp show --only-changed --drop ")]
    pattern = line.split()[5].strip("'")
    header = lambda *extra: next(csv.reader(io.StringIO(  # noqa: E731
        run(repo, "dvc", "exp", "show", "--only-changed", "--csv", *extra).stdout)))
    full, dropped = header(), header("--drop", pattern)
    assert any("/" in c for c in full) and not any("/" in c for c in dropped), (full, dropped)
    assert dropped == [c for c in full if "/" not in c]


def test_dvc_plots_diff_draws_every_plot_for_both_experiments(repo):
    out = json.loads(run(repo, "dvc", "plots", "diff", "lr4e-3", "lr2e-3", "--json").stdout)["data"]
    dvc_yaml = yaml.safe_load((repo / "dvc.yaml").read_text())
    ids = [next(iter(p)) if isinstance(p, dict) else p for p in dvc_yaml["plots"]]
    live = sorted(str(p.relative_to(repo)) for p in (repo / "reports/train/live/plots/metrics").glob("*.tsv"))
    assert set(ids) | set(live) <= set(out)
    for plot_id in [*ids, *live]:
        revisions = set()
        for entry in out[plot_id]:
            if entry["type"] == "vega":
                values = entry["content"]["data"]["values"]
                revisions |= {v["rev"] for v in values}
                assert all(v["step"] != "" for v in values)
            else:
                assert Path(entry["url"]).stat().st_size > 0
                revisions |= set(entry["revisions"])
        assert revisions == {"lr4e-3", "lr2e-3"}, plot_id


def test_snakemake_report_holds_every_figure_with_its_caption(repo):
    run(repo, "snakemake", "--report", "report.html")
    page = (repo / "report.html").read_text()
    assert "Class-conditional DDPM/IDDPM trained and evaluated by ddpmrepro" in page  # workflow.rst
    assert "System Message" not in page and 'class="problematic"' not in page  # captions parse (found from outside)
    results = json.loads(re.search(r"var results = (\{.*?\});\n", page, re.S).group(1))
    by_name = {r["filename"]: r for r in results.values()}
    expected = {"samples/grid.png": "samples.rst", "reports/metrics.html": "metrics.rst",
                "metrics.json": "metrics_json.rst", "reports/metrics_detail.json": "metrics_detail.rst",
                **{f"reports/figures/{p.name}": "figures.rst" for p in (repo / "reports/figures").glob("*.png")}}
    assert len(expected) >= 10 and set(by_name) == {Path(p).name for p in expected}
    for path, caption in expected.items():
        entry = by_name[Path(path).name]
        # the file itself is embedded, byte for byte
        assert base64.b64decode(entry["data_uri"].split(",", 1)[1]) == (repo / path).read_bytes(), path
        first_words = (repo / "workflow/report" / caption).read_text().split("\n")[0].split("(")[0].strip()
        assert entry["caption"].startswith(f"<p>{first_words}"), (path, entry["caption"][:80])
