"""CPU cores for torch jobs that run at the same time on one machine.

torch's CPU threads spin while they wait for work, so oversubscribed cores are ruinous: two
2-thread torch processes on 2 cores ran at a tenth of the speed of one alone (700 -> 70
images/s). Before it computes on the CPU, each stage command (fit-evaluator, train, sample,
evaluate) takes one lock per thread it will run, on as many of the cores it may use (its
affinity), pins itself to those cores and sets torch's thread count to match. A job that finds
too few free cores waits for them, all or nothing, as with GPUs (slots.py). So concurrent jobs
(`dvc queue start -j 2`, two Snakemake runs, a shell beside a sweep) never oversubscribe: they
run side by side on disjoint cores when their thread counts fit, and take turns otherwise.

How many threads (the job's share): OMP_NUM_THREADS when it is set (Snakemake sets it to each
job's `threads`, scaled down to `--cores`), else every core the process may run on. The share is
not derived from how many other jobs happen to be running, on purpose: on CPU, torch's results
depend bitwise on the thread count (reductions are split per thread), so a share that changed
with the load would make an experiment's numbers depend on what else ran. With a fixed share, a
run gives the same bits alone or in a sweep. To run a CPU sweep side by side rather than in
turns, give each job its share: `OMP_NUM_THREADS=1 dvc queue start -j 2` on 2 cores.

Lock files live in `$DDPMREPRO_CPU_LOCK_DIR`, else `$TMPDIR/ddpmrepro-cpus-$UID` (inside a SLURM
job, a `slurm-<job id>` subfolder: SLURM already gives each job its own cores). The claim is made
by the launching process and inherited by torchrun's workers, which share the claimed cores.
`DDPMREPRO_CPU_SLOTS=0` turns it all off (torch then picks its own thread count);
`DDPMREPRO_CPU_WAIT=SECONDS` gives up waiting after that long.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from . import slots

log = logging.getLogger(__name__)

_HINT = "; set DDPMREPRO_CPU_LOCK_DIR to a directory of your own"
_CLAIMED: list[int] = []  # this process's cores: a second claim (in-process callers) keeps them


class CpuSlotsError(slots.SlotsError):
    """No free cores within DDPMREPRO_CPU_WAIT, or an unusable lock directory (one line)."""


def lock_dir(env=os.environ) -> Path:
    return slots.lock_dir("cpus", env)


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity: taskset, cgroups, SLURM)."""
    return sorted(os.sched_getaffinity(0))


def share(env=os.environ, cores: int | None = None) -> int:
    """The job's thread count: OMP_NUM_THREADS if set (at most the usable cores), else all of them."""
    cores = len(usable_cores()) if cores is None else cores
    value = env.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return cores
    try:
        n = int(value)
    except ValueError:
        raise CpuSlotsError(f"OMP_NUM_THREADS={value!r} is not a whole number of threads") from None
    if n < 1:  # OpenMP leaves it undefined; one thread or all of them would each surprise someone
        raise CpuSlotsError(f"OMP_NUM_THREADS={value!r} is not a number of threads (at least 1); "
                            f"unset it to use all {cores} usable cores")
    return min(n, cores)


def claim(nproc: int = 1, *, env=os.environ, timeout: float | None = None, poll_s: float = 2.0,
          set_torch: bool = True) -> list[int]:
    """Takes the job's cores for the life of this process and runs torch on them.

    :param nproc: processes that will share the cores (torchrun workers); each gets
        share // nproc threads (at least 1, so at least nproc cores are claimed).
    :param env: the environment to read and to update: OMP_NUM_THREADS becomes the per-process
        thread count, which launched workers (and torch, when imported later) read.
    :param timeout: seconds to wait for free cores; None: DDPMREPRO_CPU_WAIT, else forever.
    :return: the cores taken ([] and nothing changed when DDPMREPRO_CPU_SLOTS=0).
    """
    if env.get("DDPMREPRO_CPU_SLOTS", "1").strip() == "0":
        return []
    cores = _CLAIMED or usable_cores()
    n = min(len(cores), max(share(env, len(cores)), nproc))
    threads = max(1, n // nproc)
    if _CLAIMED:  # flock locks of one process conflict with each other: never take ours twice
        taken = list(_CLAIMED)
    else:
        if timeout is None:
            timeout = slots.wait_setting(env, "DDPMREPRO_CPU_WAIT", CpuSlotsError)
        directory = slots.make_lock_dir(lock_dir(env), "CPU", CpuSlotsError, _HINT)
        names = slots.take([str(c) for c in cores], n, directory, prefix="cpu", what="CPU core",
                           timeout=timeout, poll_s=poll_s, error=CpuSlotsError, hint=_HINT)
        taken = [int(c) for c in names]
        os.sched_setaffinity(0, taken)  # children (torchrun and its workers) inherit it
        _CLAIMED.extend(taken)
        log.debug("using CPU core(s) %s, %d thread(s) per process", ",".join(names), threads)
    env["OMP_NUM_THREADS"] = str(threads)
    if set_torch:
        import torch

        torch.set_num_threads(threads)
    return taken
