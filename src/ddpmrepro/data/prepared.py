"""The prepared format (version 1): writing it byte-deterministically and atomically, reading it back
with checksum verification, and converting between uint8 images and the model's [-1, 1] range.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddpmrepro.data.sources import HFLIP_OK, READERS, DataError, Raw
from ddpmrepro.params import DataParams
from ddpmrepro.checkpoint import sha256_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "test")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip can hold; fixed so the bytes never change


@dataclass(frozen=True)
class Prepared:
    train_images: np.ndarray  # (N, C, H, W) uint8
    train_labels: np.ndarray  # (N,) int64
    test_images: np.ndarray
    test_labels: np.ndarray
    manifest: dict

    @property
    def num_classes(self) -> int:
        return self.manifest["num_classes"]

    @property
    def hflip_ok(self) -> bool:
        return self.manifest["hflip_ok"]


# --- prepare -----------------------------------------------------------------------------------


def prepare(params: DataParams, out_dir: str | Path) -> dict:
    """Reads `params.source`, writes `out_dir/{train,test}.npz` and `manifest.json`; returns the manifest.

    The same inputs and params give byte-identical files. Everything is built in a temporary sibling
    directory that replaces `out_dir` only once complete, so a failure leaves an existing output untouched.
    """
    out_dir = Path(out_dir)
    # Read and preprocess.
    raw = READERS[params.source](params)
    if len(raw.labels) == 0:
        raise DataError(f"{params.root}: the {params.source} dataset is empty; add data or fix data.root")
    is_test = raw.is_test if raw.is_test is not None else stratified_split(
        raw.labels, len(raw.class_names), params.test_fraction, params.split_seed, raw.class_names)
    k = len(raw.class_names)
    splits = {"train": np.flatnonzero(~is_test), "test": np.flatnonzero(is_test)}
    for split, idx in splits.items():
        if len(idx) == 0:
            raise DataError(f"{params.root}: the {split} split of {params.source} is empty; add data")

    # Write into a temporary sibling, then swap it into place.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        files = {}
        for split, idx in splits.items():
            name = f"{split}.npz"
            write_npz(tmp / name, images=raw.images[idx], labels=raw.labels[idx])
            files[name] = sha256_file(tmp / name)
        manifest = _manifest(params, raw, files, {s: np.bincount(raw.labels[i], minlength=k).tolist()
                                                   for s, i in splits.items()},
                             "official" if raw.is_test is not None else "stratified")
        _write_bytes(tmp / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("prepared %s: %d train / %d test images of %dx%dx%d in %s", params.source, len(splits["train"]),
             len(splits["test"]), params.channels, params.image_size, params.image_size, out_dir)
    return manifest


def stratified_split(labels: np.ndarray, num_classes: int, test_fraction: float, seed: int,
                     class_names: list[str]) -> np.ndarray:
    """Boolean test mask: round(test_fraction * n_c) images of each class (at least 1, leaving at least 1).

    The order within a class comes from hashing (seed, index), so the split depends only on the labels
    and the seed, never on the numpy version's random streams.
    """
    is_test = np.zeros(len(labels), bool)
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        if len(idx) < 2:
            raise DataError(f"class {class_names[c]!r}: has {len(idx)} image(s); a stratified split needs at "
                            f"least 2 per class, add images to it")
        n_test = min(max(int(np.floor(test_fraction * len(idx) + 0.5)), 1), len(idx) - 1)
        keys = [hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest() for i in idx]
        order = sorted(range(len(idx)), key=keys.__getitem__)
        is_test[idx[order[:n_test]]] = True
    return is_test


def _manifest(params: DataParams, raw: Raw, files: dict, counts: dict, split: str) -> dict:
    digest = hashlib.sha256()
    for rel, sha in sorted(raw.inputs):
        digest.update(f"{rel}\0{sha}\n".encode())
    inputs = {"origin": raw.origin, "num_files": len(raw.inputs), "sha256": digest.hexdigest()}
    if len(raw.inputs) <= 16:
        inputs["files"] = dict(sorted(raw.inputs))
    if raw.md5_official is not None:
        inputs["md5_official"] = raw.md5_official
    resized = raw.native_size != params.image_size
    return {
        "format_version": FORMAT_VERSION,
        "source": params.source,
        "class_names": list(raw.class_names),
        "num_classes": len(raw.class_names),
        "image_size": params.image_size,
        "channels": params.channels,
        "hflip_ok": HFLIP_OK[params.source],
        "split": split,
        "counts": counts,
        "files": files,
        "preprocess": {"native_size": raw.native_size,
                       "resize": "PIL LANCZOS, shorter side + centre crop" if resized else None},
        "inputs": inputs,
        "params": dataclasses.asdict(params),
    }


# --- deterministic, atomic files ----------------------------------------------------------------


def write_npz(path: Path, **arrays: np.ndarray) -> None:
    """Like np.savez (uncompressed, readable by np.load) but with fixed zip metadata: same arrays, same bytes."""
    with open(path, "wb") as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
            for name, arr in arrays.items():
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
                info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
                info.create_system, info.external_attr = 3, 0o644 << 16  # unix, rw-r--r--
                zf.writestr(info, buf.getvalue(), compress_type=zipfile.ZIP_STORED)
        f.flush()
        os.fsync(f.fileno())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Renames the finished `tmp` to `out_dir`; an old `out_dir` is moved aside first and deleted after."""
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0o700
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:  # put the old output back
            os.replace(old / out_dir.name, out_dir)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    if hasattr(os, "O_DIRECTORY"):  # persist the renames
        fd = os.open(out_dir.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- load_prepared --------------------------------------------------------------------------------


def load_prepared(directory: str | Path) -> Prepared:
    """Reads a prepared directory after checking its format version and the sha256 of each file."""
    directory = Path(directory)
    fix = "run `ddpmrepro prepare` (or `dvc repro prepare`) again"
    mpath = directory / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise DataError(f"{mpath}: not found; {fix}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{mpath}: unreadable ({e}); {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise DataError(f"{mpath}: format_version {version!r}, this code reads {FORMAT_VERSION}; {fix}")
    arrays = {}
    for split in SPLITS:
        path = directory / f"{split}.npz"
        try:
            blob = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
        expected = manifest.get("files", {}).get(path.name)
        if hashlib.sha256(blob).hexdigest() != expected:
            raise DataError(f"{path}: sha256 does not match manifest.json (modified or incomplete); {fix} "
                            f"or `dvc checkout {directory}`")
        arrays[split] = _check_arrays(blob, path, manifest, split, fix)
        if len(arrays[split][1]) == 0:  # `prepare` refuses to write one, so this is damage
            raise DataError(f"{path}: the {split} split is empty; {fix}")
    return Prepared(*arrays["train"], *arrays["test"], manifest)


def _check_arrays(blob: bytes, path: Path, manifest: dict, split: str, fix: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            images, labels = z["images"], z["labels"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a prepared npz with 'images' and 'labels' ({e}); {fix}") from None
    c, s, k = manifest["channels"], manifest["image_size"], manifest["num_classes"]
    ok = (images.dtype == np.uint8 and images.ndim == 4 and images.shape[1:] == (c, s, s)
          and labels.dtype == np.int64 and labels.shape == (len(images),)
          and (len(labels) == 0 or 0 <= labels.min() <= labels.max() < k)
          and np.bincount(labels, minlength=k).tolist() == manifest["counts"][split])
    if not ok:
        raise DataError(f"{path}: arrays {images.dtype}{images.shape}/{labels.dtype}{labels.shape} disagree with "
                        f"manifest.json; {fix}")
    return images, labels


# --- model range ---------------------------------------------------------------------------------


def to_model_range(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 images (any shape) -> float32 tensor in [-1, 1], as the model sees them."""
    x = torch.from_numpy(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.dtype != torch.uint8:
        raise TypeError(f"to_model_range expects uint8 images, got {x.dtype}")
    return x.float() / 127.5 - 1


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Tensor in [-1, 1] -> uint8 (rounded, clamped): the inverse of `to_model_range`."""
    return ((x.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
