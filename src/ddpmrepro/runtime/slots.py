"""Machine-wide slots held with flock(2): the mechanism under gpu_slots (GPUs) and cpu_slots (cores).

A slot is a lock file `<directory>/<prefix><name>.lock`. A job takes the n slots it needs in one
non-blocking pass, or gives back what it got and waits: it never sits on part of a set, so two
jobs can never each hold half of what the other needs (no deadlock). The locks belong to open
file descriptors kept for the life of the process: the kernel drops them when the process ends,
however it ends (SIGKILL, OOM killer), so a slot never leaks and there is nothing to clean up.
A launched child that should keep the slots inherits the descriptors (`held_fds`).
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)

_HELD: list[int] = []  # open lock-file descriptors: the locks live as long as they stay open


def held_fds() -> tuple[int, ...]:
    """The lock-file descriptors this process holds, GPUs and cores (a launched child inherits them)."""
    return tuple(_HELD)


class SlotsError(RuntimeError):
    """No free set within the timeout, or the lock directory is unusable (one line)."""


def lock_dir(kind: str, env=os.environ) -> Path:
    """Where the `kind` ("gpus", "cpus") locks of this machine live: $DDPMREPRO_<KIND>_LOCK_DIR, else
    one directory per user under TMPDIR. Inside a SLURM job, a subdirectory of the job's own: SLURM
    already gave the job its devices and cores, and jobs sharing a node must not queue on each other."""
    override = env.get(f"DDPMREPRO_{kind[:-1].upper()}_LOCK_DIR")
    if override:
        base = Path(override)
    else:
        import tempfile

        tmp = env.get("TMPDIR")
        # A misspelt TMPDIR made on the spot would hold locks that no job with the right one sees:
        # jobs would share cores or GPUs without a word (tempfile itself falls back to /tmp). In a
        # SLURM job the locks are the job's alone, and a TMPDIR exported from the login node may be
        # missing on a compute node: made there, as before.
        if tmp and not env.get("SLURM_JOB_ID") and not Path(tmp).is_dir():
            raise SlotsError(f"TMPDIR={tmp} is not a directory (the {kind[:-1].upper()} locks live under it); "
                             "create it, or unset TMPDIR")
        base = Path(tmp or tempfile.gettempdir()) / f"ddpmrepro-{kind}-{os.getuid()}"
    return base / f"slurm-{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else base


def lock_path(directory: Path, prefix: str, name: str) -> Path:
    return Path(directory) / f"{prefix}{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.lock"


def make_lock_dir(directory: Path, what: str, error=SlotsError, hint: str = "") -> Path:
    try:
        Path(directory).mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise error(f"cannot create the {what} lock directory {directory}: {e.strerror}{hint}") from None
    return Path(directory)


def _try_take(names: list[str], n: int, directory: Path, prefix: str, error, hint: str
              ) -> tuple[list[tuple[str, int]], list[str]]:
    """One non-blocking pass: (n names with their locked descriptors, []), or ([], the busy
    names) after giving back whatever was taken."""
    got, busy = [], []
    for name in names:
        path = lock_path(directory, prefix, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            for _, held in got:
                os.close(held)
            raise error(f"cannot open {path}: {e.strerror}{hint}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            busy.append(name)
            continue
        got.append((name, fd))
        if len(got) == n:
            return got, []
    for _, fd in got:
        os.close(fd)  # closing the file drops its lock
    return [], busy


def _holders(busy: list[str], directory: Path, prefix: str) -> str:
    """'0 (pid 12), 1 (pid 12)': the pid each holder wrote into its lock file (information only)."""
    out = []
    for name in busy:
        try:
            pid = lock_path(directory, prefix, name).read_text().strip()
        except OSError:
            pid = ""
        out.append(f"{name} (pid {pid})" if pid else name)
    return ", ".join(out)


def take(names: list[str], n: int, directory: Path, *, prefix: str, what: str, timeout: float | None = None,
         poll_s: float = 2.0, log_every_s: float = 60.0, error=SlotsError, hint: str = "") -> list[str]:
    """Takes n of the slots `names` for the life of this process (all or nothing, waiting).

    :param what: the noun in messages ("GPU", "CPU core").
    :param timeout: seconds to wait for a free set before `error`; None waits forever.
    :return: the names taken.
    """
    start, last_log = time.monotonic(), None
    while True:
        got, busy = _try_take(names, n, directory, prefix, error, hint)
        if got:
            break
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise error(f"no {n} free {what}(s) among {','.join(names)} after {waited:.0f} s "
                        f"(busy: {_holders(busy, directory, prefix)}; locks in {directory})")
        if last_log is None or time.monotonic() - last_log >= log_every_s:
            log.warning("waiting for %d free %s(s) among %s; busy: %s (waited %.0f s)",
                        n, what, ",".join(names), _holders(busy, directory, prefix), waited)
            last_log = time.monotonic()
        time.sleep(poll_s)
    for _, fd in got:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _HELD.append(fd)
    return [name for name, _ in got]


def wait_setting(env, name: str, error=SlotsError) -> float | None:
    """The timeout in seconds from environment variable `name` (unset or empty: None, wait forever)."""
    wait = env.get(name, "").strip()
    try:
        return float(wait) if wait else None
    except ValueError:
        raise error(f"{name}={wait!r} is not a number of seconds") from None
