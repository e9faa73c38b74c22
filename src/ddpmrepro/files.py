"""Files that must never be seen half-written, and weight files read as untrusted input.

Every output of the pipeline goes through `atomic_write_bytes` (temp file, fsync, rename, fsync of
the directory), so a kill leaves the old file or the new one, never a torn one. Exported weights are
safetensors: loading one runs no code, whatever the file holds.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TEMP_FILE = re.compile(r"^\..+\.tmp\.(\d+)$")  # atomic_write_bytes's `.<name>.tmp.<writer pid>`


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which file and what to do."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, write) -> None:
    """Calls write(file) on a temp file in the same directory, fsyncs and renames it into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode()))


def save_weights(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Writes a flat name -> tensor dict as safetensors, atomically."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    if not Path(path).exists():
        raise CheckpointError(f"{path}: not found; run `dvc repro train` (or `ddpmrepro train`) first")
    try:
        return load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({str(e).splitlines()[0][:200]}); retrain or restore it with `dvc checkout`") from None


def ema_filename(rate: float) -> str:
    return f"ema_{rate:g}.safetensors"
