"""`python -m ddpmrepro.runtime.torchrun ARGS`: torchrun (torch.distributed.run, same arguments) as
`ddpmrepro train` and `ddpmrepro sample` run it. It differs in what happens when something fails
or dies:

- **Workers die with it.** torchrun starts each worker in a session of its own, so a kill of the
  launcher's process group never reaches them and they would train on, holding the run lock and
  their GPUs. Each worker asks the kernel for SIGKILL when this process dies (`die_with_agent`,
  PR_SET_PDEATHSIG), checked against the pid exported here in case it died first.
- **One line per failure.** A worker's user error (bad params, data, checkpoint) is not printed
  by the worker but written to a file (`report_error`); this process prints the first one (the
  root cause: the other ranks fail after it, e.g. with "connection closed by peer") once, as the
  single-process run would, and exits with the worker's exit code. Its own log (warnings, the
  ChildFailedError report) goes to a file that is named when a worker crashed and removed when
  all went well; the workers' output still goes to the terminal.
- **Ctrl-C twice leaves at once**, as with one process: this process exits and the kernel kills
  the workers (their checkpoints are atomic); torchrun alone would wait for them again. After a
  stop signal it exits with 130, without torchrun's SignalException traceback.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from ..files import atomic_write_text

AGENT_PID = "DDPMREPRO_TORCHRUN_PID"  # exported to the workers: the parent they must die with
ERROR_DIR = "DDPMREPRO_ERROR_DIR"  # where workers report their one-line user errors, and crashes
_PR_SET_PDEATHSIG = 1
# Loaded at import, in the parent: a forked child about to exec only calls it.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def parent_death_signal(sig: int, parent: int | None) -> bool:
    """Asks the kernel to send `sig` to this process when its parent dies. False when the parent
    is already gone (the signal will never come): it is not `parent`, or (parent unknown) it is init.

    Call it in the child, from the thread that will outlive the start: the signal follows the
    death of the parent *thread* that forked us (torchrun and the launcher fork from their main thread).
    """
    if _LIBC is None:
        return True  # no prctl outside Linux: there, workers can outlive a process-group kill
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between our fork and the prctl: then nothing will ever signal us.
    ppid = os.getppid()
    return ppid == parent if parent is not None else ppid != 1


def die_with_agent() -> None:
    """In a worker started by torchrun: SIGKILL this process when the agent that started it dies,
    however it dies (a SIGKILL of the launcher's process group included)."""
    if AGENT_PID not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not started by a torchrun agent (e.g. srun with the rendezvous set by hand)
    agent = int(os.environ[AGENT_PID]) if os.environ.get(AGENT_PID) else None  # plain torchrun: not known
    if not parent_death_signal(signal.SIGKILL, agent):
        os.kill(os.getpid(), signal.SIGKILL)  # the agent died before we could ask: go as the others went


# --- worker errors ---------------------------------------------------------------------------------


def report_error(message: str | None, exit_code: int) -> bool:
    """In a worker: hands a one-line user error to the agent instead of printing it (every rank
    usually fails the same way), or, with message None, notes when this rank crashed (it prints its
    traceback itself). False when there is no agent to hand it to, or the file cannot be written."""
    directory = os.environ.get(ERROR_DIR)
    if not directory:
        return False
    rank = os.environ.get("RANK", "0")
    record = {"time": time.time(), "rank": int(rank), "exit_code": exit_code, "message": message,
              "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    try:
        atomic_write_text(Path(directory) / f"rank{rank}.json", json.dumps(record))  # never read half-written
    except OSError:
        return False
    return True


def reported_errors(directory: Path) -> list[dict]:
    """What the workers of the last attempt (torchrun restarts the group after a failure, up to
    --max-restarts times) reported, earliest first: the first is the root cause, the others followed
    from it (a peer's "connection closed by peer", say)."""
    records = []
    for f in Path(directory).glob("rank*.json"):
        try:
            records.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    last = max((r["attempt"] for r in records), default=0)
    return sorted((r for r in records if r["attempt"] == last), key=lambda r: (r["time"], r["rank"]))


# --- the agent -------------------------------------------------------------------------------------


def _second_ctrl_c_exits_at_once(work: Path) -> None:
    """torchrun meets a stop signal by signalling its workers (they save a checkpoint and exit) and
    waiting for them, and a second one by doing that again. A second SIGINT (Ctrl-C twice) should
    leave at once, as one process does: this process exits and the kernel kills the workers."""
    from torch.distributed.elastic.multiprocessing import api

    torch_handler, interrupted = api._terminate_process_handler, []

    def handler(signum, frame):
        if signum == signal.SIGINT and interrupted:
            _clean(work, keep_log=False)
            os._exit(130)  # the workers die with us (die_with_agent); their checkpoints are atomic
        interrupted.extend([signum] if signum == signal.SIGINT else [])
        torch_handler(signum, frame)  # raises SignalException: torchrun stops its workers with signum
    # torchrun installs its handler when it starts the workers (every restart): make that one ours.
    api._terminate_process_handler = handler
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


# pids of the workers torchrun itself signalled to stop, because a peer had failed (or to restart
# the group): their deaths by SIGTERM follow from the failure and are not its cause.
_STOPPED_BY_TORCHRUN: set[int] = set()


def _note_the_workers_torchrun_stops() -> None:
    """torchrun records the exit of every worker it stops after a failure, SIGTERM included. A worker
    stuck in a collective, or one already out of its training loop (its SIGTERM handler gone), dies
    of that SIGTERM, and a failure report cannot tell it from a rank killed from outside."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.SubprocessContext._close  # torchrun starts `python -m ...` workers as subprocesses

    def close_noting_the_running(self, death_sig, timeout: int = 30):
        # poll(): None while the worker runs (one that exited by itself is reaped and not noted)
        _STOPPED_BY_TORCHRUN.update(h.proc.pid for h in self.subprocess_handlers.values() if h.proc.poll() is None)
        return close(self, death_sig=death_sig, timeout=timeout)
    api.SubprocessContext._close = close_noting_the_running


def _exit_code(exitcode: int) -> int:
    """A worker's exit code as a shell reports it (killed by signal N: 128 + N)."""
    return exitcode if exitcode > 0 else 128 - exitcode if exitcode < 0 else 1


def main(argv: list[str]) -> int:
    terminal = sys.stderr
    _remove_work_dirs_of_killed_agents()
    work = Path(tempfile.mkdtemp(prefix=f"ddpmrepro-torchrun-{os.getpid()}@{_host()}-"))
    log_path = work / "torchrun.log"
    # torchrun's own output goes to the log; the workers inherit file descriptor 2, the terminal.
    sys.stderr = open(log_path, "a", buffering=1)  # noqa: SIM115 (open for the life of the process)
    print("torchrun " + " ".join(argv), file=sys.stderr)
    os.environ[AGENT_PID] = str(os.getpid())
    os.environ[ERROR_DIR] = str(work / "errors")
    (work / "errors").mkdir()

    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _second_ctrl_c_exits_at_once(work)
    _note_the_workers_torchrun_stops()
    if not any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        # torchrun's per-run directory (its error files) in ours, not a /tmp/torchelastic_* left behind each time
        argv = ["--log-dir", str(work / "elastic"), *argv]
    keep_log, code = False, 0
    try:
        run.main(argv)
    except SignalException:
        code = 130  # the workers saved a checkpoint and said so
    except ChildFailedError as e:
        code, keep_log = _report(e, work, log_path, terminal)
    except BaseException:
        import traceback

        traceback.print_exc()  # into the log
        where = f" on {socket.gethostname()}" if os.environ.get("SLURM_JOB_ID") else ""
        print(f"Error: torchrun failed before its workers ended; its log is {log_path}{where}", file=terminal)
        keep_log, code = True, 1
    finally:
        sys.stderr.flush()
        _clean(work, keep_log)
    return code


def _report(e, work: Path, log_path: Path, terminal) -> tuple[int, bool]:
    """Prints one line for a failed worker group; returns (exit code, keep the log).

    The root cause is a rank killed by a signal (it could report nothing; its peers' errors followed
    from its death), else the earliest report: a user error (its line, its exit code, as one
    process would print it) or a crash (the rank printed its traceback; we say which rank it was).
    """
    print(e.format_msg(), file=sys.stderr)  # torchrun's report: every failed rank, into the log
    reports = reported_errors(work / "errors")
    reported = {r["rank"] for r in reports}
    # The ranks that failed on their own; those torchrun stopped after them are consequences.
    failures = {rank: f for rank, f in e.failures.items() if f.pid not in _STOPPED_BY_TORCHRUN} or e.failures
    killed = [rank for rank, f in sorted(failures.items()) if f.exitcode < 0 and rank not in reported]
    if not killed and reports and reports[0]["message"] is not None:
        print(f"Error: {reports[0]['message']}", file=terminal, flush=True)
        return reports[0]["exit_code"], False
    first = min(failures, key=lambda rank: (failures[rank].timestamp, rank))
    rank = killed[0] if killed else reports[0]["rank"] if reports else first
    failure = e.failures.get(rank)
    code = failure.exitcode if failure is not None else reports[0]["exit_code"]
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    pid = f" (pid {failure.pid})" if failure is not None else ""
    where = f" on {socket.gethostname()}" if os.environ.get("SLURM_JOB_ID") else ""
    print(f"Error: rank {rank}{pid} {how}; its output is above, torchrun's log is {log_path}{where}",
          file=terminal, flush=True)
    return _exit_code(code), True


def _clean(work: Path, keep_log: bool) -> None:
    """The work directory goes, or, where the user is pointed to its log, all of it but the log
    (torchrun's own run directory too: a failed launch left `elastic/` beside the log)."""
    import shutil

    for d in ([work / "errors", work / "elastic"] if keep_log else [work]):
        shutil.rmtree(d, ignore_errors=True)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())


def _remove_work_dirs_of_killed_agents() -> None:
    """An agent that was SIGKILLed could not clean up: its directory still has `errors/` (one that
    ended and kept its log for the user has not) and its pid, in the name, is gone. Only this
    host's: a TMPDIR may be shared between nodes, and a pid says nothing about another node."""
    import shutil

    for d in Path(tempfile.gettempdir()).glob(f"ddpmrepro-torchrun-*@{_host()}-*"):
        m = re.fullmatch(r"ddpmrepro-torchrun-(\d+)@(.+)-[^-]+", d.name)  # mkdtemp's suffix has no '-'
        if not m or m.group(2) != _host():
            continue
        try:
            if (d / "errors").is_dir() and d.stat().st_uid == os.getuid():
                os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
