"""GPU slots: concurrent jobs get disjoint GPUs, all or nothing, and a killed job frees its GPUs.

Real processes and real flock(2) locks; only the device count is given (no CUDA here).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpmrepro.runtime import gpu_slots

ROOT = Path(__file__).resolve().parents[1]
# A job: takes N of COUNT GPUs, prints what it got, holds them until its stdin closes.
JOB = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from ddpmrepro.runtime import gpu_slots
n, count, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
try:
    gpu_slots.acquire(n, device_count=count, timeout=timeout or None, poll_s=0.05)
except gpu_slots.GpuSlotsError as e:
    print("ERROR", e, flush=True)
    sys.exit(3)
print("GOT", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
sys.stdin.read()
"""


@pytest.fixture
def env(tmp_path) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")}
    return {**e, "PYTHONPATH": str(ROOT / "src"), "DDPMREPRO_GPU_LOCK_DIR": str(tmp_path / "locks")}


class Job:
    def __init__(self, env: dict, n: int, count: int = 4, timeout: float = 0.0):
        self.proc = subprocess.Popen([sys.executable, "-c", JOB, str(n), str(count), str(timeout)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

    def wait_for(self, prefix: str, timeout: float = 20.0) -> str:
        """The first output line starting with prefix (blocks until it comes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            if line.startswith(prefix):
                return line.rstrip()
        raise AssertionError(f"no {prefix!r} line; output: {self.lines}")

    def gpus(self) -> set[str]:
        return set(self.wait_for("GOT").split()[1].split(","))

    def release(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=20) == 0


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for j in started:
        if j.proc.poll() is None:
            j.proc.kill()
            j.proc.wait()


def start(jobs, env, n, **kw) -> Job:
    jobs.append(Job(env, n, **kw))
    return jobs[-1]


def test_two_jobs_of_two_gpus_get_disjoint_sets(env, jobs):
    a, b = start(jobs, env, 2), start(jobs, env, 2)
    ga, gb = a.gpus(), b.gpus()
    assert len(ga) == len(gb) == 2
    assert ga.isdisjoint(gb) and ga | gb == {"0", "1", "2", "3"}


def test_a_four_gpu_job_waits_for_both_and_never_holds_part_of_a_set(env, jobs):
    a, b = start(jobs, env, 2), start(jobs, env, 2)
    ga, gb = a.gpus(), b.gpus()
    c = start(jobs, env, 4)
    c.wait_for("waiting for 4 free GPU(s)")
    a.release()
    # Two GPUs are free now. If the waiting 4-GPU job held them, this 2-GPU job could not get them.
    d = start(jobs, env, 2)
    assert d.gpus() == ga
    b.release()
    d.release()
    assert c.gpus() == {"0", "1", "2", "3"}


def test_a_killed_job_frees_its_gpus(env, jobs):
    a = start(jobs, env, 4)
    assert a.gpus() == {"0", "1", "2", "3"}
    b = start(jobs, env, 3)
    b.wait_for("waiting")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    assert len(b.gpus()) == 3


LAUNCHING_JOB = """
import os, sys
from ddpmrepro.runtime import gpu_slots, launch
gpu_slots.acquire(2, device_count=2, poll_s=0.05)
launch.run_launcher([sys.executable, "-c", "import os, time; print('CHILD', os.getpid(), flush=True); time.sleep(120)"])
"""


def test_the_launched_torchrun_dies_with_the_launcher_and_only_then_frees_the_gpus(env, jobs):
    # The launched process inherits the GPU locks, and dies with its launcher, however it dies: the
    # GPUs are never free while something that may use them runs, nor held by an orphan.
    import psutil

    parent = subprocess.Popen([sys.executable, "-c", LAUNCHING_JOB], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    child = psutil.Process(int(parent.stdout.readline().split()[1]))
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        gone, alive = psutil.wait_procs([child], timeout=20)
        assert not alive, "the launched process outlived its launcher"
    finally:
        if child.is_running():
            child.kill()
    assert start(jobs, env, 2, count=2).gpus() == {"0", "1"}


def test_timeout_names_the_busy_gpus_and_their_holder(env, jobs):
    a = start(jobs, env, 2, count=2)
    a.gpus()
    b = start(jobs, env, 1, count=2, timeout=0.3)
    line = b.wait_for("ERROR")
    assert f"0 (pid {a.proc.pid}), 1 (pid {a.proc.pid})" in line and "after 0 s" in line
    assert b.proc.wait(timeout=20) == 3


def test_more_gpus_than_exist_is_one_clear_error(tmp_path):
    env = {"DDPMREPRO_GPU_LOCK_DIR": str(tmp_path)}
    with pytest.raises(gpu_slots.GpuSlotsError, match=r"^5 GPUs asked for but this machine has 4; lower"):
        gpu_slots.acquire(5, device_count=4, env=env)
    env["CUDA_VISIBLE_DEVICES"] = "1,3"
    with pytest.raises(gpu_slots.GpuSlotsError, match=r"3 GPUs asked for but this machine has 2 \(CUDA_VISIBLE_DEVICES=1,3\)"):
        gpu_slots.acquire(3, device_count=2, env=env)
    assert "CUDA_VISIBLE_DEVICES" in env and env["CUDA_VISIBLE_DEVICES"] == "1,3"  # untouched on error


def test_an_existing_cuda_visible_devices_is_the_pool(env, jobs):
    env = {**env, "CUDA_VISIBLE_DEVICES": "2,5,7"}  # e.g. set by the user or by SLURM
    a, b = start(jobs, env, 2, count=3), start(jobs, env, 1, count=3)
    ga, gb = a.gpus(), b.gpus()
    assert ga | gb == {"2", "5", "7"} and ga.isdisjoint(gb)
    c = start(jobs, env, 1, count=3)
    c.wait_for("waiting for 1 free GPU(s) among 2,5,7")


def test_slurm_jobs_lock_only_within_their_own_allocation(env, jobs):
    # SLURM numbers each job's GPUs from 0: jobs 11 and 12 must not wait for each other,
    # two processes of job 11 must still get different GPUs.
    job11 = {**env, "SLURM_JOB_ID": "11", "CUDA_VISIBLE_DEVICES": "0,1"}
    a = start(jobs, job11, 1, count=2)
    b = start(jobs, {**job11}, 1, count=2)
    c = start(jobs, {**env, "SLURM_JOB_ID": "12", "CUDA_VISIBLE_DEVICES": "0,1"}, 2, count=2)
    assert a.gpus().isdisjoint(b.gpus())
    assert c.gpus() == {"0", "1"}
    assert gpu_slots.lock_dir({"DDPMREPRO_GPU_LOCK_DIR": "/x", "SLURM_JOB_ID": "11"}) == Path("/x/slurm-11")


def test_claim_opt_out_and_wait_setting(tmp_path):
    env = {"DDPMREPRO_GPU_LOCK_DIR": str(tmp_path), "DDPMREPRO_GPU_SLOTS": "0"}
    assert gpu_slots.claim(2, device_count=4, env=env) is None
    assert "CUDA_VISIBLE_DEVICES" not in env and not any(tmp_path.iterdir())
    env = {"DDPMREPRO_GPU_LOCK_DIR": str(tmp_path), "DDPMREPRO_GPU_WAIT": "soon"}
    with pytest.raises(gpu_slots.GpuSlotsError, match="DDPMREPRO_GPU_WAIT='soon' is not a number of seconds"):
        gpu_slots.claim(1, device_count=1, env=env)


def test_default_lock_dir_is_per_user_under_tmpdir(tmp_path):
    assert gpu_slots.lock_dir({"TMPDIR": str(tmp_path)}) == tmp_path / f"ddpmrepro-gpus-{os.getuid()}"
    with pytest.raises(gpu_slots.slots.SlotsError, match="TMPDIR=/nonexistent-scratch is not a directory .the GPU"):
        gpu_slots.lock_dir({"TMPDIR": "/nonexistent-scratch"})


@pytest.fixture
def four_fake_gpus(monkeypatch, tmp_path):
    """The CLI's view of a 4-GPU machine. The device count is the one thing faked: no CUDA here."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # restored after the test
    monkeypatch.setenv("DDPMREPRO_GPU_LOCK_DIR", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    yield
    while gpu_slots._HELD:
        os.close(gpu_slots._HELD.pop())


def test_cli_takes_gpus_before_it_launches(four_fake_gpus):
    from ddpmrepro.runtime.launch import LaunchError
    from ddpmrepro.runtime.launch import check_devices as _check_devices

    _check_devices("cpu", 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # a CPU run claims nothing
    _check_devices("auto", 2, claim=False)  # multi-node: SLURM hands out the nodes
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    with pytest.raises(LaunchError, match=r"^sample.nproc=5 processes need 5 GPUs but 4 are visible"):
        _check_devices("auto", 5, key="sample.nproc")
    _check_devices("auto", 3)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert len(gpu_slots._HELD) == 3


def test_an_unusable_lock_directory_is_one_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = {"DDPMREPRO_GPU_LOCK_DIR": str(not_a_dir / "locks")}
    with pytest.raises(gpu_slots.GpuSlotsError, match=r"^cannot create the GPU lock directory .*/file/locks: Not a directory; set"):
        gpu_slots.acquire(1, device_count=2, env=env)
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "gpu0.lock").mkdir()  # something in the way of a lock file
    with pytest.raises(gpu_slots.GpuSlotsError, match=r"^cannot open .*gpu0.lock: Is a directory; set DDPMREPRO_GPU_LOCK_DIR"):
        gpu_slots.acquire(1, device_count=2, env={"DDPMREPRO_GPU_LOCK_DIR": str(tmp_path / "locks")})
