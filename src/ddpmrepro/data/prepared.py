"""The prepared format (version 2): written by streaming shards, read back as verified memory maps.

`prepare` turns a `Source` into `<split>-<k>.{images,labels}.npy` shards (see `shards.py`) and
`manifest.json`, never holding more than a few chunks of images: the images arrive in the source's
order and each goes to the writer of its split. The same inputs and params give the same bytes,
whatever the number of decode workers. Everything is written into a temporary sibling directory
that replaces the output only once complete, so a failure leaves the previous output untouched.

`load_prepared` checks the manifest, the sha256 of every shard (cheap on reruns: see `verify.py`)
and the arrays' shapes and label counts, then returns the images as memory maps: a split is read
only where it is used.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddpmrepro.data import shards
from ddpmrepro.data import sources
from ddpmrepro.data.image_folder import default_workers, read_image_folder
from ddpmrepro.data.sources import HFLIP_OK, DataError, Source
from ddpmrepro.data.verify import Verifier
from ddpmrepro import outputs
from ddpmrepro.files import atomic_write_text, replacing_dir
from ddpmrepro.params import DataParams

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
READERS = {
    "digits": sources.read_digits,
    "mnist5k": sources.read_mnist5k,
    "mnist": sources.read_mnist_family,
    "fashion_mnist": sources.read_mnist_family,
    "cifar10": sources.read_cifar10,
    "image_folder": read_image_folder,
}
SPLITS = ("train", "test")
FIX = "run `ddpmrepro prepare` (or `dvc repro prepare`) again"


@dataclass(frozen=True)
class Prepared:
    train_images: np.ndarray  # (N, C, H, W) uint8: a memory map, or a ShardedArray of several
    train_labels: np.ndarray  # (N,) int64, in memory
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


def prepare(params: DataParams, out_dir: str | Path, *, workers: int | None = None) -> dict:
    """Reads `params.source`, writes the shards of both splits and `manifest.json` into `out_dir`;
    returns the manifest. `workers`: image-folder decode processes (default: the CPUs this process
    may use); it never changes the output.
    """
    out_dir = Path(out_dir)
    workers = default_workers() if workers is None else workers
    # What goes where: labels and the split are known before any image is decoded.
    source = READERS[params.source](params)
    labels = source.labels
    if len(labels) == 0:
        raise DataError(f"{params.root}: the {params.source} dataset is empty; add data or fix data.root")
    k = len(source.class_names)
    is_test = source.is_test if source.is_test is not None else stratified_split(
        labels, k, params.test_fraction, params.split_seed, source.class_names,
        keys=source.split_keys(params.split_seed) if source.split_keys else None)
    check_split_sizes(params, is_test)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _check_free_space(out_dir, len(labels), source.image_shape)

    # Decode in the source's order, each image to its split's writer; then swap the result into place.
    with replacing_dir(out_dir, outputs.PREPARED) as tmp:
        files: dict[str, str] = {}
        n_test = int(is_test.sum())
        writers = {"train": shards.SplitWriter(tmp, "train", len(labels) - n_test, source.image_shape, files),
                   "test": shards.SplitWriter(tmp, "test", n_test, source.image_shape, files)}
        try:
            start = 0
            for chunk in source.images(workers):
                mask, y = is_test[start:start + len(chunk)], labels[start:start + len(chunk)]
                writers["train"].write(chunk[~mask], y[~mask])
                writers["test"].write(chunk[mask], y[mask])
                start += len(chunk)
            splits = {name: w.close() for name, w in writers.items()}
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        counts = {"train": np.bincount(labels[~is_test], minlength=k).tolist(),
                  "test": np.bincount(labels[is_test], minlength=k).tolist()}
        manifest = _manifest(params, source, files, splits, counts,
                             "official" if source.is_test is not None else "stratified")
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    log.info("prepared %s: %d train / %d test images of %dx%dx%d in %s (%d shards)", params.source,
             splits["train"]["count"], splits["test"]["count"], *source.image_shape, out_dir,
             sum(len(s["shards"]) for s in splits.values()))
    return manifest


def _check_free_space(out_dir: Path, n: int, image_shape: tuple[int, ...]) -> None:
    """Refuses, before decoding anything, a prepare that cannot fit beside the previous output (which is
    kept until the swap): an hour of decoding should not end in a full disk."""
    need = n * (int(np.prod(image_shape)) + 8) + (64 << 10)
    free = shutil.disk_usage(out_dir.parent).free
    if need > free:
        raise DataError(f"{out_dir}: no space left on the device for the prepared data (it needs {_size(need)}, "
                        f"{_size(free)} is free); free some space or write it elsewhere with --out")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def stratified_split(labels: np.ndarray, num_classes: int, test_fraction: float, seed: int,
                     class_names: list[str], keys: np.ndarray | None = None) -> np.ndarray:
    """Boolean test mask: round(test_fraction * n_c) images of each class (at least 1, leaving at least 1),
    those with the smallest keys.

    `keys` (N,) uint64: each image's own (an image folder's: a hash of the seed and the file's path
    in its class folder, `image_folder.name_keys`), so that adding, removing or renaming a file
    moves at most that file and one other of its class between the splits, and no other class's.
    Without them a hash of (seed, index): the split depends only on the labels and the seed (for
    the bundled and torchvision datasets, whose order is fixed), never on numpy's random streams.
    """
    check_class_counts(labels, num_classes, class_names)
    is_test = np.zeros(len(labels), bool)
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        n_test = test_count(len(idx), test_fraction)
        if keys is not None:
            class_keys = keys[idx]
        else:
            class_keys = np.fromiter((int.from_bytes(hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest(),
                                                     "big") for i in idx), np.uint64, len(idx))  # 8 bytes an image
        is_test[idx[np.argsort(class_keys, kind="stable")[:n_test]]] = True
    return is_test


def test_count(n: int, test_fraction: float) -> int:
    """How many of a class's `n` images the stratified split puts in the test split."""
    return min(max(int(np.floor(test_fraction * n + 0.5)), 1), n - 1)


def check_split_sizes(params: DataParams, is_test: np.ndarray) -> None:
    for split, mask in (("train", ~is_test), ("test", is_test)):
        if not mask.any():
            raise DataError(f"{params.root}: the {split} split of {params.source} is empty; add data")


def check_class_counts(labels: np.ndarray, num_classes: int, class_names: list[str]) -> None:
    """The stratified split's need: 2 images per class at least (one for each split)."""
    counts = np.bincount(labels, minlength=num_classes)
    for c in np.flatnonzero(counts < 2):
        raise DataError(f"class {class_names[c]!r}: has {counts[c]} image(s); a stratified split needs at "
                        f"least 2 per class, add images to it")


def check_source(params: DataParams) -> int | None:
    """What `prepare` would refuse of the raw data before decoding any of it, for check-params, which
    DVC and Snakemake run before they remove `data/prepared`: data.root and a torchvision source's
    folder exist; an image folder's layout (class folders with images, its own split or the
    stratified split's 2 per class, names, links, neither split empty), listed without opening an
    image. A damaged image is found only when prepare decodes it. The bundled sources need nothing.

    Returns the number of training images where the listing tells it (an image folder), so that a
    batch larger than the data is refused before prepare too; None for the other sources."""
    if params.source != "image_folder":
        sources.check_raw_folder(params)
        return None
    source = read_image_folder(params)
    if source.is_test is not None:
        check_split_sizes(params, source.is_test)
        return int((~source.is_test).sum())
    check_class_counts(source.labels, len(source.class_names), source.class_names)
    counts = np.bincount(source.labels, minlength=len(source.class_names))
    return int(sum(n - test_count(int(n), params.test_fraction) for n in counts))


def _manifest(params: DataParams, source: Source, files: dict, splits: dict, counts: dict, split: str) -> dict:
    inputs = source.inputs.manifest()
    if source.md5_official is not None:
        inputs["md5_official"] = source.md5_official
    resized = source.native_size != params.image_size
    return {
        "format_version": FORMAT_VERSION,
        "source": params.source,
        "class_names": list(source.class_names),
        "num_classes": len(source.class_names),
        "image_size": params.image_size,
        "channels": params.channels,
        "hflip_ok": HFLIP_OK[params.source],
        "split": split,
        "counts": counts,
        "shard_size": shards.shard_size(source.image_shape),
        "splits": splits,
        "files": dict(sorted(files.items())),
        "preprocess": {"native_size": source.native_size,
                       "resize": "PIL LANCZOS, shorter side + centre crop" if resized else None},
        "inputs": inputs,
        "params": dataclasses.asdict(params),
    }


# --- load_prepared --------------------------------------------------------------------------------


def load_prepared(directory: str | Path, *, verifier: Verifier | None = None) -> Prepared:
    """Reads a prepared directory after checking its format version, the sha256 of every shard
    (skipped for files a stamp vouches for, see `verify.py`), and the arrays against the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    splits = manifest["splits"]
    names = [name for split in SPLITS for shard in splits[split]["shards"] for name in (shard["images"], shard["labels"])]
    for name in names:
        if not (directory / name).is_file():
            raise DataError(f"{directory / name}: not found (the prepared data is incomplete); {FIX}")
    expected = {directory / name: manifest["files"].get(name) for name in names}
    bad = (verifier or Verifier()).verify(expected)
    if bad:
        raise DataError(f"{bad[0]}: sha256 does not match manifest.json (modified or incomplete); {FIX} "
                        f"or `dvc checkout {directory}`")
    arrays = {split: _open_split(directory, manifest, split) for split in SPLITS}
    return Prepared(*arrays["train"], *arrays["test"], manifest)


def read_manifest(directory: Path) -> dict:
    """The manifest of a format-2 directory; anything else is refused in one line saying what to run."""
    mpath = directory / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise DataError(f"{mpath}: not found; {FIX}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{mpath}: unreadable ({e}); {FIX}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version == 1 or (directory / "train.npz").exists():
        raise DataError(f"{directory}: prepared data in format version 1 (train.npz, test.npz), which this code no "
                        f"longer reads; {FIX} to write format {FORMAT_VERSION} (shards)")
    if version != FORMAT_VERSION:
        raise DataError(f"{mpath}: format_version {version!r}, this code reads {FORMAT_VERSION}; {FIX}")
    try:
        for split in SPLITS:
            entry = manifest["splits"][split]
            if shards.split_digest(entry["shards"], manifest["files"]) != entry["sha256"]:
                raise ValueError(f"the {split} split's sha256 does not match its shards")
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{mpath}: not a prepared manifest ({_describe(e)}); {FIX}") from None
    return manifest


def _describe(e: Exception) -> str:
    return f"no key {e}" if isinstance(e, KeyError) else str(e)


def _open_split(directory: Path, manifest: dict, split: str):
    """(images as one array-like, labels in memory), each shard checked against the manifest."""
    c, s, k = manifest["channels"], manifest["image_size"], manifest["num_classes"]
    images, labels = [], []
    for shard in manifest["splits"][split]["shards"]:
        path = directory / shard["images"]
        try:
            x = shards.open_npy(path)
            y = np.load(directory / shard["labels"], allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: not a prepared shard ({e}); {FIX}") from None
        if not (x.dtype == np.uint8 and x.shape == (shard["count"], c, s, s)
                and y.dtype == np.int64 and y.shape == (shard["count"],)):
            raise DataError(f"{path}: arrays {x.dtype}{x.shape}/{y.dtype}{y.shape} disagree with manifest.json; {FIX}")
        images.append(x)
        labels.append(y)
    y = np.concatenate(labels) if labels else np.zeros(0, np.int64)
    if len(y) == 0:  # `prepare` refuses to write one, so this is damage
        raise DataError(f"{directory}: the {split} split is empty; {FIX}")
    if not (0 <= y.min() <= y.max() < k and np.bincount(y, minlength=k).tolist() == manifest["counts"][split]):
        raise DataError(f"{directory / manifest['splits'][split]['shards'][0]['labels']}: labels disagree with the "
                        f"counts in manifest.json; {FIX}")
    return shards.concat(images), y


# --- model range ---------------------------------------------------------------------------------


def to_model_range(images):
    """uint8 images (any shape; numpy or torch) -> float32 tensor in [-1, 1], as the model sees them."""
    import torch  # not at import time: decode workers import this package and never need torch

    x = torch.from_numpy(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.dtype != torch.uint8:
        raise TypeError(f"to_model_range expects uint8 images, got {x.dtype}")
    return x.float() / 127.5 - 1


def to_uint8(x):
    """Tensor in [-1, 1] -> uint8 (rounded, clamped): the inverse of `to_model_range`."""
    import torch

    return ((x.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
