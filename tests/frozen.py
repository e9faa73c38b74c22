"""Stopping a training at a step of the test's choosing, however fast or loaded the machine.

The SLURM tests stop tiny trainings that last a few seconds. Waiting for a logged step and only
then freezing the training left a race: on one CI run a resumed 100-step training (5 s on this
machine) ended between the test's polls, and the test found the job finished. So these tests
freeze the training's processes as soon as they exist (their imports alone take longer than a
poll) and let them run only in short slices, looking at the log between two slices: a training
can then get at most one slice past the point the test waits for, at any speed.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path


def exited(pid: int) -> bool:
    try:
        return re.search(r"^State:\s*Z", Path(f"/proc/{pid}/status").read_text(), re.M) is not None
    except FileNotFoundError:
        return True


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def frozen(pids: list[int]):
    """The processes stopped (SIGSTOP) inside the block and running again after it."""
    _signal_all(pids, signal.SIGSTOP)
    try:
        yield pids
    finally:
        _signal_all(pids, signal.SIGCONT)


def run_in_slices(pids: list[int], until, what: str, slice_s: float = 0.1, timeout: float = 600):
    """Lets the frozen processes run slice_s seconds at a time until until() returns something
    true, and returns that with the processes frozen again. Fails, saying so, if one of them ends
    first or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        value = until()
        if value:
            return value
        if any(exited(pid) for pid in pids):
            raise AssertionError(f"the training ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (the training ran in "
                                 f"slices of {slice_s} s)")
        _signal_all(pids, signal.SIGCONT)
        time.sleep(slice_s)
        _signal_all(pids, signal.SIGSTOP)


def term_delivered(pid: int) -> bool:
    """SIGTERM is pending for the frozen process, or SLURM woke it (SIGCONT) with it and it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return any(int(m, 16) >> 14 & 1 for m in re.findall(r"^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)", status, re.M))
