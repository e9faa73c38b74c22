"""Bad input through the real command line: every params key with a wrong type and an out-of-range
value, unknown keys, empty/missing/corrupt data, truncated/tampered/foreign/pickle-bearing
checkpoints, a second writer. Each gives a non-zero exit with one line naming what is wrong, and
leaves the files already there byte for byte as they were.

The params cases are generated from the dataclasses in ddpmrepro.params, so a new key is covered
without touching this file.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from ddpmrepro import params as P
from ddpmrepro.files import sha256
from ddpmrepro.training.checkpoint import RunLock, latest_checkpoint, list_checkpoints, save_checkpoint
from ddpmrepro.cli import main
from ddpmrepro.data import prepare

SRC = Path(__file__).resolve().parents[1] / "src"

# Each stage with every path it reads or writes, relative to the working directory of the test.
# The minimal environments below keep the suite's throwaway Inductor cache (conftest.py): without it,
# torch made /tmp/torchinductor_$USER (hundreds of MB) and left it after the run.
INDUCTOR_CACHE = {k: v for k, v in os.environ.items() if k == "TORCHINDUCTOR_CACHE_DIR"}

STAGE_ARGS = {
    "prepare": ["--out", "data"],
    "fit-evaluator": ["--data", "data", "--out", "evaluator"],
    "train": ["--data", "data", "--out", "model", "--live", "live", "--introspect", "introspect",
              "--checkpoints", "ckpt"],
    "sample": ["--model", "model", "--out", "samples"],
    "evaluate": ["--samples", "samples", "--data", "data", "--evaluator", "evaluator", "--model", "model",
                 "--out", "metrics.json", "--detail", "detail.json"],
    "report": ["--introspect", "introspect", "--live", "live", "--out", "figures"],
}
# The stage that reads each params section (dvc.yaml lists the same).
SECTION_STAGE = {"data": "prepare", "evaluator": "fit-evaluator", "model": "train", "superres": "train", "diffusion": "train",
                 "train": "train", "introspect": "train", "sample": "sample", "evaluate": "evaluate",
                 "report": "report"}


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file under root with its bytes, and every directory (the run lock's pid note aside:
    it is not an output)."""
    return {f.relative_to(root).as_posix(): f.read_bytes() if f.is_file() else None
            for f in sorted(root.rglob("*")) if f.name != ".lock"}


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_one_line_error(result, exit_code: int, *fragments: str) -> str:
    assert result.exit_code == exit_code, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


# --- params.yaml: every key ------------------------------------------------------------------------


def _leaves():
    for section, cls in typing.get_type_hints(P.Params).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f.name, hints[f.name], f.metadata


def _strip_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return tp


def _wrong_type(tp):
    tp = _strip_optional(tp)
    if typing.get_origin(tp) is list:
        return "not-a-list"
    return {bool: "yes", int: "many", float: "fast", str: [1]}[tp]


def _out_of_range(tp, meta) -> list[tuple[object, str]]:
    """Values of the right type that the field's choices or bounds exclude, with the expected words."""
    tp = _strip_optional(tp)
    listed = typing.get_origin(tp) is list
    item = typing.get_args(tp)[0] if listed else tp
    cases = []
    if meta.get("choices") is not None:
        cases.append((2 if item is int else "not-a-choice", "is not one of"))
    if meta.get("min") is not None:
        lo = meta["min"]
        cases.append((lo if meta.get("min_exclusive") else lo - (1 if item is int else 0.5), "must be >"))
    if meta.get("max") is not None:
        cases.append((meta["max"] + 1, "must be <="))
    return [([v] if listed else v, words) for v, words in cases]


def _params_cases():
    for section, name, tp, meta in _leaves():
        key = f"{section}.{name}"
        yield pytest.param({section: {name: _wrong_type(tp)}}, key, "expected", id=f"{key}-type")
        for i, (value, words) in enumerate(_out_of_range(tp, meta)):
            yield pytest.param({section: {name: value}}, key, words, id=f"{key}-range{i}")
    for section in typing.get_type_hints(P.Params):
        yield pytest.param({section: {"no_such_key": 1}}, f"{section}.no_such_key", "unknown key",
                           id=f"{section}-unknown")
    yield pytest.param({"no_such_section": {}}, "no_such_section", "unknown key", id="top-unknown")


PARAMS_CASES = list(_params_cases())


@pytest.fixture
def outputs(tmp_path, monkeypatch) -> Path:
    """A working directory holding an earlier output of every stage."""
    monkeypatch.chdir(tmp_path)
    for rel in ("data/train-00000.images.npy", "data/manifest.json", "evaluator/model.safetensors",
                "evaluator/config.json", "evaluator/metrics.json", "model/model.safetensors", "model/config.json",
                "model/SHA256SUMS", "live/metrics.json", "live/plots/metrics/loss.tsv", "introspect/steps.tsv",
                "ckpt/a/b/step_000000001.pt", "samples/samples.npz", "metrics.json", "figures/training_curves.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(f"earlier {rel}".encode())
    return tmp_path


def test_every_section_is_read_by_a_stage_and_every_key_has_cases():
    assert set(SECTION_STAGE) == set(typing.get_type_hints(P.Params))
    keys = {f"{s}.{n}" for s, n, _, _ in _leaves()}
    assert keys == {c.values[1] for c in PARAMS_CASES if not c.values[1].endswith("no_such_key")} - {"no_such_section"}


@pytest.mark.parametrize("raw, key, words", PARAMS_CASES)
def test_bad_params_value_exits_2_with_one_line_naming_the_key(outputs, raw, key, words):
    (outputs / "params.yaml").write_text(yaml.safe_dump(raw))
    before = snapshot(outputs)
    stage = SECTION_STAGE.get(key.split(".")[0], "train")
    result = cli(stage, "--params", "params.yaml", *STAGE_ARGS[stage])
    assert_one_line_error(result, 2, f"Error: params.yaml: {key}", words)
    assert result.stdout == ""
    assert snapshot(outputs) == before


@pytest.mark.slow
def test_bad_params_end_to_end_in_a_fresh_process(outputs):
    (outputs / "params.yaml").write_text("train:\n  on_nonfinite: ignore\n")
    before = snapshot(outputs)
    proc = subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "train", "--params", "params.yaml",
                           *STAGE_ARGS["train"]], capture_output=True, text=True, cwd=outputs,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", **INDUCTOR_CACHE}, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["Error: params.yaml: train.on_nonfinite: 'ignore' is not one of error | skip"]
    assert snapshot(outputs) == before


# --- datasets -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_inputs") / "prepared"
    prepare(P.DataParams(), out)
    return out


TINY = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16},
    "diffusion": {"timesteps": 10},
    "train": {"steps": 3, "batch_per_proc": 16, "warmup_steps": 0, "checkpoint_every": 1, "keep_checkpoints": 5,
              "log_every": 1, "ema_rates": [0.9]},
    "introspect": {"every": 0, "steps": []},
    "sample": {"respacing": ""},  # the default ddim50 cannot respace 10 timesteps
    "evaluator": {"epochs": 1},
}


def _set_manifest(d: Path, **changes) -> None:
    """Rewrites manifest.json with `changes` and checksums that match the files as they are now."""
    from ddpmrepro.data.shards import split_digest

    m = json.loads((d / "manifest.json").read_text())
    m.update(changes)
    m["files"] = {name: sha256(d / name) for name in m["files"]}
    for entry in m["splits"].values():
        entry["sha256"] = split_digest(entry["shards"], m["files"])
    (d / "manifest.json").write_text(json.dumps(m))


def _truncate(d: Path):
    blob = (d / "train-00000.images.npy").read_bytes()
    (d / "train-00000.images.npy").write_bytes(blob[: len(blob) // 2])


def _flip_a_bit(d: Path):
    blob = bytearray((d / "test-00000.images.npy").read_bytes())
    blob[len(blob) // 2] ^= 1
    (d / "test-00000.images.npy").write_bytes(bytes(blob))


def _garbage_with_matching_checksum(d: Path):
    (d / "train-00000.images.npy").write_bytes(b"\x93NUMPY not an array at all")
    _set_manifest(d)


def _empty(d: Path):
    """A well-formed prepared directory with no training images."""
    shape = np.load(d / "train-00000.images.npy", mmap_mode="r").shape[1:]
    np.save(d / "train-00000.images.npy", np.zeros((0, *shape), np.uint8))
    np.save(d / "train-00000.labels.npy", np.zeros(0, np.int64))
    m = json.loads((d / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["count"] = m["splits"]["train"]["count"] = 0
    _set_manifest(d, counts={**m["counts"], "train": [0] * m["num_classes"]}, splits=m["splits"])


def _format_1(d: Path):
    """What the previous version of prepare wrote: train.npz, test.npz and a version-1 manifest."""
    for f in d.iterdir():
        f.unlink()
    for split in ("train", "test"):
        np.savez(d / f"{split}.npz", images=np.zeros((4, 1, 8, 8), np.uint8), labels=np.zeros(4, np.int64))
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "files": {}}))


DATA_CASES = {
    "missing": (lambda d: shutil.rmtree(d), "manifest.json: not found"),
    "empty-directory": (lambda d: [f.unlink() for f in d.iterdir()], "manifest.json: not found"),
    "empty-split": (_empty, "the train split is empty"),
    "manifest-not-json": (lambda d: (d / "manifest.json").write_text("{not json"), "manifest.json: unreadable"),
    "missing-shard": (lambda d: (d / "train-00000.labels.npy").unlink(), "train-00000.labels.npy: not found"),
    "truncated-shard": (_truncate, "train-00000.images.npy: sha256 does not match manifest.json"),
    "flipped-bit": (_flip_a_bit, "test-00000.images.npy: sha256 does not match manifest.json"),
    "not-an-npy": (_garbage_with_matching_checksum, "train-00000.images.npy: not a prepared shard"),
    "format-1": (_format_1, "format version 1 (train.npz, test.npz), which this code no longer reads; run "
                            "`ddpmrepro prepare`"),
}


@pytest.mark.parametrize("stage", ["train", "fit-evaluator"])
@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_missing_empty_or_corrupt_data_is_one_line_and_touches_nothing(outputs, prepared, stage, case):
    shutil.rmtree(outputs / "data")
    shutil.copytree(prepared, outputs / "data")
    damage, words = DATA_CASES[case]
    damage(outputs / "data")
    (outputs / "params.yaml").write_text(yaml.safe_dump(TINY))
    before = snapshot(outputs)
    result = cli(stage, "--params", "params.yaml", *STAGE_ARGS[stage])
    assert_one_line_error(result, 1, words)
    assert snapshot(outputs) == before


def test_an_empty_dataset_source_is_one_line_and_keeps_the_prepared_data(outputs):
    (outputs / "raw").mkdir()
    (outputs / "params.yaml").write_text(yaml.safe_dump({"data": {"source": "image_folder", "root": "raw"}}))
    before = snapshot(outputs)
    assert_one_line_error(cli("prepare", "--params", "params.yaml", *STAGE_ARGS["prepare"]), 1, "raw: no class sub-folders")
    assert snapshot(outputs) == before


def test_a_gzip_with_a_corrupt_deflate_stream_is_one_line_naming_it(outputs):
    """A downloaded MNIST .gz damaged inside its compressed data (zlib.error, not an OSError)."""
    from fake_datasets import fake_mnist

    fake_mnist(outputs / "raw", "MNIST", n_train=20, n_test=10, gz_only=True)
    gz = outputs / "raw" / "MNIST" / "raw" / "train-images-idx3-ubyte.gz"
    blob = bytearray(gz.read_bytes())
    start = blob.index(b"\0", 10) + 1 if blob[3] & 0x08 else 10  # after the header (and the stored file name)
    blob[start] = 0xFF  # the first deflate block header: final block of the reserved type 3
    gz.write_bytes(bytes(blob))
    (outputs / "params.yaml").write_text(yaml.safe_dump({"data": {"source": "mnist", "root": "raw", "image_size": 28}}))
    before = snapshot(outputs)
    line = assert_one_line_error(cli("prepare", "--params", "params.yaml", *STAGE_ARGS["prepare"]), 1,
                                 "raw/MNIST/raw/train-images-idx3-ubyte.gz: not a valid gzip file",
                                 "delete it and download it again")
    assert "invalid block type" in line
    assert snapshot(outputs) == before


def test_a_file_that_is_not_an_image_is_named_and_said_so(outputs):
    """Not Pillow's `cannot identify image file <_io.BytesIO object at 0x...>`."""
    from fake_datasets import fake_image_folder

    fake_image_folder(outputs / "raw", classes=("a", "b"), per_class=3, size=(8, 8))
    (outputs / "raw" / "b" / "001.png").write_text("a text file saved with the wrong extension\n")
    (outputs / "params.yaml").write_text(yaml.safe_dump({"data": {"source": "image_folder", "root": "raw"}}))
    before = snapshot(outputs)
    line = assert_one_line_error(cli("prepare", "--params", "params.yaml", *STAGE_ARGS["prepare"]), 1,
                                 "raw/b/001.png: not an image file", "remove it or replace it with an image")
    assert "0x" not in line and "BytesIO" not in line and "object" not in line
    assert snapshot(outputs) == before


# --- checkpoints --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prepared, one_thread) -> Path:
    """A finished 3-step run with a checkpoint at every step; tests damage copies of it."""
    root = tmp_path_factory.mktemp("trained")
    shutil.copytree(prepared, root / "data")
    (root / "params.yaml").write_text(yaml.safe_dump(TINY))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert cli("train", "--params", "params.yaml", *STAGE_ARGS["train"]).exit_code == 0
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture
def run(trained, tmp_path, monkeypatch) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    monkeypatch.chdir(tmp_path / "run")
    return tmp_path / "run"


def newest(run: Path) -> Path:
    (ckpt_dir,) = (run / "ckpt").glob("*/*")
    return latest_checkpoint(ckpt_dir)


class Payload:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_payload(path: Path):
    state = torch.load(path, weights_only=True)
    with open(path, "wb") as f:
        torch.save({**state, "extra": Payload(Path.cwd() / "pwned")}, f, pickle_module=pickle)
    path.with_suffix(".sha256").write_text(sha256(path) + "\n")  # even with a matching sidecar


def _flip_a_byte(path: Path):
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 1
    path.write_bytes(bytes(blob))


def _foreign(path: Path):
    """A valid checkpoint of another run, saved in this run's place (sidecar and all)."""
    state = torch.load(path, weights_only=True)
    save_checkpoint({**state, "run_hash": "0123456789abcdef"}, path.parent, int(state["step"]), keep=5)


def _not_a_training_state(path: Path):
    save_checkpoint({"step": 3, "weights": torch.zeros(2)}, path.parent, 3, keep=5)


def _resigned(path: Path, **changes):
    """This run's own checkpoint with `changes`, saved in its place with a matching sidecar: what a
    user editing a checkpoint, or a foreign tool, leaves."""
    state = torch.load(path, weights_only=True)
    save_checkpoint({**state, **{k: f(state) for k, f in changes.items()}}, path.parent, int(state["step"]), keep=5)


def _one_param_group_more(state):
    groups = state["optimizer"]["param_groups"]
    return {**state["optimizer"], "param_groups": [*groups, {**groups[0], "params": []}]}


def _averages_changed(key: str, change):
    """The checkpoint's `key` (ema or phema) with `change` applied to the first tensor of its first
    average."""
    def edit(state):
        averages = dict(state[key]["averages"])
        first = next(iter(averages))
        avg = dict(averages[first])
        name = next(iter(avg))
        averages[first] = {**avg, name: change(avg[name])}
        return {**state[key], "averages": averages}
    return edit


CHECKPOINT_CASES = {
    # it resumed "from step 100" and exported the step-3 state as the finished model, exit 0
    "step-not-its-name": (lambda p: _resigned(p, step=lambda s: 100), "holds step 100, but its name says"),
    "step-a-string": (lambda p: _resigned(p, step=lambda s: "abc"), "holds step 'abc', but its name says"),
    "optimizer-of-another-shape": (lambda p: _resigned(p, optimizer=_one_param_group_more),
                                   "its optimizer state does not fit this run"),
    # both loaded silently; the first EMA update after the resume failed inside torch
    "phema-average-of-another-shape": (lambda p: _resigned(p, phema=_averages_changed("phema", lambda v: v[:1])),
                                       "its phema state does not fit this run (the average's "),
    "ema-average-in-fp16": (lambda p: _resigned(p, ema=_averages_changed("ema", lambda v: v.half())),
                            "torch.float16; it must be"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "sha256 mismatch"),
    "flipped-bit": (_flip_a_byte, "sha256 mismatch"),
    "wrong-sidecar": (lambda p: p.with_suffix(".sha256").write_text("0" * 64 + "\n"), "sha256 mismatch"),
    "pickle-payload": (_pickle_payload, "refused to load"),
    "other-run": (_foreign, "belongs to run 0123456789abcdef"),
    "not-a-training-state": (_not_a_training_state, "not a training checkpoint"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_damaged_checkpoint_is_refused_in_one_line_and_nothing_is_touched(run, case):
    damage, words = CHECKPOINT_CASES[case]
    bad = newest(run)
    damage(bad)
    before = snapshot(run)
    assert_one_line_error(cli("train", "--params", "params.yaml", *STAGE_ARGS["train"]), 1,
                          f"Error: {bad.relative_to(run)}: ", words)
    assert snapshot(run) == before
    assert not (run / "pwned").exists()  # the payload never ran


@pytest.mark.slow
def test_deleting_a_refused_checkpoint_resumes_from_the_one_before_to_the_same_weights(run, trained, one_thread):
    bad = newest(run)
    bad.write_bytes(bad.read_bytes()[:1000])
    result = cli("train", "--params", "params.yaml", *STAGE_ARGS["train"])
    assert "delete it to resume from an earlier checkpoint" in result.stderr
    bad.unlink()  # as the message says
    shutil.rmtree(run / "model")
    assert cli("train", "--params", "params.yaml", *STAGE_ARGS["train"]).exit_code == 0
    for name in ("model.safetensors", "ema_0.9.safetensors"):
        assert (run / "model" / name).read_bytes() == (trained / "model" / name).read_bytes()


@pytest.mark.slow
def test_an_ema_rate_that_was_not_trained_is_a_params_error(run):
    (run / "params.yaml").write_text(yaml.safe_dump({**TINY, "sample": {"ema_rate": 0.5, "respacing": ""}}))
    before = snapshot(run)
    assert_one_line_error(cli("sample", "--params", "params.yaml", *STAGE_ARGS["sample"]), 2,
                          "Error: sample.ema_rate=0.5 was not trained; available: 0.9 (or 0 for raw weights)")
    assert snapshot(run) == before


def _other_runs_snapshot(phema: Path):
    from ddpmrepro.files import load_weights, save_weights, sha256
    from ddpmrepro.model_dir import add_to_manifest, snapshot_metadata

    path = phema / "step_000000002-sigma_0.1.safetensors"
    save_weights(load_weights(path), path, metadata=snapshot_metadata(sigma_rel=0.1, step=2, updates=2,
                                                                      run_hash="0123456789abcdef"))
    add_to_manifest(phema, {path.name: sha256(path)})  # a whole snapshot of another run, with its sum


SNAPSHOT_CASES = {  # (damage to model/phema, sample.ema_length, the words of the one line)
    "no-snapshots": (shutil.rmtree, 0.1, "holds no post-hoc EMA snapshots"),
    "missing": (lambda d: (d / "step_000000002-sigma_0.05.safetensors").unlink(), 0.1,
                "step_000000002-sigma_0.05.safetensors is missing (1 of 6 snapshots)"),
    "other-run": (_other_runs_snapshot, 0.1, "is a snapshot of run 0123456789abcdef, not of this model's run"),
    "cannot-reconstruct": (lambda d: None, 0.01, "make it only to a profile error of"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SNAPSHOT_CASES))
def test_post_hoc_ema_snapshots_that_cannot_make_the_length_are_one_line_exit_2(run, case):
    """Missing, foreign or too few snapshots for `sample.ema_length`: exit 2, nothing written."""
    damage, length, words = SNAPSHOT_CASES[case]
    damage(run / "model" / "phema")
    (run / "params.yaml").write_text(yaml.safe_dump({**TINY, "sample": {"ema_length": length, "respacing": ""}}))
    before = snapshot(run)
    assert_one_line_error(cli("sample", "--params", "params.yaml", *STAGE_ARGS["sample"]), 2,
                          f"Error: sample.ema_length={length:g}: ", words)
    assert snapshot(run) == before


@pytest.mark.slow
@pytest.mark.parametrize("where", ["params", "model"])
def test_an_ema_step_with_no_snapshots_is_one_line_exit_2(run, where):
    """`sample.ema_step` off the snapshot steps: refused by params.yaml's own train section, or, where
    params.yaml says 6 steps (step 4 has snapshots) but the model was trained for 3, by the model's."""
    train = {**TINY["train"], "steps": 6} if where == "model" else TINY["train"]
    (run / "params.yaml").write_text(yaml.safe_dump({**TINY, "train": train,
                                                     "sample": {"ema_length": 0.1, "ema_step": 4, "respacing": ""}}))
    before = snapshot(run)
    assert_one_line_error(cli("sample", "--params", "params.yaml", *STAGE_ARGS["sample"]), 2,
                          "Error: " + ("params.yaml: " if where == "params" else "") +
                          "sample.ema_step: 4 is not a step with post-hoc EMA snapshots (train.steps 3,",
                          "the nearest: 3, or 0 for the last")
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_second_process_training_the_same_run_waits_for_the_first_and_takes_what_it_left(run, tmp_path):
    """Refused before, it failed one queued experiment in four of the README's sweep (two guidance
    values of one lr share a training run; `dvc queue start -j 2` ran them together; found from
    outside). Now it waits, says for whom in one line, writes nothing meanwhile, and once the lock is
    free resumes the run, here finished: the same model, bit for bit."""
    import time

    (ckpt_dir,) = (run / "ckpt").glob("*/*")
    before = snapshot(run)
    log = tmp_path / "second.err"
    with RunLock(ckpt_dir), open(log, "w") as err:  # this process is "training" into it
        proc = subprocess.Popen([sys.executable, "-m", "ddpmrepro.cli", "train", "--params", "params.yaml",
                                 *STAGE_ARGS["train"]], stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=run,
                                # No core slots: another ddpmrepro job on this machine would make it wait first.
                                env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", **INDUCTOR_CACHE, "OMP_NUM_THREADS": "1",
                                     "DDPMREPRO_CPU_SLOTS": "0"})
        try:
            deadline = time.monotonic() + 300  # importing torch on a loaded 2-core machine: seconds, not minutes
            while "waiting for process" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            said = log.read_text()
            assert proc.poll() is None, f"it did not wait (exit {proc.returncode}): {said[-2000:]}"
            assert said.splitlines() == [f"waiting for process {os.getpid()}, which is training this same run (params, "
                                         f"data and code) into {ckpt_dir.relative_to(run)}: its checkpoints are this "
                                         "run's"], said[-2000:]
            time.sleep(3)  # still waiting, and nothing written
            assert proc.poll() is None and snapshot(run) == before
        except BaseException:
            proc.kill()
            raise
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert "run found finished at step 3" in log.read_text() and "resuming" not in log.read_text()
    after = snapshot(run)
    assert {k: v for k, v in after.items() if k.startswith("model/")} == \
        {k: v for k, v in before.items() if k.startswith("model/")}
    assert [p.name for p in list_checkpoints(ckpt_dir)][-1] == "step_000000003.pt"  # resumed the finished run


def test_a_batch_larger_than_the_data_is_one_line_before_anything_is_written(outputs, prepared):
    shutil.rmtree(outputs / "data")
    shutil.copytree(prepared, outputs / "data")
    (outputs / "params.yaml").write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "batch_per_proc": 5000}}))
    before = snapshot(outputs)
    assert_one_line_error(cli("train", "--params", "params.yaml", *STAGE_ARGS["train"]), 2,
                          "train.batch_per_proc=5000 is larger than this rank's 1438 training images")
    assert snapshot(outputs) == before


# Checks that need the model (introspection patterns against its names) came after the run directory
# and its lock were created (issue 17, item 4).
PATTERN_CASES = {
    "bad-regex": ({"params": ["re:("]}, "introspect.params: introspect pattern 're:(' is not a valid regular expression"),
    "no-such-parameter": ({"params": ["nope.*"]}, "introspect.params: introspect pattern 'nope.*' matches no parameter"),
    "no-such-module": ({"modules": ["no_such_module.*"]},
                       "introspect.modules: introspect pattern 'no_such_module.*' matches no module"),
    "dump-not-recorded": ({"modules": ["input_blocks.*"], "dump_modules": ["out"], "dump_steps": [1]},
                          "introspect.dump_modules: ['out'] are not among the modules introspect.modules records"),
    "no-such-dump-module": ({"dump_modules": ["nope"], "dump_steps": [1]},
                            "introspect.dump_modules: introspect pattern 'nope' matches no module"),
}


@pytest.mark.parametrize("case", sorted(PATTERN_CASES))
def test_an_introspection_pattern_that_fits_nothing_is_refused_before_the_run_directory_exists(trainable, case):
    changes, words = PATTERN_CASES[case]
    (trainable / "params.yaml").write_text(yaml.safe_dump({**TINY, "introspect": {**TINY["introspect"], **changes}}))
    shutil.rmtree(trainable / "ckpt")  # no run yet: nothing of it may appear
    before = snapshot(trainable)
    assert_one_line_error(cli("train", "--params", "params.yaml", *STAGE_ARGS["train"]), 2, f"Error: {words}")
    assert snapshot(trainable) == before and not (trainable / "ckpt").exists()  # no <hash>/<version>/, no lock


# --- unwritable outputs -------------------------------------------------------------------------------

# Every output option of every stage, with the kind of output behind it.
OUTPUT_OPTIONS = [("prepare", "--out"), ("fit-evaluator", "--out"), ("train", "--out"), ("train", "--live"),
                  ("train", "--introspect"), ("train", "--checkpoints"), ("sample", "--out"), ("evaluate", "--out"),
                  ("evaluate", "--detail"), ("report", "--out")]


def with_option(stage: str, option: str, value: str) -> list[str]:
    args = list(STAGE_ARGS[stage])
    args[args.index(option) + 1] = value
    return args


@pytest.fixture
def trainable(outputs, prepared) -> Path:
    """The earlier outputs, with real prepared data and tiny params: a stage that did not check its
    outputs first would do all its work (train 3 steps) before failing."""
    shutil.rmtree(outputs / "data")
    shutil.copytree(prepared, outputs / "data")
    (outputs / "params.yaml").write_text(yaml.safe_dump(TINY))
    return outputs


def test_every_stage_has_its_outputs_covered():
    for stage, args in STAGE_ARGS.items():
        outs = {o for s, o in OUTPUT_OPTIONS if s == stage}
        assert outs and outs <= set(args), stage


@pytest.mark.parametrize("stage, option", OUTPUT_OPTIONS)
def test_an_output_below_a_file_is_one_line_before_any_work(trainable, stage, option):
    # e.g. `ddpmrepro train --out README.md/model` trained every step, then failed with NotADirectoryError.
    before = snapshot(trainable)
    result = cli(stage, "--params", "params.yaml", *with_option(stage, option, "params.yaml/sub"))
    assert_one_line_error(result, 1, f"Error: {option} params.yaml/sub: params.yaml is a file, not a directory")
    assert snapshot(trainable) == before  # nothing trained: no checkpoint directory either


@pytest.mark.parametrize("stage, option", [(s, o) for s, o in OUTPUT_OPTIONS if s != "evaluate"])
def test_a_file_where_an_output_directory_belongs_is_one_line(trainable, stage, option):
    before = snapshot(trainable)
    result = cli(stage, "--params", "params.yaml", *with_option(stage, option, "metrics.json"))
    assert_one_line_error(result, 1, f"Error: {option} metrics.json: is a file; a directory is needed")
    assert snapshot(trainable) == before


# The options whose directory a stage replaces whole (the others write files into theirs).
REPLACED_DIRS = [(s, o) for s, o in OUTPUT_OPTIONS if (s, o) not in {("train", "--checkpoints"), ("evaluate", "--out"),
                                                                     ("evaluate", "--detail")}]


@pytest.mark.parametrize("stage, option", REPLACED_DIRS)
def test_an_output_option_at_a_directory_it_would_destroy_is_one_line_before_any_work(trainable, stage, option):
    """A stage replaces its output directory whole, deleting the old one: `export --out .` once
    deleted the project, `sample --out model` the trained model. Refused, before any work, for a
    folder of other files, for the working directory, and for another stage's output."""
    (trainable / "thesis").mkdir()
    (trainable / "thesis" / "chapter1.tex").write_text("years of work")
    before = snapshot(trainable)
    result = cli(stage, "--params", "params.yaml", *with_option(stage, option, "thesis"))
    assert_one_line_error(result, 1, f"Error: {option} thesis: is not empty and is not a",
                          "name a new or empty directory, or remove this one first")
    result = cli(stage, "--params", "params.yaml", *with_option(stage, option, "."))
    assert_one_line_error(result, 1, f"Error: {option} .: is the working directory; ")
    other = "model" if (stage, option) != ("train", "--out") else "samples"
    result = cli(stage, "--params", "params.yaml", *with_option(stage, option, other))
    assert_one_line_error(result, 1, f"Error: {option} {other}: is not empty and is not a")
    assert snapshot(trainable) == before  # nothing trained, sampled or written


def test_an_empty_directory_or_an_earlier_output_of_the_kind_is_replaced(trainable):
    (trainable / "empty").mkdir()
    assert cli("prepare", "--params", "params.yaml", "--out", "empty").exit_code == 0
    assert (trainable / "empty" / "manifest.json").is_file()
    assert cli("prepare", "--params", "params.yaml", "--out", "empty").exit_code == 0  # now a prepared dataset


def run_with_tmpfs(root: Path, mnt: Path, options: str, commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Runs each command in `root` with a tmpfs mounted on `mnt` with `options` (e.g. `ro`), in a
    mount namespace of the commands' own (root with CAP_SYS_ADMIN only)."""
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", **INDUCTOR_CACHE, "OMP_NUM_THREADS": "1"}
    if os.geteuid() != 0 or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN")
    driver = ("import json, subprocess, sys\n"
              f"subprocess.run(['mount', '-t', 'tmpfs', '-o', {options!r}, 'tmpfs', {str(mnt)!r}], check=True)\n"
              f"out = [subprocess.run(c, capture_output=True, text=True) for c in {commands!r}]\n"
              "print(json.dumps([[p.returncode, p.stdout, p.stderr] for p in out]))\n")
    proc = subprocess.run(["unshare", "--mount", sys.executable, "-c", driver], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    return [subprocess.CompletedProcess(c, rc, out, err) for c, (rc, out, err) in zip(commands, json.loads(proc.stdout))]


def run_with_read_only_dir(root: Path, ro: Path, commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Runs each command in `root` while `ro` is a directory no file can be created in, really:
    permission bits for a normal user; for root, who ignores them, a read-only mount."""
    ro.mkdir()
    if os.geteuid() == 0:
        return run_with_tmpfs(root, ro, "ro,size=1m", commands)
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", **INDUCTOR_CACHE, "OMP_NUM_THREADS": "1"}
    ro.chmod(0o555)
    try:
        return [subprocess.run(c, cwd=root, env=env, capture_output=True, text=True, timeout=300) for c in commands]
    finally:
        ro.chmod(0o755)


def test_an_output_in_a_read_only_directory_is_one_line_before_any_work(trainable):
    before = snapshot(trainable)
    commands = [[sys.executable, "-m", "ddpmrepro.cli", stage, "--params", "params.yaml",
                 *with_option(stage, option, f"ro/{option[2:]}")] for stage, option in OUTPUT_OPTIONS]
    for (stage, option), proc in zip(OUTPUT_OPTIONS, run_with_read_only_dir(trainable, trainable / "ro", commands)):
        assert proc.returncode == 1 and proc.stdout == "", (stage, option, proc.stderr)
        (line,) = proc.stderr.splitlines()
        assert line.startswith(f"Error: {option} ro/{option[2:]}: cannot create files in ro ("), line
    after = snapshot(trainable)
    assert after.pop("ro") is None and after == before  # and ro/ stayed empty


def test_a_write_that_fails_midway_is_one_line_naming_the_file(trainable):
    # The check before the work passes (the directory is writable); then the disk fills up.
    (trainable / "full").mkdir()
    cmd = [sys.executable, "-m", "ddpmrepro.cli", "prepare", "--params", "params.yaml", "--out", "full/prepared"]
    (proc,) = run_with_tmpfs(trainable, trainable / "full", "size=16k", [cmd])
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.splitlines()
    # prepare estimates its output and refuses before decoding anything (ddpmrepro.data.prepared).
    assert line.startswith("Error: full/prepared: no space left on the device for the prepared data (it needs "), line


@pytest.mark.parametrize("size, posthoc", [("64k", True), ("300k", True), ("300k", False)])
def test_a_full_disk_under_the_checkpoints_is_one_line_naming_the_file(trainable, size, posthoc):
    """torch.save and safetensors report a full disk in their own words, not as an OSError: a
    traceback through the post-hoc EMA snapshot (SafetensorError), or `[enforce fail at
    inline_container.cc] unexpected pos ...` naming no file (found from outside)."""
    (trainable / "full").mkdir()
    if not posthoc:  # no snapshots: the checkpoint's torch.save is the first write to fail
        (trainable / "params.yaml").write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "posthoc_ema": []}}))
    cmd = [sys.executable, "-m", "ddpmrepro.cli", "train", "--params", "params.yaml",
           *with_option("train", "--checkpoints", "full/ckpt")]
    (proc,) = run_with_tmpfs(trainable, trainable / "full", f"size={size}", [cmd])
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert line.startswith("Error: full/ckpt/") and line.endswith(": No space left on device"), line
