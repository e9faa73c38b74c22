"""The training engine against invariants, with real processes (torchrun + gloo on CPU).

- 2 processes x batch B make the same updates as 1 process x batch 2B;
- N steps straight == N/2 steps + SIGKILL + resume, bitwise, with 1 and with 2 processes;
- an fp16 overflow step is skipped and lowers the loss scale.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddpmrepro import params as P
from ddpmrepro.files import load_weights
from ddpmrepro.training.checkpoint import latest_checkpoint, load_checkpoint
from ddpmrepro.data import prepare

SRC = Path(__file__).resolve().parents[1] / "src"


def _load_kill_tree():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kill_train", SRC.parent / "scripts" / "kill_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kill_tree


kill_tree = _load_kill_tree()
# A small, fast configuration; dropout 0 so that masks (per-rank RNG) play no part.
SMALL = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16, "dropout": 0.0},
    "diffusion": {"timesteps": 10},
    "train": {"steps": 8, "batch_per_proc": 16, "warmup_steps": 2, "checkpoint_every": 4, "log_every": 2,
              "timestep_sampler": "loss-second-moment", "ema_rates": [0.9, 0.99], "label_dropout": 0.2},
    "introspect": {"every": 2, "steps": []},
    "sample": {"respacing": "ddim5"},  # the default ddim50 cannot respace 10 timesteps
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(P.DataParams(), out)
    return out


def write_params(path: Path, **overrides) -> Path:
    raw = {k: dict(v) for k, v in SMALL.items()}
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(raw))
    return path


def train_cmd(run_dir: Path, data: Path, params: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "ddpmrepro.cli", "train", "--params", str(params), "--data", str(data),
            "--out", str(run_dir / "model"), "--live", str(run_dir / "live"),
            "--introspect", str(run_dir / "introspect"), "--checkpoints", str(run_dir / "ckpt"),
            "--nproc", str(nproc)]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def run_train(run_dir: Path, data: Path, params: Path, nproc: int) -> None:
    proc = subprocess.run(train_cmd(run_dir, data, params, nproc), env=env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def final_state(run_dir: Path) -> dict:
    # <params+data hash>/<code version>; not Inductor's cache of a compiled run (train.compile)
    (ckpt_dir,) = (d for d in (run_dir / "ckpt").glob("*/*") if d.parent.name != "inductor-cache")
    state = load_checkpoint(latest_checkpoint(ckpt_dir))
    weights = load_weights(run_dir / "model" / "model.safetensors")
    emas = {r: load_weights(run_dir / "model" / f"ema_{r}.safetensors") for r in ("0.9", "0.99")}
    # the post-hoc EMA's snapshots (SMALL's 8 steps: one after every step) count as EMAs here
    emas |= {f.name: load_weights(f) for f in sorted((run_dir / "model" / "phema").glob("step_*"))}
    assert len(emas) == 2 + 2 * state["step"]
    return {"step": state["step"], "weights": weights, "emas": emas, "sampler": state["sampler"]}


def assert_same(a: dict, b: dict, exact: bool, skip: frozenset = frozenset()) -> None:
    def same(x, y):
        return torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1e-3, atol=5e-4)

    assert a["step"] == b["step"]
    for k in a["weights"]:
        assert k in skip or same(a["weights"][k], b["weights"][k]), k
    for r in a["emas"]:
        for k in a["emas"][r]:
            assert k in skip or same(a["emas"][r][k], b["emas"][r][k]), (r, k)
    for k in a["sampler"]:
        assert same(a["sampler"][k].double(), b["sampler"][k].double()), k


@pytest.mark.slow
def test_two_processes_equal_one_process_with_double_batch(tmp_path, prepared):
    one = write_params(tmp_path / "one.yaml", train={"batch_per_proc": 16, "nproc": 1, "steps": 16},
                       introspect={"steps": [1]})
    two = write_params(tmp_path / "two.yaml", train={"batch_per_proc": 8, "nproc": 2, "steps": 16},
                       introspect={"steps": [1]})
    run_train(tmp_path / "one", prepared, one, nproc=1)
    def left_in_tmp():  # (another run's kept log on this machine is not this run's)
        return {*Path(tempfile.gettempdir()).glob("torchelastic_*"),
                *Path(tempfile.gettempdir()).glob(f"ddpmrepro-torchrun-*@{socket.gethostname()}-*")}
    before = left_in_tmp()
    run_train(tmp_path / "two", prepared, two, nproc=2)
    # torchrun's own log directory went into the agent's work directory, which is gone: nothing left in /tmp
    assert left_in_tmp() == before
    # The all-reduced gradients (recorded per parameter after backward, before clipping) equal
    # those of one process on the whole batch: exactly the first time, to float tolerance later.
    import pandas as pd

    ga = pd.read_parquet(tmp_path / "one" / "introspect" / "param_grads").set_index(["step", "name"]).sort_index()
    gb = pd.read_parquet(tmp_path / "two" / "introspect" / "param_grads").set_index(["step", "name"]).sort_index()
    assert ga.index.equals(gb.index)
    first = ga.index.get_level_values("step") == 1  # the first update
    nonzero = ga["grad_norm"] > 0
    rel = (ga["grad_norm"] - gb["grad_norm"]).abs() / ga["grad_norm"].where(nonzero)
    assert rel[first & nonzero].max() < 1e-5
    for step, a_step in ga["grad_norm"].groupby(level="step"):
        b_step = gb["grad_norm"].loc[step]
        assert ((a_step - b_step) ** 2).sum() ** 0.5 < 1e-2 * (a_step**2).sum() ** 0.5, step
    # Weights, EMAs and the importance sampler's history agree at float tolerance (Adam
    # amplifies rounding differences a little over 16 steps).
    # Except where the true gradient is exactly zero: a conv bias followed by a GroupNorm with one
    # channel per group (16 channels, 32 groups asked) is removed by that norm. There the gradient
    # is rounding noise (1e-11..1e-8 against a total norm near 1), different in each run, and Adam,
    # being scale-free, turns any noise into steps of size lr: those weights cannot agree.
    total = ga["grad_norm"].pow(2).groupby(level="step").sum().pow(0.5)
    rel_a = ga["grad_norm"].div(total, level="step").groupby(level="name").max()
    rel_b = gb["grad_norm"].div(total, level="step").groupby(level="name").max()
    zero_grad = frozenset(rel_a.index[rel_a < 1e-6])
    assert set(rel_b.index[rel_b < 1e-6]) == zero_grad  # the same parameters in both runs
    assert zero_grad and all(k.endswith(".bias") for k in zero_grad) and len(zero_grad) < 0.1 * len(rel_a)
    a, b = final_state(tmp_path / "one"), final_state(tmp_path / "two")
    assert bool((a["sampler"]["loss_counts"] == 10).all())  # left its uniform phase
    assert_same(a, b, exact=False, skip=zero_grad)
    # and the runs did move the weights (the output conv starts at zero)
    assert any(v.abs().sum() > 0 for k, v in a["weights"].items() if k.startswith("out."))


def kill_after_checkpoint(run_dir: Path, data: Path, params: Path, nproc: int, step: int) -> None:
    """Starts training, SIGKILLs its whole process group once checkpoint `step` is complete."""
    proc = subprocess.Popen(train_cmd(run_dir, data, params, nproc), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list((run_dir / "ckpt").glob(f"*/*/step_{step:09d}.sha256")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training finished before it could be killed: " + proc.stderr.read().decode()[-2000:]
    kill_tree(proc)  # the launcher and all its workers at once, as a cgroup kill does
    assert not (run_dir / "model").exists()


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, prepared):
    """Uninterrupted runs of SMALL with 1 or 2 processes (global batch 16), made once per module:
    what killed, resumed and restarted runs must equal bitwise."""
    runs = {}

    def get(nproc: int) -> Path:
        if nproc not in runs:
            runs[nproc] = tmp_path_factory.mktemp(f"straight{nproc}")
            params = write_params(runs[nproc] / "p.yaml", train={"nproc": nproc, "batch_per_proc": 16 // nproc})
            run_train(runs[nproc], prepared, params, nproc)
        return runs[nproc]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_kill_and_resume_is_bitwise_identical(tmp_path, prepared, straight_runs, nproc):
    params = write_params(tmp_path / "p.yaml", train={"nproc": nproc, "batch_per_proc": 16 // nproc})
    kill_after_checkpoint(tmp_path / "resumed", prepared, params, nproc, step=4)
    run_train(tmp_path / "resumed", prepared, params, nproc)
    assert_same(final_state(straight_runs(nproc)), final_state(tmp_path / "resumed"), exact=True)
    # The exported model directory, config.json included, is byte for byte the uninterrupted run's:
    # nothing in it measures time, so a rerun of the train stage gives DVC the same hash.
    def files(model: Path) -> dict[str, bytes]:
        return {f.relative_to(model).as_posix(): f.read_bytes() for f in sorted(model.rglob("*")) if f.is_file()}
    exported = files(tmp_path / "resumed" / "model")
    assert files(straight_runs(nproc) / "model") == exported
    # So does a rerun with no step left (`dvc repro -f`): it resumes from the last checkpoint and exports again.
    run_train(tmp_path / "resumed", prepared, params, nproc)
    assert files(tmp_path / "resumed" / "model") == exported
    assert json.loads(exported["config.json"])["final"]["step"] == 8
    # the gradient tables of the resumed run hold every recorded step exactly once
    import pandas as pd

    steps = pd.read_parquet(tmp_path / "resumed" / "introspect" / "steps")["step"].tolist()
    assert sorted(steps) == [2, 4, 6, 8]
    loss = pd.read_csv(tmp_path / "resumed" / "live" / "plots" / "metrics" / "loss.tsv", sep="\t")
    assert loss["step"].tolist() == [2, 4, 6, 8]


@pytest.mark.slow
def test_a_graphed_two_process_run_killed_and_resumed_gives_the_ddp_runs_bits(tmp_path, prepared, straight_runs):
    # train.cuda_graphs has no DDP: one all-reduce of the flat gradient buffer after the backward
    # (on a CPU nothing is captured; the rest of the graphed path runs). With 2 ranks the mean
    # (a/2 + b/2) is DDP's to the bit, so the killed and resumed graphed run equals the eager run.
    params = write_params(tmp_path / "p.yaml", train={"nproc": 2, "batch_per_proc": 8, "cuda_graphs": True})
    kill_after_checkpoint(tmp_path / "graphed", prepared, params, 2, step=4)
    run_train(tmp_path / "graphed", prepared, params, 2)
    assert_same(final_state(straight_runs(2)), final_state(tmp_path / "graphed"), exact=True)


@pytest.mark.gpu
def test_a_captured_run_killed_and_resumed_gives_the_uninterrupted_runs_bits(tmp_path, prepared):
    # On a card, with dropout (the graph's Philox draws at each replay's offset) and bf16: the graph
    # is captured anew after the resume, and the run's bits do not notice. 32 steps (one post-hoc
    # snapshot each, as final_state expects): a card runs SMALL's steps in milliseconds, and the
    # kill must land before the run ends.
    params = write_params(tmp_path / "p.yaml", model={"dropout": 0.2},
                          train={"device": "cuda", "precision": "bf16", "cuda_graphs": True, "steps": 32})
    run_train(tmp_path / "straight", prepared, params, 1)
    kill_after_checkpoint(tmp_path / "resumed", prepared, params, 1, step=4)
    run_train(tmp_path / "resumed", prepared, params, 1)
    assert_same(final_state(tmp_path / "straight"), final_state(tmp_path / "resumed"), exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_grad_checkpointing_on_a_killed_and_resumed_run_gives_the_plain_runs_bits(tmp_path, prepared, nproc):
    # Dropout on, so the recompute must draw the masks the forward drew. The plain run never stops;
    # the checkpointed one is SIGKILLed after step 4 and resumed: the same weights, EMAs, sampler
    # history and gradient tables, bit for bit (with 2 processes too: DDP's all-reduce sees the same
    # gradients, so "2 x B = 1 x 2B" holds with checkpointing as it does without).
    train = {"nproc": nproc, "batch_per_proc": 16 // nproc}
    plain = write_params(tmp_path / "plain.yaml", model={"dropout": 0.2}, train=train)
    ckpt = write_params(tmp_path / "ckpt.yaml", model={"dropout": 0.2, "grad_checkpoint": True}, train=train)
    run_train(tmp_path / "plain", prepared, plain, nproc)
    kill_after_checkpoint(tmp_path / "ckpt", prepared, ckpt, nproc, step=4)
    run_train(tmp_path / "ckpt", prepared, ckpt, nproc)
    assert_same(final_state(tmp_path / "plain"), final_state(tmp_path / "ckpt"), exact=True)
    import pandas as pd

    for table in ("param_grads", "act_grads", "steps"):
        a, b = (pd.read_parquet(tmp_path / run / "introspect" / table) for run in ("plain", "ckpt"))
        cols = list(a.columns)
        a, b = (df.sort_values([c for c in ("step", "name", "module", "tensor") if c in cols]).reset_index(drop=True)
                for df in (a, b))
        pd.testing.assert_frame_equal(a, b, check_exact=True)


def live_series(run: Path) -> dict[str, list[str]]:
    """Every dvclive TSV of a run as its lines, without the wall-clock columns: `timestamp`, and
    images_per_sec, which measures wall time and cannot equal across an interruption."""
    out = {}
    for f in sorted((run / "live" / "plots" / "metrics").rglob("*.tsv")):
        if f.stem != "images_per_sec":
            rows = [line.split("\t") for line in f.read_text().splitlines()]
            keep = [i for i, col in enumerate(rows[0]) if col != "timestamp"]
            out[f.name] = ["\t".join(r[i] for i in keep) for r in rows]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_resumed_between_log_steps_logs_the_same_series(tmp_path, prepared, straight_runs, nproc):
    # Checkpoints every step (operational: the same run as straight_runs); SIGKILL once step 3 is
    # saved, then drop later checkpoints so that the run resumes from step 3, between the log steps
    # 2 and 4: the point at step 4 must still average steps 3 and 4, each rank's sums as they were.
    params = write_params(tmp_path / "p.yaml", train={"nproc": nproc, "batch_per_proc": 16 // nproc,
                                                      "checkpoint_every": 1, "keep_checkpoints": 10})
    run = tmp_path / "resumed"
    kill_after_checkpoint(run, prepared, params, nproc, step=3)
    for f in run.glob("ckpt/*/*/step_*"):
        if int(f.name[5:14]) > 3:
            f.unlink()
    run_train(run, prepared, params, nproc)
    straight = live_series(straight_runs(nproc))
    assert straight["loss.tsv"][0] == "step\tloss" and len(straight["loss.tsv"]) == 5  # logged at 2, 4, 6, 8
    assert {"loss_q0.tsv", "mse.tsv", "vb.tsv", "grad_norm.tsv", "lr.tsv"} <= set(straight)
    assert live_series(run) == straight
    # dvclive's summary, a DVC cached out, holds no timing: byte for byte (its images/s is in the TSV)
    summaries = [(r / "live" / "metrics.json").read_bytes() for r in (run, straight_runs(nproc))]
    assert summaries[0] == summaries[1] and b"images_per_sec" not in summaries[0]
    assert (run / "live" / "plots" / "metrics" / "images_per_sec.tsv").read_text().count("\n") == 5  # 4 logs
    assert_same(final_state(straight_runs(nproc)), final_state(run), exact=True)


@pytest.mark.slow
def test_table_steps_and_dvclive_steps_number_the_same_update(straight_runs):
    # Step N everywhere = after N completed updates: the global grad norm that the steps table
    # records at step N is the one dvclive logs at step N (log_every = every = 2, 8 steps).
    import pandas as pd

    run = straight_runs(1)
    table = pd.read_parquet(run / "introspect" / "steps").set_index("step")["total_grad_norm"].sort_index()
    tsv = pd.read_csv(run / "introspect" / "steps.tsv", sep="\t").set_index("step")["total_grad_norm"]
    live = pd.read_csv(run / "live" / "plots" / "metrics" / "grad_norm.tsv", sep="\t").set_index("step")["grad_norm"]
    assert list(table.index) == list(tsv.index) == list(live.index) == [2, 4, 6, 8]  # the last update included
    assert table.tolist() == tsv.tolist() == live.tolist()  # the same float, not merely close
    assert len(set(table.tolist())) == 4  # four different updates, so a shift by one would show
    # and the checkpoint of the last step is step 8: the state after the update the tables call 8
    (ckpt_dir,) = (run / "ckpt").glob("*/*")
    assert load_checkpoint(latest_checkpoint(ckpt_dir))["step"] == 8


def test_other_introspect_settings_on_a_finished_run_record_again_instead_of_handing_back_its_tables(
        tmp_path, prepared, straight_runs):
    """The tables are made only while training: `introspect.every: 4` on a run finished under 2 found
    its step-8 checkpoint, trained nothing and copied the old tables out, with the new settings in
    config.json. The introspect section is in the run hash: it trains again and records anew, to the
    bits of a run made with those settings from the start. (Not the first run's bits: the activation
    hooks change the order autograd sums some gradients in, so the steps they are on move the last
    bits, which Adam enlarges where a gradient is near zero.)"""
    import pandas as pd

    run = tmp_path / "run"
    shutil.copytree(straight_runs(1), run)
    params = write_params(run / "p.yaml", introspect={"every": 4, "steps": []})
    proc = subprocess.run(train_cmd(run, prepared, params, 1), env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" not in proc.stderr, proc.stderr[-3000:]
    assert pd.read_parquet(run / "introspect" / "steps")["step"].tolist() == [4, 8]
    assert len(list((run / "ckpt").glob("*/*"))) == 2  # the first run's checkpoints are left as they were
    fresh = tmp_path / "fresh"
    run_train(fresh, prepared, params, 1)
    for name in ("model.safetensors", "ema_0.9.safetensors"):
        assert (run / "model" / name).read_bytes() == (fresh / "model" / name).read_bytes()
    assert pd.read_parquet(run / "introspect" / "param_grads").equals(pd.read_parquet(fresh / "introspect" / "param_grads"))


@pytest.mark.slow
def test_another_log_every_on_a_finished_run_says_its_curves_keep_their_cadence(tmp_path, prepared, straight_runs):
    """train.log_every is operational (not hashed): a finished run hands back the curves it logged
    every 2 steps under `log_every: 4`. It says so, and how to get the new cadence: deleting the run
    directory trains again to the same weights, logged every 4."""
    import pandas as pd

    straight = straight_runs(1)
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    params = write_params(run / "p.yaml", train={"log_every": 4})
    proc = subprocess.run(train_cmd(run, prepared, params, 1), env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt_dir,) = (run / "ckpt").glob("*/*")
    assert (f"note: train.log_every is 4, but this run was found finished at step 8 with its curves logged every 2 "
            f"steps (and its final loss the mean of the last 2): nothing is retrained. For the new cadence, delete "
            f"{ckpt_dir} and train again") in proc.stderr, proc.stderr[-3000:]
    assert live_series(run) == live_series(straight)
    shutil.rmtree(ckpt_dir)
    proc = subprocess.run(train_cmd(run, prepared, params, 1), env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "note: train.log_every" not in proc.stderr, proc.stderr[-3000:]
    loss = pd.read_csv(run / "live" / "plots" / "metrics" / "loss.tsv", sep="\t")
    assert loss["step"].tolist() == [4, 8]
    for name in ("model.safetensors", "ema_0.9.safetensors", "ema_0.99.safetensors"):
        assert (run / "model" / name).read_bytes() == (straight / "model" / name).read_bytes(), name


@pytest.mark.slow
def test_a_run_found_finished_under_other_sampling_params_exports_the_same_model_directory(
        tmp_path, prepared, straight_runs):
    """Two experiments of the same training that sample otherwise (the README's sweep over guidance):
    the second finds the run finished and exports it. Its model directory, config.json included, is
    the first one's byte for byte, so DVC's hash is too and bits_per_dim is not run again for it;
    config.json holds the sections train reads, none of the sampling ones."""
    straight = straight_runs(1)
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    params = write_params(run / "p.yaml", sample={"respacing": "ddim10", "guidance": 2.5, "sampler": "ddim"},
                          evaluate={"bpd_images": 7}, report={"top_k": 2},
                          superres={"sample_noise_aug": 0.05, "project": True})
    proc = subprocess.run(train_cmd(run, prepared, params, 1), env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run found finished at step 8" in proc.stderr, proc.stderr[-3000:]

    def files(model: Path) -> dict[str, bytes]:
        return {f.relative_to(model).as_posix(): f.read_bytes() for f in sorted(model.rglob("*")) if f.is_file()}
    assert files(run / "model") == files(straight / "model")
    stored = json.loads((run / "model" / "config.json").read_text())["params"]
    assert list(stored) == list(P.TRAINED_SECTIONS) and list(stored["superres"]) == list(P.SUPERRES_TRAIN_KEYS)
    assert stored["diffusion"]["timesteps"] == 10 and stored["train"]["label_dropout"] == 0.2


@pytest.mark.slow
def test_dump_steps_are_recorded_steps_in_the_same_numbering(tmp_path, prepared):
    # Neither `every` nor `steps` names step 2: a dump step is recorded anyway, tables and dump alike.
    import pandas as pd
    from safetensors import safe_open

    from ddpmrepro.training import loop as T

    params = P.load(write_params(tmp_path / "p.yaml", train={"steps": 3},
                                 introspect={"every": 0, "steps": [], "dump_steps": [2], "dump_modules": ["out"]}))
    T.train(params, T.TrainPaths(prepared, tmp_path / "m", tmp_path / "l", tmp_path / "i", tmp_path / "c"))
    assert pd.read_parquet(tmp_path / "i" / "steps")["step"].tolist() == [2]
    (dump,) = (tmp_path / "i" / "dumps").iterdir()
    assert dump.name == "step-000000002.safetensors"
    with safe_open(dump, "pt") as f:
        assert f.metadata()["step"] == "2" and sorted(f.keys()) == ["out/input/0", "out/output/0"]


@pytest.mark.slow
def test_other_code_version_never_touches_a_checkpoint_and_an_interrupted_one_is_refused(tmp_path, prepared,
                                                                                          monkeypatch):
    from ddpmrepro.training import checkpoint as C
    from ddpmrepro.training import loop as T

    # An interrupted run: its second checkpoint_every=4 window fails at step 6 of 8.
    real, calls = T.diffusion_from_params, [0]

    def failing(*args, **kwargs):
        diffusion = real(*args, **kwargs)
        clean = diffusion.training_losses

        def training_losses(*a, **k):
            calls[0] += 1
            if calls[0] == 6:
                raise RuntimeError("killed")
            return clean(*a, **k)
        diffusion.training_losses = training_losses
        return diffusion

    params = P.load(write_params(tmp_path / "p.yaml"))
    paths = T.TrainPaths(prepared, tmp_path / "m", tmp_path / "l", tmp_path / "i", tmp_path / "c")
    monkeypatch.setattr(T, "diffusion_from_params", failing)
    with pytest.raises(RuntimeError, match="killed"):
        T.train(params, paths)
    monkeypatch.setattr(T, "diffusion_from_params", real)
    (old_dir,) = (tmp_path / "c").glob("*/*")
    old_files = {f.name: f.read_bytes() for f in old_dir.iterdir() if f.is_file()}
    assert "step_000000004.pt" in old_files

    # New code: resuming would mix code versions, so it is refused with what to do.
    monkeypatch.setattr(T, "code_version", lambda: "another-version")
    with pytest.raises(C.CheckpointError, match="--restart"):
        T.train(params, paths)
    # --restart starts over under the new code, in its own directory; the old one is untouched.
    assert T.train(params, paths, restart=True)["step"] == 8
    assert {f.name: f.read_bytes() for f in old_dir.iterdir() if f.is_file()} == old_files
    # A finished run of other code does not block a later code version (what `dvc repro` needs).
    monkeypatch.setattr(T, "code_version", lambda: "a-third-version")
    with pytest.raises(C.CheckpointError):  # the interrupted run of the first code still blocks
        T.train(params, paths)
    import shutil

    shutil.rmtree(old_dir)
    assert T.train(params, paths)["step"] == 8
    assert len(list((tmp_path / "c").glob("*/*"))) == 2



def test_a_run_on_two_nodes_is_its_own_run_not_resumed_or_handed_back_on_one(tmp_path, prepared):
    """train.nproc is per node; the node count multiplies the global batch (so the data order and every
    draw), and `--nnodes` overrides train.nodes. Two "nodes" on this machine (`--nnodes 2`, a static rendezvous
    on localhost) then one node with the same params and directories: the one-node run does not
    hand back the finished two-node run (it trains its own, in its own checkpoint directory, the
    first one's files untouched), and each model's config.json says how many processes trained it.
    On one node the run hash is what it always was."""
    from ddpmrepro.training.loop import run_hash

    params = write_params(tmp_path / "p.yaml", train={"batch_per_proc": 8, "nproc": 1, "steps": 4})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = tmp_path / "run"
    nodes = [subprocess.Popen([*train_cmd(run, prepared, params, 1), "--nnodes", "2", "--node-rank", str(k),
                               "--rdzv", f"127.0.0.1:{port}"], env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in range(2)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    config = json.loads((run / "model" / "config.json").read_text())
    assert config["processes"] == 2
    (two_dir,) = (run / "ckpt").glob("*/*")
    two_files = {f.name: f.read_bytes() for f in two_dir.iterdir() if f.is_file()}
    two_weights = load_weights(run / "model" / "model.safetensors")

    proc = subprocess.run(train_cmd(run, prepared, params, 1), env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" not in proc.stderr and "found finished" not in proc.stderr, proc.stderr[-2000:]
    assert json.loads((run / "model" / "config.json").read_text())["processes"] == 1
    one_weights = load_weights(run / "model" / "model.safetensors")
    assert any(not torch.equal(one_weights[k], two_weights[k]) for k in one_weights)
    assert len(list((run / "ckpt").glob("*/*"))) == 2
    assert {f.name: f.read_bytes() for f in two_dir.iterdir() if f.is_file()} == two_files
    loaded = P.load(params)
    assert run_hash(loaded, "d", processes=1) == run_hash(loaded, "d") != run_hash(loaded, "d", processes=2)
    # train.nodes: 2 is the same run as `--nnodes 2`: the hash counts the processes, not the key
    two = P.load(write_params(tmp_path / "two.yaml", train={"batch_per_proc": 8, "nproc": 1, "steps": 4, "nodes": 2}))
    assert run_hash(two, "d", processes=2) == run_hash(loaded, "d", processes=2)

@pytest.mark.slow
def test_fp16_overflow_step_is_skipped_and_lowers_the_scale(tmp_path, prepared, monkeypatch):
    from ddpmrepro.training import loop as T

    real = T.diffusion_from_params
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        diffusion = real(*args, **kwargs)
        clean = diffusion.training_losses

        def training_losses(*a, **k):
            out = clean(*a, **k)
            calls["n"] += 1
            if calls["n"] == 3:  # the third step overflows
                out = {**out, "loss": out["loss"] * float("inf")}
            return out
        diffusion.training_losses = training_losses
        return diffusion

    monkeypatch.setattr(T, "diffusion_from_params", poisoned)
    params = P.load(write_params(tmp_path / "p.yaml", train={"steps": 4, "precision": "fp16",
                                                               "timestep_sampler": "uniform"},
                                 introspect={"every": 1}))
    paths = T.TrainPaths(prepared, tmp_path / "m", tmp_path / "l", tmp_path / "i", tmp_path / "c")
    T.train(params, paths)
    (ckpt_dir,) = (tmp_path / "c").glob("*/*")
    state = load_checkpoint(latest_checkpoint(ckpt_dir))
    assert state["nonfinite"]["skipped_steps"] == 1
    assert state["scaler"]["scale"] == 65536.0 / 2
    import pandas as pd

    steps = pd.read_parquet(tmp_path / "i" / "steps").sort_values("step")
    assert steps["skipped"].tolist() == [False, False, True, False]
    assert steps["loss_scale"].tolist() == [65536.0, 65536.0, 65536.0, 32768.0]


def test_lr_schedule():
    from ddpmrepro.training.loop import lr_at

    p = P.TrainParams(lr=1.0, warmup_steps=4, steps=14, anneal="linear")
    assert [lr_at(s, p) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, p) == 1.0 and lr_at(9, p) == 0.5 and lr_at(14, p) == 0.0
    assert lr_at(100, P.TrainParams(lr=2.0, warmup_steps=0, anneal="none")) == 2.0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_mixed_precision_trains_and_exports(tmp_path, prepared, precision):
    from ddpmrepro.training import loop as T

    params = P.load(write_params(tmp_path / "p.yaml", train={"steps": 6, "device": "cuda", "precision": precision}))
    paths = T.TrainPaths(prepared, tmp_path / "m", tmp_path / "l", tmp_path / "i", tmp_path / "c")
    summary = T.train(params, paths)
    assert summary["step"] == 6 and summary["loss"] == summary["loss"]  # finite, not NaN
    assert all(torch.isfinite(v).all() for v in load_weights(tmp_path / "m" / "model.safetensors").values())


@pytest.mark.slow
def test_recorded_grad_norms_are_measured_before_clipping(tmp_path, prepared):
    # A threshold far below the gradient norm clips every step; the per-parameter norms must
    # still combine to the unclipped global norm that clip_grad_norm_ returns.
    import pandas as pd

    from ddpmrepro.training import loop as T

    params = P.load(write_params(tmp_path / "p.yaml", train={"steps": 3, "grad_clip": 1e-4},
                                 introspect={"every": 1}))
    paths = T.TrainPaths(prepared, tmp_path / "m", tmp_path / "l", tmp_path / "i", tmp_path / "c")
    T.train(params, paths)
    steps = pd.read_parquet(tmp_path / "i" / "steps").sort_values("step")
    assert steps["clipped"].all()
    assert (steps["total_grad_norm"] > 100 * 1e-4).all()
    grads = pd.read_parquet(tmp_path / "i" / "param_grads")
    from_rows = grads.groupby("step")["grad_norm"].apply(lambda g: float((g**2).sum() ** 0.5))
    assert from_rows.values == pytest.approx(steps["total_grad_norm"].values, rel=1e-5)


def on_rank_in_step_3(rank: int, statements: str) -> str:
    """Python source (for a sitecustomize.py) that makes rank `rank` run `statements` (indented
    lines) at the start of its third training step."""
    return f'''
import os
if os.environ.get("RANK") == "{rank}":
    import ddpmrepro.training.loop as T
    real = T.diffusion_from_params

    def changed(*args, **kwargs):
        diffusion = real(*args, **kwargs)
        clean, calls = diffusion.training_losses, [0]

        def training_losses(*a, **k):
            calls[0] += 1
            if calls[0] == 3:
{statements}
            return clean(*a, **k)
        diffusion.training_losses = training_losses
        return diffusion
    T.diffusion_from_params = changed
'''


def rank1_fails_in_step_3(exception: str) -> str:
    """Python source that makes rank 1's third training step raise `exception` (an expression)."""
    return on_rank_in_step_3(1, f"                raise {exception}")


FAILING_RANK_ENTRY = rank1_fails_in_step_3('RuntimeError("injected failure on rank 1")') + """
from ddpmrepro.cli import main
main()
"""


@pytest.mark.slow
def test_one_rank_failing_ends_every_rank_and_says_which_and_why(tmp_path, prepared):
    entry = tmp_path / "entry.py"
    entry.write_text(FAILING_RANK_ENTRY)
    params = write_params(tmp_path / "p.yaml", train={"nproc": 2, "batch_per_proc": 8})
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(entry),
           *train_cmd(run, prepared, params, 2)[3:-2]]  # the same CLI arguments, without --nproc
    started = time.time()
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert time.time() - started < 120  # no hang: the surviving rank is stopped too
    assert "Error: injected failure on rank 1" in proc.stderr  # why (the failing rank's one line)
    import re

    root_cause = proc.stderr[proc.stderr.index("Root Cause"):]  # which (torchrun's failure summary)
    assert re.search(r"^\s*rank\s*:\s*1 \(local_rank: 1\)", root_cause, re.M)
    assert re.search(r"^\s*exitcode\s*:\s*1 ", root_cause, re.M)
    assert not (run / "model").exists()  # nothing exported as if finished


def poison_loss(monkeypatch, at_call: int) -> None:
    """Makes the training loss infinite in this process's `at_call`-th microbatch (1-based)."""
    from ddpmrepro.training import loop as T

    real, calls = T.diffusion_from_params, [0]

    def poisoned(*args, **kwargs):
        diffusion = real(*args, **kwargs)
        clean = diffusion.training_losses

        def training_losses(*a, **k):
            out = clean(*a, **k)
            calls[0] += 1
            return {**out, "loss": out["loss"] * float("inf")} if calls[0] == at_call else out
        diffusion.training_losses = training_losses
        return diffusion
    monkeypatch.setattr(T, "diffusion_from_params", poisoned)


def cli_train(run_dir: Path, data: Path, params: Path):
    """`ddpmrepro train` in this process (so a monkeypatched loss applies), as the user runs it."""
    from click.testing import CliRunner

    from ddpmrepro.cli import main

    return CliRunner().invoke(main, train_cmd(run_dir, data, params, 1)[3:])


def checkpoints(run_dir: Path) -> dict[int, dict]:
    from ddpmrepro.training.checkpoint import checkpoint_step, list_checkpoints

    (ckpt_dir,) = (run_dir / "ckpt").glob("*/*")
    return {checkpoint_step(f): load_checkpoint(f) for f in list_checkpoints(ckpt_dir)}


def tensors(state: dict) -> list[torch.Tensor]:
    """Every tensor of a checkpoint that training updates: weights, EMAs, AdamW moments and step counts."""
    out = list(state["model"].values()) + [t for e in state["ema"]["averages"].values() for t in e.values()]
    return out + [t for s in state["optimizer"]["state"].values() for t in s.values()]


# Checkpoints every step, log lines every 3: the poisoned step 4 is a checkpoint step but not a log step.
NONFINITE = {"steps": 6, "checkpoint_every": 1, "keep_checkpoints": 10, "log_every": 3}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_step_errors_saving_nothing_after_it_then_skip_resumes_as_a_skip_run(
        tmp_path, prepared, monkeypatch, caplog, one_thread, precision):
    # on_nonfinite: error (the default) stops at step 4 with one line; no checkpoint of the poisoned
    # model is written and the previous outputs are left as they were.
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    for name in ("SHA256SUMS", "config.json", "model.safetensors"):  # an earlier run's model directory
        (run / "model" / name).write_bytes(b"weights of an earlier run")
    poison_loss(monkeypatch, at_call=4)
    result = cli_train(run, prepared, write_params(tmp_path / "error.yaml", train={**NONFINITE, "precision": precision}))
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert errors == [f"Error: non-finite gradient norm at step 4 under {precision}; stopped without saving past "
                      "step 3. Lower train.lr, or set train.on_nonfinite: skip, and rerun to resume"]
    assert result.stderr.splitlines()[-1] == errors[0]
    assert sorted(checkpoints(run)) == [1, 2, 3]
    assert all(torch.isfinite(t.float()).all() for t in tensors(checkpoints(run)[3]))
    assert sorted(f.name for f in (run / "model").iterdir()) == ["SHA256SUMS", "config.json", "model.safetensors"]
    assert (run / "model" / "model.safetensors").read_bytes() == b"weights of an earlier run"
    assert not (run / "live").exists() and not (run / "introspect").exists()

    # As the message says: on_nonfinite: skip resumes from step 3 (the policy is not part of the run
    # hash) and skips step 4: its optimizer step and EMA update leave every tensor as it was.
    skip = write_params(tmp_path / "skip.yaml", train={**NONFINITE, "precision": precision, "on_nonfinite": "skip"})
    monkeypatch.undo()
    poison_loss(monkeypatch, at_call=1)  # step 4 is the first step of the resumed run
    with caplog.at_level("WARNING", logger="ddpmrepro.training.nonfinite"):
        assert cli_train(run, prepared, skip).exit_code == 0
    assert f"step 4: non-finite gradient norm under {precision}; update skipped (1 so far)" in caplog.text
    states = checkpoints(run)
    assert sorted(states) == [1, 2, 3, 4, 5, 6]
    assert all(torch.equal(a, b) for a, b in zip(tensors(states[3]), tensors(states[4])))
    assert not all(torch.equal(a, b) for a, b in zip(tensors(states[4]), tensors(states[5])))
    assert (states[6]["nonfinite"]["skipped_steps"], states[6]["ema"]["num_updates"]) == (1, 5)
    assert all(torch.isfinite(t.float()).all() for t in tensors(states[6]))
    assert bool(torch.isfinite(states[6]["sampler"]["loss_history"]).all())  # the inf losses were left out
    import pandas as pd

    logged = pd.read_csv(run / "live" / "plots" / "metrics" / "skipped_steps.tsv", sep="\t")
    assert logged["skipped_steps"].tolist() == [0, 1]  # at the log steps 3 and 6

    # ... bitwise what a run under `skip` from the start gives.
    monkeypatch.undo()
    poison_loss(monkeypatch, at_call=4)
    assert cli_train(tmp_path / "straight", prepared, skip).exit_code == 0
    straight = checkpoints(tmp_path / "straight")[6]
    assert all(torch.equal(a, b) for a, b in zip(tensors(straight), tensors(states[6])))


def torchrun_workers(proc: subprocess.Popen) -> dict[tuple[int, int], "psutil.Process"]:
    """The live workers under a launcher, by (torchrun restart count, rank)."""
    import psutil

    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            e = child.environ()
        except psutil.Error:  # gone, or not yet exec'd
            continue
        if "RANK" in e and "TORCHELASTIC_RESTART_COUNT" in e:
            found[int(e["TORCHELASTIC_RESTART_COUNT"]), int(e["RANK"])] = child
    return found


@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint_to_the_same_bits(tmp_path, prepared,
                                                                                    straight_runs):
    # checkpoint_every and max_restarts are operational: the same run as straight_runs(2).
    params = write_params(tmp_path / "p.yaml", train={"nproc": 2, "batch_per_proc": 8, "checkpoint_every": 1,
                                                      "max_restarts": 2})
    run, log = tmp_path / "restarted", tmp_path / "restarted.log"
    # --restart as well: a relaunched group must still resume from what this run saved.
    with open(log, "w") as err:
        proc = subprocess.Popen(train_cmd(run, prepared, params, 2) + ["--restart"], env=env(),
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        # SIGKILL rank 0 (it holds the run lock and writes the checkpoints) once step 2 is saved, then
        # rank 1 of the restarted group once step 5 is saved.
        for attempt, rank, after in [(0, 0, 2), (1, 1, 5)]:
            deadline = time.time() + 120
            while (worker := torchrun_workers(proc).get((attempt, rank))) is None or \
                    max((int(f.stem[5:]) for f in run.glob("ckpt/*/*/step_*.sha256")), default=0) < after:
                assert proc.poll() is None and time.time() < deadline, f"no kill {attempt}: {log.read_text()[-3000:]}"
                time.sleep(0.02)
            if attempt == 0:  # torchrun was told train.max_restarts
                assert "--max-restarts=2" in worker.parent().cmdline()
            worker.kill()
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    text = log.read_text()
    import re

    resumed = [int(s) for s in re.findall(r"resuming from \S+ \(step (\d+)\)", text)]
    assert len(resumed) == 2 and 2 <= resumed[0] < 5 <= resumed[1] < 8, resumed
    assert_same(final_state(straight_runs(2)), final_state(run), exact=True)


def start_and_wait_for(run: Path, data: Path, params: Path, line: str, nproc: int = 1) -> subprocess.Popen:
    """Starts `ddpmrepro train` as a process-group leader (as `setsid` would) and returns once it
    printed a line starting with `line`."""
    proc = subprocess.Popen(train_cmd(run, data, params, nproc), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    for text in proc.stderr:
        seen.append(text)
        if text.startswith(line):
            return proc
    proc.wait()
    raise AssertionError(f"no line {line!r}: {''.join(seen)[-3000:]}")


# The same run with one process, or two of half the batch (the launcher, torchrun and two workers).
BY_NPROC = {1: {}, 2: {"nproc": 2, "batch_per_proc": 8}}


@pytest.mark.slow
@pytest.mark.parametrize("nproc, to", [(1, "group"), (2, "group"), (2, "every process")])
def test_sigterm_saves_at_the_step_boundary_and_a_rerun_resumes_to_the_same_bits(tmp_path, prepared, straight_runs,
                                                                                  nproc, to):
    # SIGTERM of the process group (`kill -- -PGID`), or of every process as SLURM does before a
    # preemption (torchrun then gets it twice: from SLURM and relayed by the launcher), and a first
    # Ctrl-C share one handler; the next test presses Ctrl-C.
    import re
    import signal

    # No periodic checkpoint before the end: the one we find is the one the signal asked for.
    params = write_params(tmp_path / "p.yaml", train={"checkpoint_every": 100, **BY_NPROC[nproc]})
    run = tmp_path / "run"
    proc = start_and_wait_for(run, prepared, params, "step 2/8", nproc)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        for p in family(proc):
            p.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, err
    assert "SIGTERM received: saving a checkpoint at the end of this step\n" in err  # no "Ctrl-C again": not one
    assert "Traceback" not in err and "Error" not in err  # torchrun's SignalException stays in its log
    stopped = re.search(r"^stopped at step (\d)/8; checkpoint saved in (\S+)\. Rerun the same command "
                        r"\(or `dvc repro`\) to resume\.$", err, re.M)
    assert stopped, err
    assert [int(s) for s in checkpoints(run)] == [int(stopped[1])] and 2 <= int(stopped[1]) < 8
    assert Path(stopped[2]) == next((run / "ckpt").glob("*/*"))
    assert not (run / "model").exists()
    run_train(run, prepared, params, nproc)  # "rerun the same command"
    assert_same(final_state(straight_runs(nproc)), final_state(run), exact=True)
    assert live_series(run) == live_series(straight_runs(nproc))  # no extra point at the stop
    # The tables' files too, not only their rows: DVC hashes them (found from outside: a resumed run's
    # reports/introspect had another md5 in dvc.lock). Their chunks follow neither the stop nor
    # checkpoint_every (100 here, 4 in the straight run).
    assert tree_bytes(run / "introspect") == tree_bytes(straight_runs(nproc) / "introspect")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_sigterm_that_came_while_starting_stops_the_run_and_the_rerun_resumes_to_the_same_bits(
        tmp_path, prepared, straight_runs, nproc):
    # Under SLURM, dvc_stage.sh runs the stage with SIGTERM ignored (dvc and the launcher must wait
    # for the training to save) and catches it itself, into $DDPMREPRO_STOP_FILE: a SIGTERM before
    # the training's handler exists was lost, and the training ran on to SLURM's SIGKILL. Here the
    # shell has caught one already. One process stops after its first step, saving; the launcher
    # of two stops before starting torchrun (nothing has run).
    import re
    import signal

    params = write_params(tmp_path / "p.yaml", train={"checkpoint_every": 100, **BY_NPROC[nproc]})
    run = tmp_path / "run"
    (tmp_path / "stop").touch()
    proc = subprocess.run(train_cmd(run, prepared, params, nproc), env={**env(), "DDPMREPRO_STOP_FILE": str(tmp_path / "stop")},
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))  # as dvc_stage.sh leaves it
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr[-3000:]
    if nproc == 1:
        assert "SIGTERM came while the training was starting: saving a checkpoint at the end of the first step" in proc.stderr
        assert re.search(r"^stopped at step 1/8; checkpoint saved in ", proc.stderr, re.M), proc.stderr[-3000:]
        assert [int(s) for s in checkpoints(run)] == [1]
    else:
        assert ("SIGTERM came while ddpmrepro was starting: stopped before its workers started. Rerun the same "
                "command (or `dvc repro`) to resume.") in proc.stderr
        assert not list(run.glob("ckpt/**/step_*")) and "step 1/" not in proc.stderr
    assert not (run / "model").exists()
    run_train(run, prepared, params, nproc)  # the requeued job: no stop file
    assert_same(final_state(straight_runs(nproc)), final_state(run), exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_ctrl_c_exits_at_once_and_leaves_every_checkpoint_whole(tmp_path, prepared, straight_runs, nproc):
    import signal

    params = write_params(tmp_path / "p.yaml", train={"checkpoint_every": 1, "keep_checkpoints": 10, **BY_NPROC[nproc]})
    run = tmp_path / "run"
    proc = start_and_wait_for(run, prepared, params, "step 2/8", nproc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
    for text in proc.stderr:
        if text.startswith("SIGINT received"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # at once: inside the step, or inside a checkpoint write
    err = proc.stderr.read()
    assert proc.wait(timeout=30) == 1 and err.strip().splitlines()[-1] == "Aborted!", err
    assert "stopped at step" not in err
    (ckpt_dir,) = (run / "ckpt").glob("*/*")
    if nproc == 1:  # the write was unwound; with torchrun the workers were killed, maybe mid-write
        assert not [f for f in ckpt_dir.iterdir() if ".tmp." in f.name]
    assert checkpoints(run)  # every complete checkpoint loads
    run_train(run, prepared, params, nproc)
    assert not [f for f in ckpt_dir.iterdir() if ".tmp." in f.name]  # the rerun removed what a kill left
    assert_same(final_state(straight_runs(nproc)), final_state(run), exact=True)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def family(proc: subprocess.Popen) -> list["psutil.Process"]:
    """The launcher and every process under it: torchrun and its workers (in sessions of their own)."""
    import psutil

    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def newest_checkpoint_step(run: Path) -> int:
    return max((int(f.stem[5:]) for f in run.glob("ckpt/*/*/step_*.sha256")), default=0)


@pytest.mark.slow
def test_killing_the_launcher_or_its_process_group_leaves_no_worker_and_the_rerun_resumes_to_the_same_bits(
        tmp_path, prepared, straight_runs):
    # `setsid ddpmrepro train` with 2 processes, then SIGKILL: of the launcher alone, then of its whole
    # process group (`kill -9 -- -PGID`). torchrun starts its workers in sessions of their own: they
    # used to survive both, training on and holding the run lock and their GPUs.
    import signal

    import psutil

    from ddpmrepro.files import CheckpointError

    from ddpmrepro.training.checkpoint import RunLock

    params = write_params(tmp_path / "p.yaml", train={**BY_NPROC[2], "checkpoint_every": 1, "keep_checkpoints": 10})
    run = tmp_path / "run"
    for kill in (lambda proc: os.kill(proc.pid, signal.SIGKILL), lambda proc: os.killpg(proc.pid, signal.SIGKILL)):
        done = newest_checkpoint_step(run)
        proc = subprocess.Popen(train_cmd(run, prepared, params, 2), env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.time() + 300
        while proc.poll() is None and newest_checkpoint_step(run) <= done and time.time() < deadline:
            time.sleep(0.02)
        processes = family(proc)
        assert proc.poll() is None and len(processes) == 4, proc.stderr.read().decode()[-3000:]
        kill(proc)
        proc.wait()
        gone, alive = psutil.wait_procs(processes, timeout=30)
        assert not alive, f"survived the kill: {[p.cmdline()[:4] for p in alive]}"
        (ckpt_dir,) = (run / "ckpt").glob("*/*")
        try:
            with RunLock(ckpt_dir):  # free: nobody trains into the run any more
                pass
        except CheckpointError as e:
            raise AssertionError(f"the run lock is still held: {e}") from None
        assert not (run / "model").exists()
    # A temp file of a writer killed mid-write (as a kill inside a checkpoint write leaves it) ...
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = ckpt_dir / f".step_000000007.pt.tmp.{int(dead.stdout)}"
    stale.write_bytes(b"half a checkpoint")
    run_train(run, prepared, params, 2)
    # ... is gone after the rerun, which ends bitwise where an uninterrupted run ends.
    assert not [f.name for f in ckpt_dir.iterdir() if ".tmp." in f.name]
    assert_same(final_state(straight_runs(2)), final_state(run), exact=True)


# A failure inside a worker that is not a user error: rank 1 crashes in its third training step.
CRASH_SITECUSTOMIZE = rank1_fails_in_step_3('KeyError("injected bug")')
# Rank 0 is past its SIGTERM handler and stuck when rank 1 crashes, so torchrun's SIGTERM (it stops
# the group) kills it: CI once saw this order by chance, and the line blamed rank 0.
RANK0_DIES_OF_TORCHRUNS_SIGTERM = on_rank_in_step_3(0, """\
                import signal, time
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(300)""")


def damaged_data(tmp_path: Path, prepared: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    blob = bytearray((data / "test-00000.images.npy").read_bytes())
    blob[len(blob) // 2] ^= 1
    (data / "test-00000.images.npy").write_bytes(bytes(blob))
    return data


@pytest.mark.slow
@pytest.mark.parametrize("case", ["params", "data"])
def test_a_user_error_in_the_workers_is_the_single_process_line_and_exit_code(tmp_path, prepared, case):
    # `train.nproc: 2` with a batch larger than the data printed the right line twice, then torchrun's
    # 44-line ChildFailedError report. Now: the line once, and the exit code of one process.
    data = damaged_data(tmp_path, prepared) if case == "data" else prepared
    batch = 16 if case == "data" else 5000
    results = {}
    for nproc in (1, 2):
        params = write_params(tmp_path / f"p{nproc}.yaml", train={"nproc": nproc, "batch_per_proc": batch})
        run = tmp_path / f"run{nproc}"
        proc = subprocess.run(train_cmd(run, data, params, nproc), env=env(), capture_output=True, text=True,
                              timeout=300)
        results[nproc] = proc.returncode, proc.stderr.splitlines()
        assert proc.stdout == "" and not run.exists(), proc.stderr  # nothing written, no run directory
    if case == "params":
        assert results == {n: (2, [f"Error: train.batch_per_proc=5000 is larger than this rank's {1438 // n} training "
                                   "images; lower it"]) for n in (1, 2)}
    else:
        code, lines = results[1]
        assert code == 1 and len(lines) == 1 and lines[0].startswith(f"Error: {data / 'test-00000.images.npy'}: sha256 does not match")
        assert results[2] == results[1]  # word for word


@pytest.mark.slow
@pytest.mark.parametrize("rank0", ["exits", "killed_by_torchrun"])
def test_a_crash_in_a_worker_shows_its_traceback_and_names_torchruns_log(tmp_path, prepared, rank0):
    import re

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_SITECUSTOMIZE + (RANK0_DIES_OF_TORCHRUNS_SIGTERM
                                                                  if rank0 == "killed_by_torchrun" else ""))
    params = write_params(tmp_path / "p.yaml", train=BY_NPROC[2])
    proc = subprocess.run(train_cmd(tmp_path / "run", prepared, params, 2), capture_output=True, text=True,
                          env={**env(), "PYTHONPATH": f"{hook}{os.pathsep}{SRC}"}, timeout=300)
    assert proc.returncode == 1
    assert "KeyError: 'injected bug'" in proc.stderr  # the worker's own traceback, for debugging
    assert "torch/distributed/run.py" not in proc.stderr and "ChildFailedError" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, proc.stderr
    m = re.fullmatch(r"Error: rank 1 \(pid \d+\) exited with code 1; its output is above, torchrun's log is (\S+)",
                     errors[0])
    assert m, errors
    log = Path(m[1])
    try:
        assert "ChildFailedError" in log.read_text() or "Root Cause" in log.read_text()
        assert sorted(f.name for f in log.parent.iterdir()) == ["torchrun.log"]  # the log alone is kept
    finally:
        shutil.rmtree(log.parent)


@pytest.mark.slow
def test_the_gradient_instruments_change_no_bit_of_the_training(tmp_path, prepared):
    """The noise-level buckets' extra backward passes (every step recorded) and the noise scale's hooks
    (grad_accum 2) against a run with both off: the same weights, EMAs, parameter and activation
    gradient tables (each activation gradient recorded once: the hooks pause for the extra passes)."""
    import pandas as pd

    from ddpmrepro.training import loop as T

    def run(name, **introspect):
        params = P.load(write_params(tmp_path / f"{name}.yaml", train={"steps": 4, "grad_accum": 2, "batch_per_proc": 8},
                                     introspect={"every": 1, **introspect}))
        paths = T.TrainPaths(prepared, tmp_path / name / "m", tmp_path / name / "l", tmp_path / name / "i",
                             tmp_path / name / "c")
        T.train(params, paths)
        return tmp_path / name

    on, off = run("on", noise_buckets=2, noise_levels_every=1), run("off", noise_buckets=0, noise_scale=False)
    for f in ("model.safetensors", "ema_0.9.safetensors", "ema_0.99.safetensors"):
        assert (on / "m" / f).read_bytes() == (off / "m" / f).read_bytes(), f
    for table in ("param_grads", "act_grads"):
        assert pd.read_parquet(on / "i" / table).equals(pd.read_parquet(off / "i" / table)), table
    levels = pd.read_parquet(on / "i" / "noise_levels")
    assert sorted(levels["step"].unique()) == [1, 2, 3, 4] and not len(pd.read_parquet(off / "i" / "noise_levels"))
    steps = pd.read_parquet(on / "i" / "steps")
    assert steps["gns_trace"].notna().all()  # every step has microbatches: its own estimate
    assert pd.read_parquet(off / "i" / "steps")["gns_trace"].isna().all()


def test_train_puts_its_three_outputs_in_place_only_once_all_are_written(tmp_path, prepared, one_thread, monkeypatch):
    """The model directory, dvclive's files and the introspection tables are all written before any
    is put in place: a failure while writing the last (here a full disk at the tables' sums) leaves
    the three earlier directories themselves (the same inodes, the same bytes), and no temp
    directory. (They were swapped one by one: the model could be new and the tables old.)"""
    import errno

    from click.testing import CliRunner

    from ddpmrepro import tables
    from ddpmrepro.cli import main

    params = write_params(tmp_path / "p.yaml", train={"steps": 2, "checkpoint_every": 2, "log_every": 1})
    cmd = train_cmd(tmp_path, prepared, params, 1)[3:]
    assert CliRunner().invoke(main, cmd).exit_code == 0
    outs = [tmp_path / name for name in ("model", "live", "introspect")]

    def state():
        return [(os.stat(d).st_ino, {f.relative_to(d).as_posix(): f.read_bytes() for f in d.rglob("*") if f.is_file()})
                for d in outs]
    before = state()

    def full(directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    monkeypatch.setattr(tables, "write_sums", full)
    result = CliRunner().invoke(main, cmd)  # finished: it exports again, and fails at the last file
    assert result.exit_code == 1 and "No space left on device" in result.output, result.output
    assert state() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "introspect", "live", "model", "p.yaml"]
    monkeypatch.undo()
    assert CliRunner().invoke(main, cmd).exit_code == 0  # and the next export puts all three in place
    after = state()
    assert all(a[0] != b[0] and a[1] == b[1] for a, b in zip(after, before))


@pytest.mark.slow
def test_two_processes_wait_together_for_another_training_of_the_same_run(tmp_path, prepared):
    """DDP: rank 0 waits for the run lock while rank 1 polls with it (one tiny all-reduce a second),
    so no rank sits in a collective past its timeout; once free, both resume the run (here finished)."""
    from ddpmrepro.training.checkpoint import RunLock

    params = write_params(tmp_path / "p.yaml", train={**BY_NPROC[2], "steps": 2, "checkpoint_every": 2})
    run = tmp_path / "run"
    run_train(run, prepared, params, 2)
    (ckpt_dir,) = (run / "ckpt").glob("*/*")
    model = (run / "model" / "model.safetensors").read_bytes()
    log = tmp_path / "second.err"
    with RunLock(ckpt_dir), open(log, "w") as err:
        proc = subprocess.Popen(train_cmd(run, prepared, params, 2), env={**env(), "DDPMREPRO_CPU_SLOTS": "0"},
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 300
            while "waiting for process" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(3)  # both ranks polling meanwhile
            assert proc.poll() is None, f"it did not wait (exit {proc.returncode}): {log.read_text()[-2000:]}"
            assert log.read_text().count("waiting for process") == 1  # rank 0 says it, once
        except BaseException:
            proc.kill()
            raise
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert (run / "model" / "model.safetensors").read_bytes() == model
