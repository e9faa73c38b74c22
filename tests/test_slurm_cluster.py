"""The SLURM path for real: a one-node cluster from Debian's packages (scripts/local_slurm.sh up),
real Snakemake with profiles/slurm and the real plugin, real sbatch jobs, a temporary git + DVC
repo on tiny params. What a user types: `snakemake --workflow-profile profiles/slurm
--default-resources slurm_account=... slurm_partition=...`, nothing else.

- every stage is a job that COMPLETED with the CPUs, memory and time limit of its dvc.yaml meta
  (as `scontrol show job` reports them), metrics.json is written, `dvc status` is clean, `git
  status` shows only what a user commits, and a second submission submits nothing;
- a job that fails leaves the git-tracked outputs as they were;
- requests no node can run, and sacct as the status source without accounting, stop the run
  at once, naming the stage and the resource;
- a training stopped by `scancel --signal=TERM` while it starts (before its handler exists), then
  by `scancel --signal=TERM` and by `--signal=TERM@120` before its time limit, checkpoints,
  requeues itself each time (same job: Restarts=3, COMPLETED) and ends bitwise equal to an
  uninterrupted run;
- `ddpmrepro train` with train.nproc 2 in an sbatch allocation runs torchrun and equals the
  same run outside SLURM bitwise.

Skipped, with the reason, only where SLURM cannot be brought up here (not root, no apt-get, a
SLURM setup of its own). The cluster is left as found: brought down again if this module
brought it up.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
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
SCRIPT = ROOT / "scripts" / "local_slurm.sh"
BIN = str(Path(sys.executable).parent)
ACCOUNT = ["--default-resources", "slurm_account=ddpmrepro", "slurm_partition=debug"]
TINY = {
    "train": {"steps": 12, "batch_per_proc": 32, "warmup_steps": 2, "checkpoint_every": 5, "log_every": 4},
    "diffusion": {"timesteps": 50},
    "introspect": {"every": 4, "steps": [1]},
    "sample": {"per_class": 3, "respacing": "ddim5", "batch_size": 16},
    "evaluator": {"epochs": 1},
    "evaluate": {"bpd_images": 4},
}
# The trainings that are stopped: long enough to be caught between steps, checkpoints only on SIGTERM.
STOPPED = {"steps": 100, "batch_per_proc": 8, "warmup_steps": 2, "checkpoint_every": 1000, "log_every": 2}
STAGES = {"prepare", "fit_evaluator", "train", "sample", "bits_per_dim", "evaluate", "report"}

pytestmark = pytest.mark.slow


def why_no_slurm() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return ("needs root: it starts SLURM (scripts/local_slurm.sh up) and moves jobs' time limits; "
                "run `sudo scripts/local_slurm.sh up` and this test as root, or see docs/CLUSTER.md")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "SLURM is not installed and there is no apt-get to install it (Debian/Ubuntu only)"
    conf = Path("/etc/slurm/slurm.conf")
    if conf.exists() and "scripts/local_slurm.sh" not in conf.read_text().splitlines()[0]:
        return "this machine has its own SLURM setup (/etc/slurm/slurm.conf); the test will not touch it"
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = why_no_slurm()
    if reason:
        pytest.skip(reason)
    was_up = subprocess.run([SCRIPT, "status"], capture_output=True).returncode == 0
    if not was_up:
        proc = subprocess.run([SCRIPT, "up"], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    yield
    if not was_up:
        subprocess.run([SCRIPT, "down"], capture_output=True, timeout=300)


def run(repo: Path, *cmd: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
           "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def snakemake(repo: Path, *args: str, check: bool = True) -> str:
    """The user's command (targets first); returns its output."""
    proc = run(repo, "snakemake", *args, "--workflow-profile", "profiles/slurm", *ACCOUNT, check=check)
    return proc.stdout + proc.stderr


def submitted(output: str) -> dict[str, str]:
    """rule -> SLURM job id, from the plugin's 'submitted with SLURM jobid N (log: .../rule_X/N.log)'."""
    return {rule: job for job, rule in re.findall(r"SLURM jobid (\d+) \(log: \S*/rule_(\w+)/", output)}


def job_info(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def seconds(duration: str) -> int:
    """scontrol's [D-]HH:MM:SS."""
    days, _, hms = duration.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def set_params(repo: Path, **sections) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in sections.items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def repo(tmp_path_factory, cluster) -> Path:
    repo = tmp_path_factory.mktemp("slurm_e2e")
    copy_project(repo, extra=("params.yaml",))
    set_params(repo, **TINY)
    run(repo, "git", "init", "-q", "-b", "main")
    run(repo, "dvc", "init", "-q")
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "tiny pipeline")
    return repo


def node_cpus() -> int:
    return int(subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%c"], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def expected_job(stage: str, node_cpus: int, params: dict) -> dict:
    """CPUs, MB and minutes a stage's job gets on this CPU-only node, from dvc.yaml's meta."""
    meta = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["meta"]["snakemake"]
    res, threads = meta.get("resources", {}), meta.get("threads", 1)
    if "gpu" in res:  # ${train.nproc} processes, on CPUs here: `threads` each, as many as fit
        procs = params[stage]["nproc"]
        cpus = procs * max(1, min(threads, node_cpus // procs))
    else:
        cpus = min(threads, node_cpus)
    mem = res["mem_mb_per_cpu"] * cpus if "mem_mb_per_cpu" in res else res["mem_mb"]
    return {"cpus": cpus, "mem_mb": mem, "minutes": res["runtime"]}


def test_pipeline_runs_as_slurm_jobs_with_each_stages_resources(repo):
    out = snakemake(repo)
    jobs = submitted(out)
    assert set(jobs) == STAGES, out[-3000:]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for stage, job in jobs.items():
        info, want = job_info(job), expected_job(stage, node_cpus(), params)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (stage, info)
        assert info["Comment"] == f"rule_{stage}" and info["Partition"] == "debug" and info["Account"] == "ddpmrepro"
        assert int(info["NumCPUs"]) == want["cpus"], (stage, info["NumCPUs"], want)
        assert re.search(rf"(^|,)mem={want['mem_mb']}M", info["TRES"]), (stage, info["TRES"], want)
        assert seconds(info["TimeLimit"]) == 60 * want["minutes"], (stage, info["TimeLimit"])
    # train and sample ask for train.nproc GPUs in dvc.yaml; this partition has none
    assert "train: partition 'debug' has no GPUs: its 1 process(es) run on" in out
    metrics = json.loads((repo / "metrics.json").read_text())
    detail = json.loads((repo / "reports/metrics_detail.json").read_text())
    assert isinstance(metrics["class_acc"], float) and detail["samples"]["n_gen"] == 30
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status").stdout
    # git sees what a user commits after a run (docs/CLUSTER.md), and nothing else
    status = run(repo, "git", "status", "--porcelain", "--untracked-files=all").stdout.splitlines()
    changed = {line[3:] for line in status}
    commit = {"dvc.lock", "metrics.json", "reports/metrics_detail.json", "reports/metrics.html", "reports/bpd.json",
              "data/.gitignore", "models/.gitignore", "reports/.gitignore", "reports/train/live/.gitignore"}
    folders = ("reports/train/live/plots/", "reports/params/")  # dvclive's series; params resolved per section
    assert {p for p in changed if not p.startswith(folders)} == commit, status
    assert {p.split("/")[1] for p in changed if p.startswith(folders)} == {"train", "params"}, status
    assert not [p for p in changed if ".snakemake" in p or p.startswith("logs/")], status
    run(repo, "git", "add", *commit, *folders)
    run(repo, "git", "commit", "-qm", "results")
    assert run(repo, "git", "status", "--porcelain", "--untracked-files=all").stdout == ""


def test_second_submission_submits_nothing(repo):
    out = snakemake(repo)
    assert "Nothing to be done" in out and not submitted(out)


def test_failed_job_keeps_the_git_tracked_outputs(repo):
    tracked = {p: (repo / p).read_bytes()
               for p in run(repo, "git", "ls-files", "metrics.json", "reports/train/live").stdout.split()}
    assert "metrics.json" in tracked and "reports/train/live/plots/metrics/loss.tsv" in tracked
    # A valid params.yaml (a bad one, or one a later stage would refuse of itself, stops Snakemake before
    # any job: check_params) naming a published checkpoint that is damaged: only the train job can
    # find out, and it exits 1 at startup, after DVC removed the stage's outputs.
    broken = repo / "models/published/broken.pt"
    broken.write_bytes(b"not a checkpoint" * 64)
    set_params(repo, train={"import_from": "models/published/broken.pt"})
    out = snakemake(repo, "--retries", "0", check=False)
    assert job_info(submitted(out)["train"])["JobState"] == "FAILED", out[-3000:]
    assert "Error: models/published/broken.pt: " in (repo / "logs/dvc/train.log").read_text()
    changed = sorted(line[3:] for line in run(repo, "git", "status", "--porcelain").stdout.splitlines())
    # check_params ran (a local rule) and DVC recorded it; the train stage's record is as it was
    assert changed == ["dvc.lock", "models/published/broken.pt", "params.yaml", "reports/params/train.yaml"], changed
    committed_lock = yaml.safe_load(run(repo, "git", "show", "HEAD:dvc.lock").stdout)
    assert yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["train"] == committed_lock["stages"]["train"]
    assert {p: (repo / p).read_bytes() for p in tracked} == tracked
    broken.unlink()
    run(repo, "git", "checkout", "dvc.lock", "params.yaml", "reports/params")


def test_requests_no_node_can_run_and_a_blind_status_source_stop_the_run_at_once(repo):
    set_params(repo, train={"device": "cuda"})  # train and everything after it are to run
    start = time.time()
    # The plugin's default sacct, here without accounting: it waited for ever, deaf to Ctrl-C.
    out = snakemake(repo, "--set-resources", "evaluate:cpus_per_task=64", "--slurm-status-command", "sacct",
                    check=False)
    assert time.time() - start < 120 and not submitted(out), out[-3000:]
    assert "Error: this cluster keeps no accounting (AccountingStorageType=none), so sacct never reports" in out
    assert "Error: stage 'train' asks for 1 GPU(s) but partition 'debug' has no GPUs; train.device is 'cuda'" in out
    assert re.search(r"Error: stage 'evaluate' asks for 64 CPUs \(cpus_per_task\) but the largest node of partition "
                     r"'debug' has \d+", out), out[-3000:]
    run(repo, "git", "checkout", "params.yaml", "reports/params")


# --- preemption -----------------------------------------------------------------------------------
def find_training(repo: Path) -> int | None:
    """The pid of the `ddpmrepro train` process that DVC started in this repo (train.nproc 1), if
    it runs. DVC runs the stage's command with $SHELL, or /bin/sh where SHELL is unset (as in CI);
    dash, unlike bash, does not exec the command, so a `/bin/sh -c "... ddpmrepro.cli train ..."`
    stays above the training. That shell ignores SIGTERM (dvc_stage.sh's trap, inherited):
    freezing it instead of the training waits for a signal that can never be pending."""
    for pid in subprocess.run(["pgrep", "-f", "ddpmrepro.cli train --data"], capture_output=True,
                              text=True).stdout.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[1:3] == [b"-m", b"ddpmrepro.cli"] and Path(f"/proc/{pid}/cwd").resolve() == repo.resolve():
                return int(pid)
        except OSError:
            continue
    return None


def kill_processes_in(repo: Path) -> None:
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if d.name.isdigit() and int(d.name) != os.getpid() and (d / "cwd").resolve() == repo.resolve():
                os.kill(int(d.name), signal.SIGKILL)


def signal_diagnosis(pid: int, job: str, log: Path) -> str:
    """What a missing SIGTERM leaves to go on: the process's signal masks and its parents up to
    slurmstepd (which signals the step's process tree), the job, and the ends of both logs."""
    lines = []
    p = pid
    while p > 1:
        try:
            status = dict(line.split(":\t", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                          if ":\t" in line)
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError as e:
            lines.append(f"pid {p}: {e}")
            break
        fields = " ".join(f"{k}={status.get(k, '?').strip()}" for k in ("State", "ShdPnd", "SigPnd", "SigBlk",
                                                                        "SigIgn", "SigCgt"))
        lines.append(f"pid {p} ({fields}): {cmd}")
        p = int(status["PPid"])
    lines.append(subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout)
    for f in (log, Path("/var/log/slurm/slurmd.log")):
        lines += f.read_text(errors="replace").splitlines()[-15:] if f.exists() else [f"{f}: none"]
    return "\n".join(lines)


def wait_for(cond, what: str, timeout: float = 600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stop_with(repo: Path, job: str, send_term, restarts: int, after: str) -> str:
    """Freezes the training as soon as its process runs, lets it run in short slices until a step
    is logged after `after` (tests/frozen.py: however fast it trains), has SLURM send SIGTERM
    (send_term), lets the training go on once the signal is pending, and waits until the job has
    requeued itself. SLURM's TERM@120 comes at its own pace (it checks every 30 s): the freeze
    takes the training's speed out of the test. Returns the log of the part that was stopped."""
    log = repo / "logs/dvc/train.log"
    pid = wait_for(lambda: find_training(repo), f"the training process of SLURM job {job}")
    with frozen([pid]):
        run_in_slices([pid], lambda: log.exists() and re.search(rf"{after}(.*\n)*step [1-9]\d*/", log.read_text()),
                      f"a step logged after '{after}'")
        send_term()
        try:
            wait_for(lambda: term_delivered(pid), "SLURM's SIGTERM", timeout=300)
        except AssertionError as e:  # with what the process tree and SLURM looked like
            raise AssertionError(f"{e}\n{signal_diagnosis(pid, job, log)}") from None
    return requeued(repo, job, restarts)


def stage_shell(pid: int) -> int:
    """The dvc_stage.sh shell above a process."""
    p = pid
    while p > 1:
        if b"dvc_stage.sh" in Path(f"/proc/{p}/cmdline").read_bytes():
            return p
        p = int(re.search(r"^PPid:\s*(\d+)", Path(f"/proc/{p}/status").read_text(), re.M).group(1))
    raise AssertionError(f"no dvc_stage.sh above pid {pid}")


def sigterm_disposition(pid: int) -> str:
    """'ignored', 'caught' (a handler) or 'default', from /proc (SIGTERM is bit 15 of the masks)."""
    masks = dict(re.findall(r"^(SigIgn|SigCgt):\s*([0-9a-f]+)", Path(f"/proc/{pid}/status").read_text(), re.M))
    return next((what for what, key in (("ignored", "SigIgn"), ("caught", "SigCgt")) if int(masks[key], 16) >> 14 & 1),
                "default")


def stop_while_starting(repo: Path, job: str) -> str:
    """Freezes the training process as soon as it exists (Python still starting: SIGTERM is ignored,
    as dvc_stage.sh passes it on, and the training's handler is not there yet) and the stage's shell,
    has SLURM send SIGTERM, lets the shell take it, and the training go on once the shell has left
    the stop file. Until that file, such a signal was lost: the training ran on to SLURM's SIGKILL.
    Returns the log of the part that was stopped."""
    pid = wait_for(lambda: find_training(repo), f"the training process of SLURM job {job}")
    shell = stage_shell(pid)
    with frozen([pid, shell]):
        assert sigterm_disposition(pid) == "ignored", "the training had its SIGTERM handler: the test came too late"
        subprocess.run(["scancel", "--signal=TERM", job], check=True)
        try:
            wait_for(lambda: term_delivered(shell), "SLURM's SIGTERM to the stage's shell", timeout=300)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{signal_diagnosis(shell, job, repo / 'logs/dvc/train.log')}") from None
        environ = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
        stop_file = Path(environ[b"DDPMREPRO_STOP_FILE"].decode())
        os.kill(shell, signal.SIGCONT)  # it takes the signal: the file, then the training
        wait_for(stop_file.exists, f"the stop file {stop_file}", timeout=60)
    return requeued(repo, job, 1)


def requeued(repo: Path, job: str, restarts: int) -> str:
    """Waits until the stopped job has requeued itself (its `restarts`-th time) and lets it start
    again; returns the log of the part that was stopped."""
    wait_for(lambda: job_info(job)["Restarts"] == str(restarts), f"restart {restarts} of job {job}")
    part = (repo / f"logs/dvc/train.slurm-{job}-{restarts - 1}.log").read_text()
    assert f"requeueing SLURM job {job}" in part, part[-2000:]
    # Once requeued (PENDING), SLURM holds the job for about two minutes before it may start again: not
    # here. But slurmd revokes the job's credential when it ends the old part, to the second: a part
    # started in that second was killed at once as "non-startable: Job credential revoked" while its
    # batch script ran on, outside the job (a CI run, and this test with the 2-node cluster up).
    # So: the node done with the old part (not COMPLETING), then a later second.
    wait_for(lambda: job_info(job)["JobState"] == "PENDING", f"job {job} pending again")
    wait_for(lambda: "completing" not in subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%T"], capture_output=True,
                                                         text=True, check=True).stdout, "the node done with the old part")
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    return part


def stopped_at(part: str) -> int:
    return int(re.search(r"^stopped at step (\d+)/", part, re.M).group(1))


def resumed_from(part: str) -> int:
    return int(re.search(r"resuming from \S+ \(step (\d+)\)", part).group(1))


@pytest.fixture(scope="module")
def uninterrupted(repo) -> Path:
    """The repo with STOPPED training params, and the uninterrupted training of them outside SLURM."""
    set_params(repo, train=STOPPED)
    run(repo, "git", "commit", "-qam", "a longer training")
    run(repo, "dvc", "repro", "prepare")  # done already when the whole module runs
    ref = repo.parent / "uninterrupted"
    # As many threads as the job's training has (Snakemake sets OMP_NUM_THREADS to the job's
    # threads): CPU results depend on the thread count, not on anything else here.
    threads = expected_job("train", node_cpus(), yaml.safe_load((repo / "params.yaml").read_text()))["cpus"]
    subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "train", "--data", "data/prepared",
                    "--out", str(ref / "model"), "--live", str(ref / "live"), "--introspect", str(ref / "introspect"),
                    "--checkpoints", str(ref / "ckpt")], cwd=repo, check=True, capture_output=True, timeout=1800,
                   env={**os.environ, "PYTHONPATH": str(repo / "src"), "OMP_NUM_THREADS": str(threads)})
    return ref / "model"


def assert_bitwise_equal(a: Path, b: Path) -> None:
    """The weights and EMA weights in two model directories, tensor by tensor."""
    def weights(model_dir: Path) -> dict[str, torch.Tensor]:
        return {f.name + ":" + k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_weights(f).items()}
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and len(wa) > 1
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])][:5]


def test_training_stopped_by_scancel_and_by_its_time_limit_requeues_and_resumes_bitwise(repo, uninterrupted):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
           "DVC_NO_ANALYTICS": "1"}
    out_path = repo.parent / "snakemake_train.log"
    (repo / "logs/dvc/train.log").unlink(missing_ok=True)  # an earlier test's: its steps are not this training's
    with open(out_path, "w") as out:
        # SIGTERM 120 s before the time limit, as the profile's 300 s would be for a real training.
        # SLURM sends it at one of its 30-s checks, so 90-120 s before the limit: the training
        # saves, the job requeues itself and SLURM ends it well before. (With TERM@60, 30-60 s
        # before, one CI run saw a second submission, most likely the limit reached while the
        # requeued job was still ending: TIMEOUT for a moment, and the plugin retried.)
        proc = subprocess.Popen(["snakemake", "train", "--workflow-profile", "profiles/slurm", *ACCOUNT,
                                 "--set-resources", "train:runtime=30", "train:slurm_extra='--signal=TERM@120'"],
                                cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    job = None
    try:
        job = wait_for(lambda: submitted(out_path.read_text()).get("train"), "the train job")
        # 0. SIGTERM while the training starts (dvc, Python and torch loading), before its handler
        starting = stop_while_starting(repo, job)
        # 1. scancel --signal=TERM, as a user or a preemption would
        first = stop_with(repo, job, lambda: subprocess.run(["scancel", "--signal=TERM", job], check=True), 2,
                          after="resuming from")

        # 2. the time limit, brought forward so that TERM@120 is due at SLURM's next checks
        def time_limit_near():
            elapsed = seconds(job_info(job)["RunTime"])
            subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={-(-(elapsed + 121) // 60)}"], check=True)
        second = stop_with(repo, job, time_limit_near, 3, after="resuming from")
        subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=30"], check=True)
        assert proc.wait(timeout=1800) == 0, out_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            if job:
                subprocess.run(["scancel", job])
            # What SLURM no longer counts as the job's (one CI run left a DVC behind that held the
            # repo's lock, and the next test failed on it): nothing of this test may outlive it.
            kill_processes_in(repo)
    output = out_path.read_text()
    # One submission: the job requeued itself, no retry (the plugin's reason, if it retried).
    assert re.findall(r"SLURM jobid (\d+)", output) == [job], [l for l in output.splitlines() if "fail" in l.lower()]
    assert "slurm_extra=--signal=TERM@120" in output
    info = job_info(job)
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "3", "0:0"), info
    # Each signal stopped the training between two steps, where it saved (checkpoint_every is
    # 1000), and the next part resumed from there; the one that came while it started, after its first step.
    assert "SIGTERM came while the training was starting: saving a checkpoint at the end of the first step" in starting
    last = (repo / "logs/dvc/train.log").read_text()
    assert (stopped_at(starting) == 1 == resumed_from(first) < stopped_at(first) == resumed_from(second)
            < stopped_at(second) == resumed_from(last) < STOPPED["steps"])
    assert f"trained {STOPPED['steps']} steps" in last
    assert_bitwise_equal(repo / "models/ddpm", uninterrupted)
    assert "Data and pipelines are up to date" in run(repo, "dvc", "status", "train").stdout


# --- DDP inside an allocation ---------------------------------------------------------------------
SMALL_MODEL = {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
               "num_head_channels": 16, "dropout": 0.0}


def test_ddp_in_an_sbatch_allocation_equals_the_run_outside_slurm(repo):
    run(repo, "dvc", "repro", "prepare")  # done already when the whole module runs
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["model"].update(SMALL_MODEL)
    params["train"].update(nproc=2, steps=8, batch_per_proc=8, checkpoint_every=4, log_every=2)
    (repo.parent / "ddp.yaml").write_text(yaml.safe_dump(params))

    def train(out: Path) -> list[str]:
        return [sys.executable, "-m", "ddpmrepro.cli", "-v", "train", "--params", str(repo.parent / "ddp.yaml"),
                "--data", "data/prepared", "--out", str(out / "model"), "--live", str(out / "live"),
                "--introspect", str(out / "introspect"), "--checkpoints", str(out / "ckpt")]
    inside, outside = repo.parent / "ddp_inside", repo.parent / "ddp_outside"
    # A batch script as docs/CLUSTER.md gives it: `ddpmrepro train` once; it starts torchrun itself.
    script = repo.parent / "ddp.sbatch"
    script.write_text(f"#!/bin/bash\ncd {repo}\nexport OMP_NUM_THREADS=1\n{' '.join(train(inside))}\n")
    job_log = repo.parent / "ddp_job.log"
    proc = run(repo, "sbatch", "--wait", "--parsable", "-p", "debug", "-c", "2", "--mem", "4000", "-t", "10",
               "-o", str(job_log), str(script), check=False)
    job = proc.stdout.strip().split(";")[0]
    assert proc.returncode == 0 and job_info(job)["JobState"] == "COMPLETED", proc.stderr + job_log.read_text()[-3000:]
    assert "-m ddpmrepro.runtime.torchrun --standalone --nproc_per_node=2" in job_log.read_text(), job_log.read_text()[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    subprocess.run(train(outside), cwd=repo, env={**env, "PYTHONPATH": str(repo / "src"), "OMP_NUM_THREADS": "1"},
                   check=True, capture_output=True, timeout=900)
    assert_bitwise_equal(inside / "model", outside / "model")
