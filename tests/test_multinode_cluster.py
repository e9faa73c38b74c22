"""Several SLURM nodes for real: the namespace cluster of scripts/local_cluster.sh (hosts ctl,
node1, node2 on a private bridge; slurmctld in ctl, a slurmd per node), real sbatch and srun,
torchrun across the hosts over gloo/TCP, a temporary git + DVC repo on tiny params.

- 2 nodes x 1 process equal 1 node x 2 processes bitwise through sbatch, without OMP_NUM_THREADS
  (threads per node from SLURM's CPUs, as on one node), with the rendezvous on the first node's
  NodeAddr at a port of the job's own, and one "trained N steps" line;
- a 2-node training run by workflow/scripts/dvc_stage.sh (the Snakemake job's command) and
  stopped twice by `scancel --signal=TERM` requeues itself twice (the same job: Restarts=2,
  COMPLETED) and ends bitwise equal: srun keeps the 130 of "stopped, rerun to resume";
- two 2-node jobs on the same two nodes at once both finish, both bitwise equal (a port per job);
- a node lost mid-run (its processes killed) fails the job with one `Error:` line, and the rerun
  resumes from the last checkpoint and ends bitwise equal;
- docs/CLUSTER.md's Snakemake recipe for 2 nodes (`train.nodes: 2`, `--set-threads train=1`),
  typed on the controller host, runs one 2-node job and ends bitwise equal;
- with accounting (`up 2 --accounting`: slurmdbd + MariaDB), the same recipe with the plugin's
  default `sacct` status check passes the Snakefile's check, ends bitwise equal, and `sacct`
  lists the job COMPLETED under account ddpmrepro with its steps (skipped without accounting);
- without SLURM, `ddpmrepro train --nnodes 2 --node-rank K --rdzv node1:PORT` on node1 and node2
  equals 1 node x 2 processes bitwise.

The repo's params say `train.nodes: 2`; the reference for all of them is one run of 1 node x 2
processes outside SLURM (`--nproc 2 --nnodes 1`; torchrun gives each of them one thread). Skipped, with the reason, where the cluster is not up: it needs root,
so the tests do not start it (`sudo scripts/local_cluster.sh up 2 --accounting`; .ci/run does).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddpmrepro.files import load_weights
from frozen import frozen, run_in_slices, term_delivered
from project_copy import copy_project

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "local_cluster.sh"
BIN = str(Path(sys.executable).parent)
SMALL_MODEL = {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
               "num_head_channels": 16, "dropout": 0.0}
TRAIN = {"steps": 12, "batch_per_proc": 8, "warmup_steps": 2, "checkpoint_every": 4, "log_every": 1, "nproc": 1,
         "nodes": 2}

pytestmark = pytest.mark.slow


def why_no_cluster() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root (it enters the namespaces of scripts/local_cluster.sh) and Linux"
    status = subprocess.run([SCRIPT, "status"], capture_output=True, text=True)
    if status.returncode != 0:
        return "the namespace cluster is not up: run `sudo scripts/local_cluster.sh up 2` first (CI's .ci/run does)"
    if "node2" not in status.stdout:
        return "the namespace cluster has fewer than 2 nodes: `sudo scripts/local_cluster.sh up 2`"
    return None


def env_for(repo: Path) -> dict:
    """The test's environment for the jobs (sbatch exports it), without OMP_NUM_THREADS: the thread
    count must come from SLURM's CPUs, as a user's job gets it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "OMP_NUM_THREADS"}
    return {**env, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
            "DVC_NO_ANALYTICS": "1"}


def on(host: str, *cmd: str, repo: Path, check: bool = True, timeout: float = 600, env: dict | None = None):
    proc = subprocess.run([str(SCRIPT), "exec", host, *cmd], cwd=repo, env=env or env_for(repo),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{host}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def job_info(repo: Path, job: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", on("ctl", "scontrol", "show", "job", "-o", job, repo=repo).stdout))


def wait_for(cond, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def train_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ddpmrepro.cli", "-v", "train", "--data", "data/prepared", "--out", str(out / "model"),
            "--live", str(out / "live"), "--introspect", str(out / "introspect"), "--checkpoints", str(out / "ckpt"),
            *extra]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {f.name + ":" + k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_weights(f).items()}


def assert_bitwise_equal(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and len(wa) > 1
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])][:5]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A git + DVC repo with tiny params whose data is prepared (one dataset for every test)."""
    reason = why_no_cluster()
    if reason:
        pytest.skip(reason)
    repo = tmp_path_factory.mktemp("multinode")
    copy_project(repo, extra=("params.yaml",))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["model"].update(SMALL_MODEL)
    params["train"].update(TRAIN)
    params["diffusion"]["timesteps"] = 50
    params["introspect"].update(every=0, steps=[1])
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = env_for(repo)
    for cmd in (["git", "init", "-q", "-b", "main"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "tiny"], ["dvc", "repro", "-q", "prepare"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True, timeout=600)
    return repo


@pytest.fixture(scope="module")
def reference(repo) -> Path:
    """1 node x 2 processes, outside SLURM: torchrun --standalone, one thread per process."""
    out = repo.parent / "ref"
    env = {**env_for(repo), "DDPMREPRO_CPU_SLOTS": "0"}  # torchrun's one thread per process, on any machine
    subprocess.run(train_cmd(out, "--nproc", "2", "--nnodes", "1"), cwd=repo, env=env, check=True, capture_output=True,
                   timeout=900)
    return out / "model"


def sbatch(repo: Path, name: str, *options: str, wait: bool = True) -> tuple[str, Path]:
    """`ddpmrepro train` once in a batch script, as docs/CLUSTER.md gives it. Returns (job id, out dir)."""
    out = repo.parent / name
    script = repo.parent / f"{name}.sbatch"
    script.write_text("#!/bin/bash\n" + " ".join(train_cmd(out)) + "\n")
    proc = on("ctl", "sbatch", *(["--wait"] if wait else []), "--parsable", "-J", name, "-o", str(out) + ".log",
              *options, str(script), repo=repo, check=False)
    job = proc.stdout.strip().split(";")[0]
    assert job.isdigit(), proc.stdout + proc.stderr
    return job, out


TWO_NODES = ("-N2", "--ntasks-per-node=1", "-c1", "--mem-per-cpu=500")


def test_two_nodes_equal_one_node_with_two_processes(repo, reference):
    job, out = sbatch(repo, "two_nodes", *TWO_NODES)
    log = Path(str(out) + ".log").read_text()
    assert job_info(repo, job)["JobState"] == "COMPLETED", log[-3000:]
    srun = re.search(r"\+ (srun .*)", log).group(1)
    # the rendezvous: the first node's address (NodeAddr), a port of this job's own, the job id
    assert re.search(rf"--rdzv_endpoint=10\.213\.0\.11:{20000 + int(job) % 10000} --rdzv_id={job} ", srun), srun
    assert "--kill-on-bad-exit=0" in srun and "--nnodes=2 --nproc_per_node=1" in srun
    assert len(re.findall(r"^trained 12 steps", log, re.M)) == 1, log[-3000:]
    assert_bitwise_equal(out / "model", reference)


def test_two_jobs_on_the_same_nodes_both_finish(repo, reference):
    first, out1 = sbatch(repo, "shared_a", *TWO_NODES, wait=False)
    second, out2 = sbatch(repo, "shared_b", *TWO_NODES, wait=False)
    wait_for(lambda: all(job_info(repo, j)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING")
                         for j in (first, second)), "both jobs to end", timeout=600)
    endpoints = set()
    for job, out in ((first, out1), (second, out2)):
        log = Path(str(out) + ".log").read_text()
        info = job_info(repo, job)
        assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[1-2]", log[-3000:]
        endpoints.add(re.search(r"--rdzv_endpoint=(\S+)", log).group(1))
        assert_bitwise_equal(out / "model", reference)
    assert len(endpoints) == 2, endpoints  # with one port, the second job joined the first one's rendezvous store
    # they ran at the same time, on the same nodes
    a, b = job_info(repo, first), job_info(repo, second)
    assert max(a["StartTime"], b["StartTime"]) < min(a["EndTime"], b["EndTime"]), (a, b)


# --- finding the training's processes in the hosts ------------------------------------------------
def procs_of(repo: Path, marker: str, *, workers: bool) -> list[int]:
    """Pids of the training's workers (workers=True: started by torchrun, RANK in their
    environment) or of its torchrun agents: those whose command line names `marker`, or without
    one, those running in repo (DVC's stage command has relative paths)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            environ = (d / "environ").read_bytes().split(b"\0")
            cwd = (d / "cwd").resolve()
        except OSError:
            continue
        ours = marker.encode() in b" ".join(argv) if marker else cwd == repo.resolve()
        if b"ddpmrepro.cli" not in argv or not ours:
            continue
        is_agent = b"ddpmrepro.runtime.torchrun" in argv and Path(argv[0].decode()).name != "srun"
        is_worker = not is_agent and any(e.startswith(b"RANK=") for e in environ)
        if (is_worker if workers else is_agent):
            found.append(int(d.name))
    return found


def host_of(pid: int) -> str:
    """The hostname of the host (UTS namespace) the process runs in."""
    return subprocess.run(["nsenter", "-t", str(pid), "--uts", "hostname"], capture_output=True, text=True).stdout.strip()


# --- Snakemake ------------------------------------------------------------------------------------
def test_the_snakemake_profile_trains_on_two_nodes(repo, reference):
    """docs/CLUSTER.md section 3's recipe on CPU nodes, typed on the controller host: one job of
    2 nodes, one torchrun per node (the job step drops SLURM's node list; scontrol gives it back),
    one thread per process from the job's `threads`, bitwise equal."""
    proc = on("ctl", "snakemake", "train", "--workflow-profile", "profiles/slurm", "--default-resources",
              "slurm_account=ddpmrepro", "slurm_partition=debug", "--set-threads", "train=1", repo=repo,
              timeout=900)  # train.nodes: 2 in params.yaml: the Snakefile asks for the nodes
    out = proc.stdout + proc.stderr
    job = re.search(r"SLURM jobid (\d+) \(log: \S*/rule_train/", out).group(1)
    info = job_info(repo, job)
    assert (info["JobState"], info["NumNodes"], info["NodeList"]) == ("COMPLETED", "2", "node[1-2]"), info
    per_node = int(info["NumCPUs"]) // 2
    assert f"train: partition 'debug' has no GPUs: its 1 process(es) run on {per_node} CPUs on each of 2 nodes" in out
    log = (repo / "logs/dvc/train.log").read_text()
    assert len(re.findall(r"^trained 12 steps", log, re.M)) == 1, log[-3000:]
    assert_bitwise_equal(repo / "models/ddpm", reference)


def test_a_failed_two_node_job_keeps_the_git_tracked_outputs(repo, reference):
    """On two nodes the job step plugin runs the job's Snakemake in the batch script (`mpi`), not
    under srun, and no Snakemake of the job kept the backups of the git-tracked outputs that DVC
    deletes before the stage runs: a failed job lost every dvclive curve (found from outside)."""
    env = env_for(repo)

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout

    recipe = ("snakemake", "train", "--workflow-profile", "profiles/slurm", "--default-resources",
              "slurm_account=ddpmrepro", "slurm_partition=debug", "--set-threads", "train=1")
    if not (repo / "reports/train/live/plots/metrics/loss.tsv").exists():  # run alone: train first
        on("ctl", *recipe, repo=repo, timeout=900)
    git("add", "-A")
    git("commit", "-qm", "trained on two nodes")
    tracked = {p: (repo / p).read_bytes() for p in git("ls-files", "reports/train/live").split()}
    assert "reports/train/live/plots/metrics/loss.tsv" in tracked
    # valid params (check_params passes) naming a damaged checkpoint: only the train job finds out
    broken = repo / "models/published/broken.pt"
    broken.write_bytes(b"not a checkpoint" * 64)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["import_from"] = "models/published/broken.pt"
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        proc = on("ctl", *recipe, "--retries", "0", repo=repo, check=False, timeout=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]
        assert "Error: models/published/broken.pt: " in (repo / "logs/dvc/train.log").read_text()
        # and Snakemake says it too, not only "SLURM status is: 'FAILED'" (found from outside)
        said = [line for line in out.splitlines() if line.startswith("Error: models/published/broken.pt: ")]
        assert len(said) == 1 and said[0].endswith("(job train: logs/dvc/train.log)"), out[-3000:]
        job = re.search(r"SLURM jobid (\d+) \(log: \S*/rule_train/", out).group(1)
        assert job_info(repo, job)["NumNodes"] == "2"
        assert {p: (repo / p).read_bytes() for p in tracked if (repo / p).exists()} == tracked, git("status", "--short")
    finally:
        broken.unlink()
        git("checkout", "params.yaml", "dvc.lock", "reports/params")
        subprocess.run(["dvc", "checkout", "-q", "train"], cwd=repo, env=env, check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def accounting() -> None:
    """Skips, before any fixture trains, where the cluster keeps no accounting (sacct knows no job)."""
    reason = why_no_cluster()
    if not reason:
        config = subprocess.run([SCRIPT, "exec", "ctl", "scontrol", "show", "config"], cwd="/", capture_output=True,
                                text=True, check=True).stdout
        storage = re.search(r"^AccountingStorageType\s*=\s*(\S+)", config, re.M).group(1)
        if storage.endswith("/none"):
            reason = f"the cluster keeps no accounting ({storage}): `sudo scripts/local_cluster.sh up 2 --accounting`"
    if reason:
        pytest.skip(reason)


def test_the_snakemake_profile_with_sacct_as_status_source(accounting, repo, reference):
    """The same recipe with the plugin's default status check, `sacct`, instead of the profile's
    squeue: on a cluster with accounting (slurmdbd) the Snakefile lets it through, Snakemake sees
    the job end, and sacct holds the job, its account and its steps."""
    status = subprocess.run([SCRIPT, "status"], capture_output=True, text=True).stdout
    assert re.search(r"^mariadb: running", status, re.M) and re.search(r"^slurmdbd: running", status, re.M), status
    # MariaDB listens on ctl's loopback only: in ctl's network namespace, not this machine's.
    assert re.search(r"127\.0\.0\.1:3317\s", on("ctl", "ss", "-ltnH", repo=repo).stdout)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", 3317), timeout=5).close()
    # What the Snakefile reads to refuse sacct without accounting, read as it reads it, on ctl.
    probe = "from ddpmrepro.pipeline import slurm; c = slurm.read_cluster(); print(c.accounting, c.min_job_age_s)"
    assert on("ctl", sys.executable, "-c", probe, repo=repo).stdout.split() == ["True", "3600"]
    # The profile test ran this stage already: a param that changes no weight makes DVC run it again,
    # and its checkpoints (the same run for them) must not be resumed.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["checkpoint_every"] = 6
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(repo / "checkpoints", ignore_errors=True)
    (repo / "logs/dvc/train.log").unlink(missing_ok=True)
    try:
        proc = on("ctl", "snakemake", "train", "--workflow-profile", "profiles/slurm", "--slurm-status-command", "sacct",
                  "--default-resources", "slurm_account=ddpmrepro", "slurm_partition=debug",
                  "--set-threads", "train=1", repo=repo, timeout=900)
    finally:
        params["train"]["checkpoint_every"] = TRAIN["checkpoint_every"]
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = proc.stdout + proc.stderr
    assert "keeps no accounting" not in out and "Error:" not in out, out[-3000:]
    # The plugin took sacct (it warns that squeue would do, as MinJobAge is long) and did not fall back.
    assert "'squeue' should work reliably for status queries" in out and "using 'squeue'" not in out, out[-3000:]
    job = re.search(r"SLURM jobid (\d+) \(log: \S*/rule_train/", out).group(1)
    rows = [line.split("|") for line in on("ctl", "sacct", "-j", job, "-n", "-P", "-o",
                                           "JobID,Account,State,NodeList,ExitCode,MaxRSS", repo=repo).stdout.splitlines()]
    by_id = {r[0]: r[1:] for r in rows}
    assert by_id[job][:4] == ["ddpmrepro", "COMPLETED", "node[1-2]", "0:0"], rows
    # the batch script's step, and the training's srun step across both nodes, its memory measured
    # (jobacct_gather/linux)
    assert by_id[f"{job}.batch"][1] == "COMPLETED", rows
    steps = [v for k, v in by_id.items()
             if k.startswith(f"{job}.") and k.split(".")[-1].isdigit() and v[1:3] == ["COMPLETED", "node[1-2]"]]
    assert steps and re.fullmatch(r"[1-9]\d*K", steps[0][4]), rows
    log = (repo / "logs/dvc/train.log").read_text()
    assert len(re.findall(r"^trained 12 steps", log, re.M)) == 1, log[-3000:]
    assert_bitwise_equal(repo / "models/ddpm", reference)


# --- preemption -----------------------------------------------------------------------------------
def test_two_node_training_stopped_twice_requeues_itself_and_ends_bitwise_equal(repo, reference):
    """As a Snakemake job runs it (workflow/scripts/dvc_stage.sh), without Snakemake around it."""
    # The Snakemake test ran this stage already: a param that changes no weight makes DVC run it
    # again, and neither that run's checkpoints (the same run for them) nor its log may count here.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["checkpoint_every"] = 5
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(repo / "checkpoints", ignore_errors=True)
    (repo / "logs/dvc/train.log").unlink(missing_ok=True)
    (repo / "logs/dvc").mkdir(parents=True, exist_ok=True)
    log = repo / "logs/dvc/train.log"
    proc = on("ctl", "sbatch", "--parsable", "--requeue", *TWO_NODES, "-o", str(repo.parent / "preempt.log"),
              "--wrap", f"bash workflow/scripts/dvc_stage.sh train {log}", repo=repo)
    job = proc.stdout.strip()

    def stop(restarts: int, after: str) -> str:
        """Freezes both workers as soon as they run, lets them run in short slices until a step is
        logged after `after` (tests/frozen.py: however fast they train), has SLURM send SIGTERM,
        lets them go on once it is pending, and waits until the job has requeued itself; returns
        the log of the part that was stopped."""
        pids = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(procs_of(repo, "", workers=True)),
                        "both workers")
        with frozen(pids):
            assert {host_of(p) for p in pids} == {"node1", "node2"}
            run_in_slices(pids, lambda: log.exists() and re.search(rf"{after}(.*\n)*step [1-9]\d*/", log.read_text()),
                          f"a step after '{after}' in the log")
            on("ctl", "scancel", "--signal=TERM", job, repo=repo)
            wait_for(lambda: all(term_delivered(p) for p in pids), "SLURM's SIGTERM at both workers")
        wait_for(lambda: job_info(repo, job)["Restarts"] == str(restarts), f"restart {restarts} of job {job}")
        part = (repo / f"logs/dvc/train.slurm-{job}-{restarts - 1}.log").read_text()
        assert f"requeueing SLURM job {job}" in part, part[-2000:]
        # Requeued, SLURM holds the job for about two minutes before it may start again: not here.
        wait_for(lambda: job_info(repo, job)["JobState"] == "PENDING", f"job {job} pending again")
        # Started again within the second of its requeue, the job's new credential counts as revoked
        # with the old one ("Killing non-startable batch job: Job credential revoked"): the nodes done
        # with the old part (slurmd revokes it then), then a later second.
        wait_for(lambda: "completing" not in on("ctl", "sinfo", "-h", "-o", "%T", repo=repo).stdout,
                 "the nodes done with the old part")
        time.sleep(2)
        on("ctl", "scontrol", "update", f"JobId={job}", "StartTime=now", repo=repo)
        return part

    try:
        first = stop(1, "Running stage 'train'")
        second = stop(2, "resuming from")
        wait_for(lambda: job_info(repo, job)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"),
                 "the job to end", timeout=600)
    finally:
        on("ctl", "scancel", job, repo=repo, check=False)
        params["train"]["checkpoint_every"] = TRAIN["checkpoint_every"]
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    info = job_info(repo, job)
    last = log.read_text()
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "2", "0:0"), (info, last[-3000:])
    stopped = [int(re.search(r"^stopped at step (\d+)/", p, re.M).group(1)) for p in (first, second)]
    resumed = [int(re.search(r"resuming from \S+ \(step (\d+)\)", p).group(1)) for p in (second, last)]
    assert 0 < stopped[0] == resumed[0] < stopped[1] == resumed[1] < TRAIN["steps"], (stopped, resumed)
    assert_bitwise_equal(repo / "models/ddpm", reference)


# --- a node lost ----------------------------------------------------------------------------------
def test_a_lost_node_fails_the_job_with_one_line_and_the_rerun_resumes(repo, reference):
    job, out = sbatch(repo, "lost", *TWO_NODES, wait=False)
    try:
        # frozen from the start and let on in slices (tests/frozen.py): the node is lost after the
        # first periodic checkpoint and before the training can end, at any speed
        workers = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(procs_of(repo, str(out), workers=True)),
                           "both workers")
        with frozen(workers):
            # its sidecar is written last: a checkpoint without one is not resumed from
            saved = run_in_slices(workers, lambda: list((out / "ckpt").rglob("step_*.sha256")),
                                  "the first periodic checkpoint and its sha256 sidecar")
            agents = procs_of(repo, str(out), workers=False)
            lost = [p for p in agents + workers if host_of(p) == "node2"]
            assert len(lost) == 2, (agents, workers)
            for pid in lost:  # node2 is gone: its agent and its worker at once
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: job_info(repo, job)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"),
                 "the job to end", timeout=300)
    finally:
        on("ctl", "scancel", job, repo=repo, check=False)
    log = Path(str(out) + ".log").read_text()
    assert job_info(repo, job)["JobState"] == "FAILED", log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, log[-3000:]
    assert "trained" not in log
    job, out = sbatch(repo, "lost", *TWO_NODES)
    log = Path(str(out) + ".log").read_text()
    assert job_info(repo, job)["JobState"] == "COMPLETED", log[-3000:]
    first_saved = int(re.search(r"step_(\d+)", saved[0].name).group(1))
    resumed = int(re.search(r"resuming from \S+ \(step (\d+)\)", log).group(1))
    assert first_saved <= resumed < TRAIN["steps"], (first_saved, resumed)
    assert_bitwise_equal(out / "model", reference)


# --- without SLURM --------------------------------------------------------------------------------
def test_two_hosts_without_slurm_equal_one_node_with_two_processes(repo, reference):
    out = repo.parent / "no_slurm"
    env = {**env_for(repo), "OMP_NUM_THREADS": "1"}  # outside SLURM, the user's share per node: 1 thread here
    procs = [subprocess.Popen([str(SCRIPT), "exec", f"node{k + 1}",
                               *train_cmd(out, "--nnodes", "2", "--node-rank", str(k), "--rdzv", "node1:29400")],
                              cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert sum(len(re.findall(r"^trained 12 steps", o, re.M)) for o in outputs) == 1, outputs
    assert_bitwise_equal(out / "model", reference)
