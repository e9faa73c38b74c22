"""A sweep through DVC's queue: `dvc queue start -j 2` runs two experiments at once, each in its own
temporary clone (checkpointing into the project's checkpoints/, which outlive the clone), on
disjoint cores (cpu_slots), and each gives exactly what the same experiment gives when run alone;
a killed experiment in a temporary clone resumes. Real git, DVC, celery queue workers and training."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dvc.api
import pytest
import yaml

from project_copy import copy_project
from project_copy import TINY, deep_update
from test_pipeline import only_changed_table

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
TORCH_STAGES = {"fit-evaluator", "train", "sample", "bits-per-dim", "evaluate"}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")]


def run(repo: Path, env: dict, *cmd: str) -> str:
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


class Watcher(threading.Thread):
    """Snapshots of the ddpmrepro stage processes of queued experiments: (experiment dir, stage, cores)."""

    def __init__(self, repo: Path):
        super().__init__(daemon=True)
        self.root, self.snapshots, self.stop = str(repo.resolve() / ".dvc/tmp/exps") + "/", [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            snap = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    cwd = os.readlink(f"/proc/{pid}/cwd")
                    if b"ddpmrepro.cli" not in argv or argv[0].endswith(b"sh") or not cwd.startswith(self.root):
                        continue
                    stage = argv[argv.index(b"ddpmrepro.cli") + 1].decode()
                    snap.append((cwd[len(self.root):].split("/")[0], stage, frozenset(os.sched_getaffinity(int(pid)))))
                except (OSError, ValueError, IndexError):
                    pass  # the process ended while we looked
            self.snapshots.append(snap)
            time.sleep(0.2)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("sweep")
    copy_project(repo)
    params = deep_update(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return repo


def test_queued_experiments_run_side_by_side_on_disjoint_cores_and_equal_solo_runs(repo, tmp_path):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
           "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1",  # each job's share: 1 of the 2 cores
           "DDPMREPRO_CPU_SLOTS": "1", "DDPMREPRO_CPU_LOCK_DIR": str(tmp_path / "cpu-locks")}
    # As a user sweeps: from a baseline that ran and was committed (its prepare and fit_evaluator
    # are then restored from the run-cache, not run again, and columns equal in every row drop out).
    for cmd in (["git", "init", "-q", "-b", "main"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "tiny pipeline"], ["dvc", "repro"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "baseline run"]):
        run(repo, env, *cmd)
    lrs = {"q4": "0.004", "q1": "0.001"}  # not the baseline's 0.002: that would be restored, not trained
    for name, lr in lrs.items():
        run(repo, env, "dvc", "exp", "run", "--queue", "-S", f"train.lr={lr}", "-n", name)

    def checkpoint_dirs() -> set[Path]:
        return set((repo / "checkpoints").glob("*/*"))
    baseline_checkpoints = checkpoint_dirs()
    assert len(baseline_checkpoints) == 1  # the baseline's run
    watcher = Watcher(repo)
    watcher.start()
    run(repo, env, "dvc", "queue", "start", "-j", "2")
    deadline = time.monotonic() + 1500
    while time.monotonic() < deadline:
        time.sleep(3)
        status = run(repo, env, "dvc", "queue", "status")
        if "Running" not in status and "Queued" not in status:
            break
    watcher.stop.set()
    watcher.join()
    assert status.count("Success") == 2, status

    # Two experiments computed at the same time, each in its own clone, never two on one core.
    torch_jobs = [[job for job in snap if job[1] in TORCH_STAGES] for snap in watcher.snapshots]
    # what the watcher saw, stage by stage, for a failure's message: [(experiment, stage, cores), ...] as they changed
    seen = [snap for i, snap in enumerate(torch_jobs) if snap and (i == 0 or snap != torch_jobs[i - 1])]
    timeline = f"{len(watcher.snapshots)} snapshots; the changes:\n" + "\n".join(map(str, seen[:200]))
    assert max(len({exp for exp, _, _ in snap}) for snap in torch_jobs) == 2, timeline
    trains = {exp for snap in torch_jobs for exp, stage, _ in snap if stage == "train"}
    assert len(trains) == 2, timeline  # two clones, so two checkpoint directories: nothing shared
    for snap in torch_jobs:
        claimed = [cores for _, _, cores in snap if len(cores) == 1]  # pinned to its one claimed core
        assert len(claimed) == len(set(claimed)), (snap, timeline)
    pinned = {(exp, stage) for snap in torch_jobs for exp, stage, cores in snap if len(cores) == 1}
    assert {(exp, "train") for exp in trains} <= pinned, timeline  # each training ran on the one core it claimed
    # Each clone trained into the project's checkpoints/ (a clone's own are deleted with it), one run
    # directory per experiment, each to its last step.
    queued = checkpoint_dirs() - baseline_checkpoints
    assert len(queued) == 2 and all((d / "step_000000012.pt").exists() for d in queued), checkpoint_dirs()

    # Queued experiments add State and Executor columns; the comparison still fits 160 columns.
    wanted, lines = only_changed_table(repo, 160)
    assert "train.lr" in wanted and max(len(line.rstrip()) for line in lines) <= 160, "\n".join(lines)
    header = next(line for line in lines if "Experiment" in line).split()
    assert "State" in header and [c for c in wanted if c not in header] == [], "\n".join(lines)

    # The same experiments alone, one after the other, in the workspace (-f: computed, not restored
    # from the run-cache the queue filled; without the queue's run directories, trained again).
    for d in queued:
        shutil.rmtree(d)
    solo = {name.replace("q", "s"): lr for name, lr in lrs.items()}
    for name, lr in solo.items():
        run(repo, env, "dvc", "exp", "run", "-f", "-S", f"train.lr={lr}", "-n", name)
    revs = {e["name"]: e["rev"] for e in _experiments(repo, env)}
    for q, s in (("q4", "s4"), ("q1", "s1")):
        for path in ("models/ddpm/model.safetensors", "models/ddpm/ema_0.999.safetensors", "samples/samples.npz"):
            assert _read(repo, path, revs[q]) == _read(repo, path, revs[s]), (q, path)
        mq, ms = (json.loads(_read(repo, "metrics.json", revs[x])) for x in (q, s))
        assert mq == ms and len(mq) >= 7  # the headline holds no timing: equal to the last bit
        dq, ds = (json.loads(_read(repo, "reports/metrics_detail.json", revs[x])) for x in (q, s))
        dq["train"].pop("images_per_sec"), ds["train"].pop("images_per_sec")
        assert dq == ds
    assert _read(repo, "metrics.json", revs["q4"]) != _read(repo, "metrics.json", revs["q1"])


def _experiments(repo: Path, env: dict) -> list[dict]:
    out = []
    for baseline in json.loads(run(repo, env, "dvc", "exp", "show", "--json")):
        for exp_range in baseline.get("experiments") or []:
            for e in exp_range["revs"]:
                out.append({"name": exp_range.get("name") or e.get("name"), "rev": e["rev"]})
    return out


def _read(repo: Path, path: str, rev: str) -> bytes:
    return dvc.api.read(path, repo=str(repo), rev=rev, mode="rb")


def test_a_killed_experiment_in_a_temporary_clone_resumes_from_its_checkpoints(tmp_path):
    """`dvc exp run --temp` (and the queue) trains in a clone DVC deletes: a killed experiment started
    again from step 0 (found from outside). Its checkpoints are the project's now: it resumes."""
    import psutil

    from project_copy import tiny_project

    repo = tiny_project(tmp_path / "proj")
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
           "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1"}
    exp = ["dvc", "exp", "run", "--temp", "-S", "train.steps=400", "-S", "train.checkpoint_every=5"]
    proc = subprocess.Popen(exp, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if list((repo / "checkpoints").glob("*/*/step_*.sha256")):
            break
        time.sleep(0.2)
    if proc.poll() is not None:
        out = proc.stdout.read()
        said = [line for line in out.splitlines() if "checkpoints go to" in line or "Running stage" in line]
        raise AssertionError(f"the experiment ended before it could be killed: {said}\n{out[-1500:]}")
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)  # DVC, its stage's shell and the training at once
    proc.wait()
    psutil.wait_procs(family, timeout=60)
    (run_dir,) = (repo / "checkpoints").glob("*/*")
    assert list(run_dir.glob("step_*.pt")), sorted(p.name for p in run_dir.iterdir())
    again = subprocess.run(exp, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"checkpoints go to {repo.resolve() / 'checkpoints'}: the project's" in out, out[-3000:]
    assert "resuming from" in out and f"{run_dir.name}" in out, out[-3000:]
    assert (run_dir / "step_000000400.pt").exists()
