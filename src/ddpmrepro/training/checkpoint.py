"""Checkpoints: the resumable training state (torch.save, loaded weights_only), what it holds
(`CheckpointIO`, the one list of it), and the run lock.

A checkpoint file is untrusted input: it is loaded with `weights_only=True` only, after its
sha256 sidecar has been checked, so a truncated, tampered or pickle-bearing file is refused
with a clear message instead of being executed or half-read.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import re
from pathlib import Path

import torch

from ..files import TEMP_FILE, CheckpointError, atomic_write_bytes, atomic_write_text, sha256
from ..files import project_root_for  # noqa: F401  (the run's checkpoint root: files.py's, so check-params shares it)

STEP_FILE = re.compile(r"^step_(\d{9})\.pt$")
log = logging.getLogger(__name__)


def save_checkpoint(state: dict, directory: Path, step: int, keep: int) -> Path:
    """Writes step_<N>.pt atomically, then its sha256 sidecar, then prunes to the last `keep`.

    The sidecar is written after the data file: a kill in between leaves a file without a
    sidecar, which `latest_checkpoint` ignores, so the previous checkpoint is used.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:09d}.pt"
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    atomic_write_text(path.with_suffix(".sha256"), sha256(path) + "\n")
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
        old.with_suffix(".sha256").unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (data file + sidecar), oldest first."""
    if not directory.is_dir():
        return []
    files = [p for p in directory.iterdir() if STEP_FILE.match(p.name) and p.with_suffix(".sha256").exists()]
    return sorted(files)


def load_checkpoint(path: Path) -> dict:
    """Verifies the sha256 sidecar, then loads with weights_only=True (no code execution)."""
    sidecar = path.with_suffix(".sha256")
    if not sidecar.exists():
        raise CheckpointError(f"{path}: no sha256 sidecar; the write was interrupted. Delete it to resume from an earlier one")
    expected = sidecar.read_text().strip()
    if sha256(path) != expected:
        raise CheckpointError(f"{path}: sha256 mismatch (truncated or modified); delete it to resume from an earlier checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only met something it would have to run code to rebuild
        raise CheckpointError(f"{path}: refused to load: it holds Python objects other than tensors and plain "
                              "values, which only code could rebuild (a pickle payload, or a file ddpmrepro did not "
                              "write); nothing in it was run. Delete it to resume from an earlier checkpoint") from None
    except Exception:  # a damaged or foreign archive (its sidecar matched, so it was written so)
        raise CheckpointError(f"{path}: refused to load: not a torch checkpoint archive that can be read; "
                              "delete it to resume from an earlier checkpoint") from None


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint file, from its name (step_<N>.pt), without loading it."""
    return int(STEP_FILE.match(Path(path).name).group(1))


def latest_checkpoint(directory: Path) -> Path | None:
    ckpts = list_checkpoints(directory)
    return ckpts[-1] if ckpts else None


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Removes the temp files (`.<name>.tmp.<pid>`) that writers killed mid-write left in `directory`
    and its subdirectories (the post-hoc EMA's snapshots are written into `phema/`):
    those whose writer is gone, or whose pid now belongs to a process that does not have the file
    open. A live writer's file is never touched. Returns what was removed."""
    removed = []
    for f in sorted(directory.rglob("*")) if directory.is_dir() else []:
        m = TEMP_FILE.match(f.name)
        if m and f.is_file() and not _written_by(f, int(m[1])):
            f.unlink(missing_ok=True)
            removed.append(f)
    if removed:
        log.info("removed %d temp file(s) of interrupted writes in %s", len(removed), directory)
    return removed


def _written_by(path: Path, pid: int) -> bool:
    """Whether process `pid` is alive and has `path` open (when in doubt: True, keep the file)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    try:
        target = os.stat(path)
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir():
            try:
                st = os.stat(fd)  # follows the link to the open file
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                return True
        return False  # the pid was reused by a process that is not writing it
    except OSError:
        return True  # no /proc, or not ours to look at


# --- what a training checkpoint holds ---------------------------------------------------------


class CheckpointIO:
    """Everything a training checkpoint holds, named once: `CheckpointIO(model=..., optimizer=..., ema=...)`.

    Each object has `state_dict()` and `load_state_dict(state)`; a checkpoint is their states
    under those names, plus the step and what identifies the run (`run_hash`) and the code
    (`code_version`): a checkpoint resumes only into the same run under the same code.
    """

    def __init__(self, **objects):
        self.objects = objects
        self.saved_params: dict = {}

    def state_dict(self, step: int, *, run_hash: str, code_version: str, **extra) -> dict:
        """Every object's state (call it on every rank: a state may be a collective, like the
        statistics gathered from every rank); `extra` is recorded, and after a load only its
        `params` is read back (`saved_params`), for notes, never to restore a state."""
        return {"step": step, **{name: obj.state_dict() for name, obj in self.objects.items()},
                "run_hash": run_hash, "code_version": code_version, **extra}

    def load(self, path: Path, *, run_hash: str, code_version: str) -> int:
        """Loads every object's state from the checkpoint at `path` after checking that it is one of
        this run under this code; returns its step."""
        state = load_checkpoint(path)
        if not isinstance(state, dict) or not {"step", "run_hash", "code_version", *self.objects} <= state.keys():
            raise CheckpointError(f"{path}: not a training checkpoint of ddpmrepro; delete it to resume "
                                  "from an earlier checkpoint")
        if state["code_version"] != code_version:
            raise CheckpointError(f"{path}: written by code version {state['code_version']}, this is {code_version}; "
                                  "rerun with `ddpmrepro train --restart` to start over, or restore that code")
        if state["run_hash"] != run_hash:
            raise CheckpointError(f"{path}: belongs to run {state['run_hash']}, not {run_hash}; remove it")
        step, named = state["step"], checkpoint_step(path) if STEP_FILE.match(Path(path).name) else None
        if type(step) is not int or step < 0 or named is not None and step != named:
            # A checkpoint of step 10 saying 100 would resume as if nearly done and be exported as the
            # finished model; its name is what picked it as the latest.
            raise CheckpointError(f"{path}: holds step {step!r}, but its name says {named}; delete it to resume "
                                  "from an earlier checkpoint")
        for name, obj in self.objects.items():
            try:
                obj.load_state_dict(state[name])
            except (ValueError, RuntimeError, KeyError, TypeError, IndexError) as e:
                raise CheckpointError(f"{path}: its {name} state does not fit this run ({str(e).splitlines()[0][:200]}); "
                                      "delete it to resume from an earlier checkpoint") from None
        self.saved_params = state.get("params") if isinstance(state.get("params"), dict) else {}
        return step


# --- a run directory is written by one process at a time -------------------------------------


class RunLock:
    """An exclusive flock on <dir>/.lock, released when the process dies. Entered, it refuses a
    directory another process holds; `try_lock` says whether it got it (the training waits)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / ".lock"
        self._fd = None

    def try_lock(self) -> bool:
        """Takes the lock if no other process holds it; False if one does."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            return False
        except OSError as e:  # no flock on this filesystem (Lustre mounted without -o flock, some NFS setups)
            os.close(self._fd)
            self._fd = None
            raise CheckpointError(f"{self.path}: cannot lock it ({e.strerror}): its filesystem has no flock; use "
                                  "--checkpoints on one that has (Lustre: mount with -o flock; see docs/CLUSTER.md)") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, json.dumps({"pid": os.getpid()}).encode())
        return True

    def holder(self) -> str:
        """The pid the holder wrote ("?" if unreadable): for a message, not a decision."""
        try:
            return str(int(json.loads(self.path.read_text())["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            return "?"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        if not self.try_lock():
            raise CheckpointError(f"{self.path.parent}: another process is training into this run directory; wait for it or stop it")
        return self

    def __exit__(self, *exc):
        self.release()
