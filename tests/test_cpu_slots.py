"""CPU slots: concurrent jobs run on disjoint cores with their share of threads, or wait their turn.

Real processes, real flock(2) locks and real CPU affinity (this machine's cores).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmrepro.runtime import cpu_slots

ROOT = Path(__file__).resolve().parents[1]
CORES = sorted(os.sched_getaffinity(0))
needs_2_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 usable cores")
# A job: claims its cores for NPROC processes, reports them, holds them until stdin closes.
JOB = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
import torch
from ddpmrepro.runtime import cpu_slots
try:
    cpu_slots.claim(int(sys.argv[1]), timeout=float(sys.argv[2]) or None, poll_s=0.05)
except cpu_slots.CpuSlotsError as e:
    print("ERROR", e, flush=True)
    sys.exit(3)
cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
print("GOT", cores, torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], flush=True)
sys.stdin.read()
"""


@pytest.fixture
def env(tmp_path) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SLURM_JOB_ID", "DDPMREPRO_CPU_SLOTS")}
    return {**e, "PYTHONPATH": str(ROOT / "src"), "DDPMREPRO_CPU_LOCK_DIR": str(tmp_path / "locks")}


class Job:
    def __init__(self, env: dict, nproc: int = 1, timeout: float = 0.0):
        self.proc = subprocess.Popen([sys.executable, "-c", JOB, str(nproc), str(timeout)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

    def wait_for(self, prefix: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith(prefix):
                return line.rstrip()
        raise AssertionError(f"no {prefix!r} line; output: {self.lines}")

    def got(self) -> tuple[set[int], int, int]:
        """(the cores it runs on, torch's thread count, OMP_NUM_THREADS for its workers)."""
        _, cores, threads, omp = self.wait_for("GOT").split()
        return {int(c) for c in cores.split(",")}, int(threads), int(omp)

    def release(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield lambda env, **kw: started.append(Job(env, **kw)) or started[-1]
    for j in started:
        if j.proc.poll() is None:
            j.proc.kill()
            j.proc.wait()


def test_share_is_omp_num_threads_capped_at_the_usable_cores_else_all_of_them():
    assert cpu_slots.share({}, cores=8) == 8
    assert cpu_slots.share({"OMP_NUM_THREADS": "2"}, cores=8) == 2
    assert cpu_slots.share({"OMP_NUM_THREADS": "16"}, cores=8) == 8
    assert cpu_slots.share({"OMP_NUM_THREADS": " "}, cores=8) == 8  # set but empty: as unset
    for bad in ("0", "-2"):
        with pytest.raises(cpu_slots.CpuSlotsError, match=f"OMP_NUM_THREADS='{bad}' is not a number of threads "
                           r"\(at least 1\); unset it to use all 8 usable cores"):
            cpu_slots.share({"OMP_NUM_THREADS": bad}, cores=8)
    with pytest.raises(cpu_slots.CpuSlotsError, match="OMP_NUM_THREADS='two' is not a whole number"):
        cpu_slots.share({"OMP_NUM_THREADS": "two"}, cores=8)


@needs_2_cores
def test_two_one_thread_jobs_run_side_by_side_on_disjoint_cores(env, jobs):
    a, b = jobs({**env, "OMP_NUM_THREADS": "1"}), jobs({**env, "OMP_NUM_THREADS": "1"})
    (ca, ta, _), (cb, tb, _) = a.got(), b.got()
    assert len(ca) == len(cb) == 1 and ca.isdisjoint(cb)
    assert ta == tb == 1


@needs_2_cores
def test_a_job_without_a_share_takes_every_core_and_the_next_waits_its_turn(env, jobs):
    a = jobs(env)
    cores, threads, _ = a.got()
    assert cores == set(CORES) and threads == len(CORES)
    b = jobs({**env, "OMP_NUM_THREADS": "1"})
    b.wait_for("waiting for 1 free CPU core(s)")  # never a 2nd thread on a busy core
    a.release()
    assert len(b.got()[0]) == 1


@needs_2_cores
def test_torchrun_workers_share_the_claimed_cores(env, jobs):
    # 2 processes in a job whose share is 1 core: 2 cores, 1 thread each (what OMP_NUM_THREADS tells torchrun)
    cores, _, omp = jobs({**env, "OMP_NUM_THREADS": "1"}, nproc=2).got()
    assert len(cores) == 2 and omp == 1


@needs_2_cores
def test_timeout_names_the_busy_cores_and_their_holder(env, jobs):
    a = jobs(env)
    a.got()
    b = jobs({**env, "OMP_NUM_THREADS": "1"}, timeout=0.3)
    line = b.wait_for("ERROR")
    assert f"{CORES[0]} (pid {a.proc.pid})" in line and "no 1 free CPU core(s)" in line
    assert b.proc.wait(timeout=20) == 3


def test_off_switch_changes_nothing(tmp_path):
    env = {"DDPMREPRO_CPU_SLOTS": "0", "DDPMREPRO_CPU_LOCK_DIR": str(tmp_path / "locks")}
    assert cpu_slots.claim(env=env) == []
    assert env == {"DDPMREPRO_CPU_SLOTS": "0", "DDPMREPRO_CPU_LOCK_DIR": str(tmp_path / "locks")}
    assert not (tmp_path / "locks").exists()


def test_slurm_jobs_lock_within_their_own_allocation(tmp_path):
    assert cpu_slots.lock_dir({"DDPMREPRO_CPU_LOCK_DIR": "/x", "SLURM_JOB_ID": "11"}) == Path("/x/slurm-11")
    assert cpu_slots.lock_dir({"TMPDIR": str(tmp_path)}) == tmp_path / f"ddpmrepro-cpus-{os.getuid()}"


def test_a_tmpdir_that_is_not_there_is_refused_not_made(tmp_path):
    """A misspelt TMPDIR made on the spot held locks no other job saw: two jobs shared the cores."""
    missing = tmp_path / "scrach"
    with pytest.raises(cpu_slots.slots.SlotsError, match=f"TMPDIR={missing} is not a directory .the CPU locks"):
        cpu_slots.lock_dir({"TMPDIR": str(missing)})
    assert not missing.exists()
    # a SLURM job's locks are its own, under the TMPDIR it was given (one exported from the login
    # node may be missing on the compute node): made there, as before
    assert cpu_slots.lock_dir({"TMPDIR": str(missing), "SLURM_JOB_ID": "7"}) == \
        missing / f"ddpmrepro-cpus-{os.getuid()}" / "slurm-7"
