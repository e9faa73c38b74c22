"""Disjoint GPUs for jobs that run at the same time on one machine.

Snakemake's `gpu` resource and `dvc queue start -j N` only count GPUs: neither tells a job which
ones to use, so two 2-GPU jobs would both run on GPUs 0 and 1. Before it starts any worker,
`ddpmrepro train` / `sample` takes one lock per GPU it needs and narrows CUDA_VISIBLE_DEVICES to
those GPUs; torchrun and its workers inherit that.

- All or nothing: a job takes every lock it needs in one non-blocking pass, or gives back what it
  got and waits. It never sits on part of a set, so two jobs can never each hold half of what the
  other needs (no deadlock).
- The locks are flock(2) locks on files held open for the life of the launching process. The
  kernel drops them when that process ends, however it ends (SIGKILL, OOM killer), so a slot can
  never leak and there is nothing to clean up; leftover lock files are harmless.
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

import fcntl
import logging
import os
import re
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

_HELD: list[int] = []  # open lock-file descriptors: the locks live as long as they stay open


def held_fds() -> tuple[int, ...]:
    """The lock-file descriptors this process holds (a launched child inherits them)."""
    return tuple(_HELD)


class GpuSlotsError(RuntimeError):
    """More GPUs asked for than there are, or no free set within the timeout (one line)."""


def lock_dir(env=os.environ) -> Path:
    if env.get("DDPMREPRO_GPU_LOCK_DIR"):
        base = Path(env["DDPMREPRO_GPU_LOCK_DIR"])
    else:
        base = Path(env.get("TMPDIR") or tempfile.gettempdir()) / f"ddpmrepro-gpus-{os.getuid()}"
    return base / f"slurm-{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else base


def pool(device_count: int, env=os.environ) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries, else 0 .. device_count-1."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in visible.split(",") if d.strip()][:device_count]


def _lock_path(directory: Path, device: str) -> Path:
    return directory / f"gpu{re.sub(r'[^A-Za-z0-9_.-]', '_', device)}.lock"


def _try_take(devices: list[str], n: int, directory: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """One non-blocking pass: (n devices with their locked descriptors, []), or ([], the busy
    devices) after giving back whatever was taken."""
    got, busy = [], []
    for dev in devices:
        try:
            fd = os.open(_lock_path(directory, dev), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            for _, held in got:
                os.close(held)
            raise GpuSlotsError(f"cannot open {_lock_path(directory, dev)}: {e.strerror}; "
                                "set DDPMREPRO_GPU_LOCK_DIR to a directory of your own") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            busy.append(dev)
            continue
        got.append((dev, fd))
        if len(got) == n:
            return got, []
    for _, fd in got:
        os.close(fd)  # closing the file drops its lock
    return [], busy


def _holders(busy: list[str], directory: Path) -> str:
    """'0 (pid 12), 1 (pid 12)': the pid each holder wrote into its lock file (information only)."""
    out = []
    for dev in busy:
        try:
            pid = _lock_path(directory, dev).read_text().strip()
        except OSError:
            pid = ""
        out.append(f"{dev} (pid {pid})" if pid else dev)
    return ", ".join(out)


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
    directory = lock_dir(env)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise GpuSlotsError(f"cannot create the GPU lock directory {directory}: {e.strerror}; "
                            "set DDPMREPRO_GPU_LOCK_DIR to a directory of your own") from None
    start, last_log = time.monotonic(), None
    while True:
        got, busy = _try_take(devices, n, directory)
        if got:
            break
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise GpuSlotsError(f"no {n} free GPU(s) among {','.join(devices)} after {waited:.0f} s "
                                f"(busy: {_holders(busy, directory)}; locks in {directory})")
        if last_log is None or time.monotonic() - last_log >= log_every_s:
            log.warning("waiting for %d free GPU(s) among %s; busy: %s (waited %.0f s)",
                        n, ",".join(devices), _holders(busy, directory), waited)
            last_log = time.monotonic()
        time.sleep(poll_s)
    for dev, fd in got:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _HELD.append(fd)
    taken = [dev for dev, _ in got]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(taken)
    log.info("using GPU(s) %s (CUDA_VISIBLE_DEVICES)", ",".join(taken))
    return taken


def claim(n: int, *, device_count: int, env=os.environ) -> list[str] | None:
    """The CLI's entry: acquire() unless DDPMREPRO_GPU_SLOTS=0 (then None, nothing changed),
    waiting at most DDPMREPRO_GPU_WAIT seconds when that is set."""
    if env.get("DDPMREPRO_GPU_SLOTS", "1").strip() == "0":
        return None
    wait = env.get("DDPMREPRO_GPU_WAIT", "").strip()
    try:
        timeout = float(wait) if wait else None
    except ValueError:
        raise GpuSlotsError(f"DDPMREPRO_GPU_WAIT={wait!r} is not a number of seconds") from None
    return acquire(n, device_count=device_count, env=env, timeout=timeout)
