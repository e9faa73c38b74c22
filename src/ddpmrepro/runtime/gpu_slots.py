"""Disjoint GPUs for jobs that run at the same time on one machine.

Snakemake's `gpu` resource and `dvc queue start -j N` only count GPUs: neither tells a job which
ones to use, so two 2-GPU jobs would both run on GPUs 0 and 1. Before it starts any worker,
`ddpmrepro train` / `sample` takes one lock per GPU it needs and narrows CUDA_VISIBLE_DEVICES to
those GPUs; torchrun and its workers inherit that.

- All or nothing, and the locks are flock(2) locks held for the life of the launching process
  (so a killed job frees its GPUs, and there is nothing to clean up): see slots.py, which
  cpu_slots.py shares.
- An existing CUDA_VISIBLE_DEVICES (set by you, or by SLURM) is the pool: devices are taken from
  that list and keep their names there (`2,3`, or GPU UUIDs).
- Lock files live in `$DDPMREPRO_GPU_LOCK_DIR`, else `$TMPDIR/ddpmrepro-gpus-$UID` (no TMPDIR:
  /tmp), so jobs of one user on one machine see each other. Inside a SLURM job they go to a
  `slurm-<job id>` subfolder: SLURM already keeps jobs apart (each job's GPUs may all be numbered
  from 0, so a machine-wide lock would make unrelated jobs wait), and the locks still keep apart
  the jobs that share one allocation (several Snakemake jobs inside one `salloc`).

`DDPMREPRO_GPU_SLOTS=0` turns the allocator off; `DDPMREPRO_GPU_WAIT=SECONDS` gives up waiting
after that long (default: wait as long as it takes).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from . import slots
from .slots import _HELD, held_fds  # noqa: F401  (the one list of held locks, GPUs and cores)

log = logging.getLogger(__name__)

_HINT = "; set DDPMREPRO_GPU_LOCK_DIR to a directory of your own"


class GpuSlotsError(slots.SlotsError):
    """More GPUs asked for than there are, or no free set within the timeout (one line)."""


def lock_dir(env=os.environ) -> Path:
    return slots.lock_dir("gpus", env)


def pool(device_count: int, env=os.environ) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries, else 0 .. device_count-1."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in visible.split(",") if d.strip()][:device_count]


def acquire(n: int, *, device_count: int, env=os.environ, timeout: float | None = None,
            poll_s: float = 2.0, log_every_s: float = 60.0) -> list[str]:
    """Takes n GPUs of the pool for the life of this process and sets env's CUDA_VISIBLE_DEVICES.

    :param n: GPUs wanted.
    :param device_count: GPUs this process sees (torch.cuda.device_count(); tests pass any number).
    :param env: the environment to read and to update (os.environ for the CLI).
    :param timeout: seconds to wait for a free set before GpuSlotsError; None waits forever.
    :return: the devices taken, as named in the pool.
    """
    devices = pool(device_count, env)
    if n > len(devices):
        raise GpuSlotsError(f"{n} GPUs asked for but this machine has {len(devices)}"
                            + (f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in env else "")
                            + "; lower the number of processes")
    directory = slots.make_lock_dir(lock_dir(env), "GPU", GpuSlotsError, _HINT)
    taken = slots.take(devices, n, directory, prefix="gpu", what="GPU", timeout=timeout, poll_s=poll_s,
                       log_every_s=log_every_s, error=GpuSlotsError, hint=_HINT)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(taken)
    log.info("using GPU(s) %s (CUDA_VISIBLE_DEVICES)", ",".join(taken))
    return taken


def claim(n: int, *, device_count: int, env=os.environ) -> list[str] | None:
    """The CLI's entry: acquire() unless DDPMREPRO_GPU_SLOTS=0 (then None, nothing changed),
    waiting at most DDPMREPRO_GPU_WAIT seconds when that is set."""
    if env.get("DDPMREPRO_GPU_SLOTS", "1").strip() == "0":
        return None
    timeout = slots.wait_setting(env, "DDPMREPRO_GPU_WAIT", GpuSlotsError)
    return acquire(n, device_count=device_count, env=env, timeout=timeout)
