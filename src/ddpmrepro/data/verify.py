"""Checking prepared files against their sha256 before anything uses them, cheaply on reruns.

Hashing is not free at scale. Measured with `benchmarks/data_scale.py` (one thread of this 2-core
machine, another job running beside it): sha256 reads ~0.36-0.5 GB/s per core here (OpenSSL with
SHA-NI; a quiet modern core does ~1.5-2 GB/s). A 16 GB prepared ImageNet-64 then costs ~30-45 s per
core on this machine and ~10 s on a GPU server's 8 cores if the disk keeps up (a 2 GB/s NVMe does;
a network file system at 500 MB/s makes it ~30 s whatever the cores). Paid by every rank at every
start, that is minutes of GPU time a day for nothing.

So a file whose content was verified gets a *stamp*: a small file in a per-node cache directory
(`$XDG_CACHE_HOME/ddpmrepro/verified/`, else `~/.cache/...`) recording the file's identity (real
path, size, mtime_ns, ctime_ns, inode, device) and the sha256 it was found to have. A later run
trusts the file without reading it iff its identity is unchanged and the stamp's sha256 is the one
the manifest expects now. What that trades:
  * Any write through the file system changes mtime and ctime; `touch -d`/`os.utime` can put mtime
    back but never ctime (the kernel sets it to "now" on every change, utime included). A file
    tampered with in place, or replaced (`dvc checkout` of other data, a copy, a reflink: new inode),
    is hashed again.
  * Not caught: a change within the same tick of the kernel's coarse clock (a few ms) as the previous
    one, with the size kept; and corruption below the file system (bit rot, a disk returning bad blocks) after the
    stamp was written. Hashing on every start would catch it; ZFS/btrfs checksums catch it anyway.
    Delete the cache directory (or the stamp) to force a full check.
  * Spurious re-hashing, harmless: DVC with `cache.type: hardlink` chmods a cache file while it
    unlinks another workspace's link to it, which changes ctime.
Concurrent verifiers (the ranks of a node, several jobs) take a per-file lock, so one hashes while
the others wait and then read its stamp. The stamp directory is optional: when it cannot be written,
every start hashes everything (with a warning) and nothing else changes.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..files import atomic_write_text, sha256

log = logging.getLogger(__name__)


def stamp_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddpmrepro" / "verified"


def identity(path: Path) -> dict:
    """What changes whenever the file's content can have changed (see the module docstring)."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


class Verifier:
    """`verify(files)`: {path: expected sha256} -> the paths whose content differs (empty: all good)."""

    def __init__(self, stamps: Path | None = None, threads: int | None = None):
        self.stamps = stamp_dir() if stamps is None else stamps
        self.threads = threads or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                      else os.cpu_count() or 1)
        self.hashed_bytes = 0  # bytes read by this verifier (0 on a rerun with valid stamps)
        try:
            self.stamps.mkdir(parents=True, exist_ok=True)
            self._writable = os.access(self.stamps, os.W_OK)
        except OSError:
            self._writable = False
        if not self._writable:
            log.warning("%s: cannot be written; every start will hash the prepared data in full", self.stamps)

    def verify(self, files: dict[Path, str]) -> list[Path]:
        if not files:
            return []
        with ThreadPoolExecutor(min(self.threads, len(files))) as pool:
            results = list(pool.map(lambda item: self._check(*item), files.items()))
        self.hashed_bytes += sum(n for _, n in results)
        return [path for path, (good, _) in zip(files, results) if not good]

    def _stamp_path(self, ident: dict) -> Path:
        key = hashlib.sha256(f"{ident['dev']}:{ident['ino']}:{ident['path']}".encode()).hexdigest()[:32]
        return self.stamps / f"{key}.json"

    def _check(self, path: Path, expected: str) -> tuple[bool, int]:
        """(content is as expected, bytes hashed)."""
        before = identity(path)
        if not self._writable:
            return sha256(path) == expected, before["size"]
        stamp = self._stamp_path(before)
        with _locked(stamp.with_suffix(".lock")):
            if _read_json(stamp) == {**before, "sha256": expected}:
                return True, 0
            digest = sha256(path)
            if digest == expected and identity(path) == before:  # unchanged while we read it
                _write_atomic(stamp, {**before, "sha256": digest})
            return digest == expected, before["size"]


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_atomic(path: Path, obj: dict) -> None:
    try:
        atomic_write_text(path, json.dumps(obj))
    except OSError as e:  # a full or read-only cache costs a rehash next time, nothing more
        log.warning("%s: cannot write the verification stamp (%s)", path, e)
