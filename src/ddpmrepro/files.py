"""Files that must never be seen half-written, and weight files read as untrusted input.

One way for each kind of write, so every output has the same guarantee:

- a file: `atomic_write` (temp sibling, fsync, rename, fsync of the directory): a kill leaves the old
  file or the new one, never a torn one, and a power loss after it returns loses neither;
- a directory: `replacing_dir` / `replace_dir` (written in a temp sibling, fsynced, swapped in
  whole): at every instant the path holds the complete old directory or the complete new one;
- a file's identity: `sha256`.

Exported weights are safetensors: loading one runs no code, whatever the file holds. torch and
safetensors are imported only by the functions that need them, so the stages that write no weights
(check-params, prepare) do not pay for importing torch.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .outputs import GITIGNORE, OutputKind, check_replaceable

if TYPE_CHECKING:
    import torch

TEMP_FILE = re.compile(r"^\..+\.tmp\.(\d+)$")  # atomic_write's `.<name>.tmp.<writer pid>`


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which file and what to do."""


# Where DVC runs a queued (`dvc exp run --queue`, `dvc queue start`) or `--temp` experiment: a
# temporary clone, <project>/.dvc/tmp/exps/<tmpdir>/ (queue) or .../exps/standalone/<tmpdir>/
# (--temp), which it deletes when the experiment ends.
DVC_TEMP_CLONES = (".dvc", "tmp", "exps")


def project_root_for(root: Path, cwd: Path | None = None) -> Path:
    """The checkpoint root to use for `root` (and check-params' way to tell it runs in such a
    clone: the path changes). A relative one inside a DVC experiment's temporary clone is the project's own (the same subfolder of it, for a stage with a wdir): DVC deletes the
    clone, failed or not, and the checkpoints a rerun would resume from went with it (a killed
    queued run started again from step 0). Run directories are keyed by params, data and code, and
    locked, so experiments share the root as runs in the workspace do."""
    if root.is_absolute():
        return root
    parts = (cwd or Path.cwd()).parts
    n = len(DVC_TEMP_CLONES)
    for i in range(len(parts) - n):
        if parts[i:i + n] != DVC_TEMP_CLONES:
            continue
        clones, below = Path(*parts[:i + n]), parts[i + n:]
        for depth in range(1, len(below) + 1):  # the clone: the first directory down that is a DVC project
            if (clones.joinpath(*below[:depth]) / ".dvc").is_dir():
                return Path(*parts[:i], *below[depth:]) / root
    return root


def sha256(path: Path, chunk: int = 4 << 20) -> str:
    """sha256 of a file, read in 4 MiB blocks into one buffer (hashlib releases the GIL on each
    block, so threads hashing several files overlap)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Makes the directory's entries (a rename, a new file) survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- one file --------------------------------------------------------------------------------------


@functools.cache
def file_mode() -> int:
    """The mode a file created with open() gets (0o666 less the umask). safetensors' writer creates
    its files 0600 whatever the umask: a model directory, an export or a DVC cache on a shared
    cluster was unreadable to the group. Linux shows the umask in /proc; elsewhere reading it means
    setting it, put back at once."""
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, write_to: Callable[[Path], None]) -> None:
    """Puts a file in place atomically: `write_to(tmp)` writes the temp sibling `.<name>.tmp.<pid>`
    (by path, for writers that open it themselves), which is then fsynced and renamed over `path`.

    The pid in the name lets `training.checkpoint.remove_stale_temp_files` tell a dead writer's
    leftover from a live one's; one process writes a given path from one thread at a time.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        try:
            write_to(tmp)
        except Exception as e:
            full = as_disk_full(e, path)
            if full is e:
                raise
            raise full from e
        with open(tmp, "rb+") as f:
            os.fchmod(f.fileno(), file_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, write) -> None:
    """`atomic_write` for writers of an open binary file: `write(f)`."""
    def write_to(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)
    atomic_write(path, write_to)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode()))


def atomic_write_texts(texts: dict[Path, str]) -> None:
    """Several files that belong together (metrics.json and its detail), all or none: every temp
    sibling is written and fsynced before the first is renamed into place, so a full disk or a
    read-only directory leaves each file as it was, never a new headline beside an old detail."""
    tmps = {Path(p): Path(p).with_name(f".{Path(p).name}.tmp.{os.getpid()}") for p in texts}
    try:
        for path, text in texts.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmps[path], "wb") as f:
                f.write(text.encode())
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in tmps.items():
            os.replace(tmp, path)
        for parent in {p.parent for p in tmps}:
            fsync_dir(parent)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


# --- one directory ---------------------------------------------------------------------------------
#
# Names beside an output `<name>`: `.<name>.tmp` is where the new one is written (garbage unless a
# writer is running); `.<name>.old` holds the complete old one during the fallback swap only, and
# is never deleted under that name, so `recover_dir` can trust it; `.<name>.trash` is an old one
# being deleted.

RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100
# What renameat2 answers where the kernel or the file system cannot exchange (NFS, some FUSE).
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def temp_dir(dst: Path) -> Path:
    return Path(dst).with_name(f".{Path(dst).name}.tmp")


def aside_dir(dst: Path) -> Path:
    return Path(dst).with_name(f".{Path(dst).name}.old")


def trash_dir(dst: Path) -> Path:
    return Path(dst).with_name(f".{Path(dst).name}.trash")


@contextlib.contextmanager
def replacing_dir(dst: Path, kind: OutputKind) -> Iterator[Path]:
    """Yields an empty temp sibling of `dst` to write the new directory into; when the block
    finishes, it replaces `dst` whole (`replace_dir`). An exception, in the block or in the swap,
    removes it and leaves `dst` as it was.

    `dst` must be missing, empty or already a `kind` output (`outputs.check_replaceable`): the old
    directory is deleted, so anything else is refused (OutputRefused) before the block runs.

    One writer per output at a time (DVC's and the run's locks see to that): a second one would
    start by deleting the first one's temp directory.
    """
    dst = Path(dst)
    check_replaceable(dst, kind)  # before any name is derived from it: `.` has none
    dst.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(dst)  # the old output back in place while the new one is written (it was checked then)
    tmp = temp_dir(dst)
    _remove(tmp)  # a killed writer's leftover
    tmp.mkdir()
    try:
        yield tmp
        kept = dst / GITIGNORE  # DVC's list of the outputs inside: git tracks it, DVC does not rewrite it
        if kept.is_file() and not (tmp / GITIGNORE).exists():
            shutil.copy2(kept, tmp / GITIGNORE)
        replace_dir(tmp, dst)
    except BaseException:
        # Never the only copy of the output: the new one not yet in place, or the old one swapped out.
        _remove(tmp)
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Puts the fully written directory `src` (a sibling of `dst`) at `dst`, and removes the old one.

    Guarantee, for a kill or a power loss at any instant: on Linux (renameat2 with RENAME_EXCHANGE:
    ext4, xfs, btrfs, tmpfs...) `dst` is the complete old directory or the complete new one, and a
    reader never finds it missing. Elsewhere (another OS, or a file system that cannot exchange) the
    old one is renamed aside to `.<name>.old` and the new one renamed in: between those two renames
    `dst` is missing while the complete old one is at `.<name>.old`; `recover_dir` (called first by
    every `replace_dir`, and by the readers of the model directory) renames it back.
    """
    src, dst = Path(src), Path(dst)
    recover_dir(dst)
    trash = trash_dir(dst)
    _remove(trash)  # what a kill left of an earlier delete
    _fsync_tree(src)
    fsync_dir(dst.parent)  # src's own entry, before anything depends on it
    if not os.path.lexists(dst):
        os.rename(src, dst)
        fsync_dir(dst.parent)
        return
    if _exchange(src, dst):
        os.rename(src, trash)  # src now holds the old directory
    else:
        aside = aside_dir(dst)
        os.rename(dst, aside)
        try:
            os.rename(src, dst)
        except BaseException:
            os.rename(aside, dst)  # the old one back (after a kill here, recover_dir does it)
            raise
        os.rename(aside, trash)
    fsync_dir(dst.parent)
    _remove(trash)


def recover_dir(dst: Path) -> None:
    """After a kill inside the fallback swap of `replace_dir`: puts the complete old directory back
    at `dst` if `dst` is missing, or drops the stale aside copy if the new one made it in.
    Does nothing in the usual case (no `.<name>.old`)."""
    dst, aside = Path(dst), aside_dir(dst)
    if not aside.is_dir():
        return
    if not os.path.lexists(dst):
        os.rename(aside, dst)
    else:
        trash = trash_dir(dst)
        _remove(trash)
        os.rename(aside, trash)
        _remove(trash)
    fsync_dir(dst.parent)


def copy_into(src: Path, tmp: Path, *, shown: Path) -> None:
    """Copies the tree `src` into the directory `tmp` (the temp sibling `replacing_dir` gave for
    `shown`); a full disk is the OSError(ENOSPC) naming `shown`."""
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    except shutil.Error as e:  # a list of (src, dst, why) per file, not an OSError
        full = as_disk_full(e, shown)
        if full is e:
            raise
        raise full from e


def as_disk_full(e: Exception, path: Path) -> Exception:
    """A write that failed because its file system is full, as the OSError(ENOSPC) naming `path` that
    the commands turn into one line; any other failure as it is. Writers that are not Python's own
    file objects report a full disk in their own words: safetensors' SafetensorError ("No space left
    on device (os error 28)"), torch.save's "unexpected pos ..." (a short write, no errno) and
    shutil's Error (one entry per file), so the file system is asked too."""
    if isinstance(e, OSError) and e.errno is not None:
        return e
    text = str(e)
    try:
        st = os.statvfs(Path(path).parent if not Path(path).is_dir() else path)
        full = st.f_bavail * st.f_frsize < (1 << 20)  # under 1 MiB left: the write did not fit
    except OSError:
        full = False
    if full or "No space left on device" in text or "os error 28" in text or "[Errno 28]" in text:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return e


def link_or_copy(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src` (one copy on disk), or a copy where a link cannot be made (another
    file system, or one without hard links). Safe only for files that are never written in place:
    every writer here replaces a file by renaming a new one over it (`atomic_write`), which leaves
    the other name holding the old bytes, and a reader that deletes one name keeps the other."""
    try:
        os.link(src, dst)
    except OSError:  # EXDEV, EPERM (no hard links there), EMLINK
        shutil.copyfile(src, dst)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two existing paths in one step; False where that cannot be done here (then nothing moved)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


@functools.cache
def _renameat2():
    """glibc's renameat2 (2.28 and later), or None (another OS or libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under `root` (files first, each directory after its entries)."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(Path(directory))


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


# --- weights ---------------------------------------------------------------------------------------


def save_weights(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Writes a flat name -> tensor dict as safetensors, atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not Path(path).exists():
        raise CheckpointError(f"{path}: not found; run `dvc repro train` (or `ddpmrepro train`) first")
    try:
        return load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({str(e).splitlines()[0][:200]}); retrain or restore it with `dvc checkout`") from None


def weights_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors file, from its header alone (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({str(e).splitlines()[0][:200]}); retrain or restore it with `dvc checkout`") from None


def read_json(path: Path, fix: str) -> dict:
    """A JSON object another stage wrote (a metrics.json, sampling.json, bpd.json); CheckpointError
    naming the file and ending with `fix` where it is not one."""
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found; {fix}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({str(e).splitlines()[0]}); {fix}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: a JSON {type(value).__name__}, not an object; {fix}")
    return value
