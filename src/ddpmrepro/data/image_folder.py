"""Image folders, `root/<class>/*.png|jpg|...` or `root/{train,test}/<class>/*`: listed, then decoded
in order by a pool of worker processes.

Memory does not grow with the number of images beyond ~10 bytes each (the label, the split and,
while the split is made, its key: what the stratified split needs for all of them): a class folder
is listed to count its images, again for the split's keys, and again, alone, when its images are
decoded, so file names are held for one class at a time. The order is the order of path components
(what sorting `Path`s gives) by their names in Unicode's composed form, the same on every machine.
Decoding runs in fixed-size chunks (their boundaries depend only on the image size), at most two per
worker in flight, consumed in submission order: the output bytes are the same for 1 or N workers.
"""
from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import signal
import sys
import threading
import unicodedata
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ddpmrepro.data.sources import (
    IMAGE_EXTENSIONS, MAX_UPSCALE, DataError, Inputs, Source, chunk_images, decoding, first_line, fit_image, read_raw,
    root_dir, sha256_hex,
)
from ddpmrepro.params import DataParams

_EXTENSIONS = {os.fsencode(e) for e in IMAGE_EXTENSIONS}


def read_image_folder(params: DataParams) -> Source:
    """`root/<class>/*` (split here), or `root/{train,test}/<class>/*` (its own split). Sorted class
    names; every image is converted, resized and centre-cropped."""
    root = root_dir(params)
    classes = _subdirs(root)
    if not classes:
        raise DataError(f"{root}: no class sub-folders; put images in {root}/<class_name>/ (one folder per class)")
    files, is_test = FolderFiles(root), None
    _refuse_splits_as_classes(root, classes)
    if classes == ["test", "train"]:
        classes = _subdirs(root / "train")
        if not classes:
            raise DataError(f"{root / 'train'}: no class sub-folders; put images in {root}/train/<class_name>/")
        test_classes = _subdirs(root / "test")
        if list(map(nfc, test_classes)) != list(map(nfc, classes)):
            raise DataError(f"{root / 'test'}: its class folders differ from those in {root / 'train'}; "
                            f"use the same class names in both")
        files.add_classes("train/", classes)
        n_train = len(files)
        files.add_classes("test/", test_classes)
        is_test = np.zeros(len(files), bool)
        is_test[n_train:] = True
    else:
        files.add_classes("", classes)
    size, channels = params.image_size, params.channels
    inputs = Inputs("data.root")
    return Source(files.labels(), [nfc(c) for c in classes], is_test, (channels, size, size), None, inputs,
                  lambda workers: decode_in_order(root, files, size, channels, workers, inputs),
                  split_keys=files.name_keys)


# Folder names that say "split", not "class": root/{train,val,test}/<class>/ taken as three classes would
# train every class under three wrong labels without a word.
SPLIT_NAMES = {"train", "training", "test", "testing", "val", "valid", "validation", "dev", "eval"}


def _refuse_splits_as_classes(root: Path, classes: list[str]) -> None:
    """A top folder named like a split whose images all sit in sub-folders is a split of another
    layout, not a class (a class that happens to be called `train` holds its images itself)."""
    if classes == ["test", "train"]:
        return
    splits = [c for c in classes if c.lower() in SPLIT_NAMES and _images_only_in_subfolders(root / c)]
    if splits:
        they = "look like splits" if len(splits) > 1 else "looks like a split"
        raise DataError(
            f"{root}: {', '.join(splits)} {they} with class folders inside, not classes; data.root "
            f"holds either <class>/ folders (split here by data.test_fraction) or exactly train/<class>/ and "
            f"test/<class>/ (your own split, lower case): rename them so, and move any other (a val/ folder) out")


def _images_only_in_subfolders(folder: Path) -> bool:
    with os.scandir(folder) as it:
        entries = [e for e in it if not e.name.startswith(".")]
    direct = any(os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS and e.is_file() for e in entries)
    return not direct and any(e.is_dir() for e in entries)


def _subdirs(folder: Path) -> list[str]:
    """The folder's visible sub-folders as named on disk, in the order of their NFC names."""
    with os.scandir(folder) as it:
        names = [e.name for e in it if not e.name.startswith(".") and _is_dir(e)]
    for name in names:
        _check_utf8(os.fsencode(folder / name))
    _refuse_twins(os.fsencode(folder), names)
    return sorted(names, key=lambda n: (nfc(n), n))


def nfc(name):
    """`name` (str or UTF-8 bytes) in Unicode's composed form (NFC): a name macOS wrote decomposed
    (NFD: `a` + a combining umlaut) is the same name, so it sorts, labels, hashes and is recorded
    the same wherever the folder was made. ASCII names are returned as they are."""
    if name.isascii():
        return name
    if isinstance(name, bytes):
        return unicodedata.normalize("NFC", name.decode("utf-8")).encode("utf-8")
    return unicodedata.normalize("NFC", name)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError as e:  # ELOOP: a link to itself, or links that lead to each other
        raise DataError(f"{os.fsdecode(entry.path)}: cannot be followed ({e.strerror}); remove the link") from None


def _refuse_twins(folder, names) -> None:
    """Two names in one folder that are one name in NFC (`café` typed, and `café` from macOS) would be
    one class, one split key and one manifest path: refused."""
    seen = {}
    for name in names:
        twin = seen.setdefault(nfc(name), name)
        if twin != name:
            shown = f"{os.fsdecode(folder)}/{os.fsdecode(nfc(name))}"
            raise DataError(f"{shown}: two names in {os.fsdecode(folder)} are this one in Unicode's composed form "
                            "(one typed, one decomposed as macOS writes it); rename or merge them")


def _check_utf8(path: bytes) -> None:
    """A file or folder name that is not UTF-8 (a zip made on Windows, say) cannot go into the
    manifest or a class name: refused, naming it with its odd bytes escaped."""
    try:
        path.decode("utf-8")
    except UnicodeDecodeError:
        shown = path.decode("utf-8", "backslashreplace")
        raise DataError(f"{shown}: its name is not UTF-8 text (made on another system?); rename it, e.g. "
                        "`convmv -f latin1 -t utf8 -r --notest DIR` for names from Windows") from None


def list_images(folder: bytes) -> np.ndarray:
    """Image files under `folder`, recursively, as paths relative to it (a byte-string array), in the
    order of their path components; hidden files and folders are skipped, symbolic links followed.
    Names are gathered in batches of bytes, so listing a 100k-file directory costs ~3 MB. A name
    that is not UTF-8, two names that are one in NFC, a link to a folder above it (a loop), a link
    to itself and a link to nothing are refused."""
    batches, batch, dirs = [], [], set()
    here = os.path.realpath(folder)
    with os.scandir(folder) as it:
        for e in it:
            if e.name.startswith(b"."):
                continue
            if _is_dir(e):
                _check_utf8(e.path)
                real = os.path.realpath(e.path)
                if os.path.commonpath([real, here]) == real:  # the link leads to this folder or above it
                    raise DataError(f"{os.fsdecode(e.path)}: a symbolic link to a folder above it (a loop); "
                                    "remove the link")
                dirs.add(e.name)
            elif os.path.splitext(e.name)[1].lower() in _EXTENSIONS:
                if not e.is_file():
                    if e.is_symlink():
                        raise DataError(f"{os.fsdecode(e.path)}: a symbolic link to nothing; restore its target "
                                        "or remove the link")
                    continue
                _check_utf8(e.path)
                batch.append(e.name)
                if len(batch) == 8192:
                    batches.append(np.array(batch))
                    batch = []
    if batch:
        batches.append(np.array(batch))
    # Byte order is str order for UTF-8 names, and NUL padding sorts a prefix first, as str does.
    files = np.sort(np.concatenate(batches)) if batches else np.array([], "S1")
    if not all(name.isascii() for name in files.tolist()) or not all(name.isascii() for name in dirs):
        files = np.array(sorted(files.tolist(), key=lambda n: (nfc(n), n)))  # in the order of the NFC names
        _refuse_twins(folder, [*files.tolist(), *dirs])
    if not dirs:
        return files
    found = []
    for name in sorted([*files.tolist(), *dirs], key=lambda n: (nfc(n), n)):
        if name in dirs:
            found += [name + b"/" + sub for sub in list_images(folder + b"/" + name).tolist()]
        else:
            found.append(name)
    return np.array(found) if found else np.array([], "S1")


class FolderFiles:
    """The image files of a folder dataset in dataset order, in groups (one per split and class).
    Holds counts only; a group's names are listed again when they are needed, one group at a time."""

    def __init__(self, root: Path):
        self.root = root
        self.groups: list[tuple[str, int, int]] = []  # (folder relative to root, e.g. "train/cat/", label, count)
        self._listed: tuple[int, np.ndarray] | None = None

    def add_classes(self, rel: str, classes: list[str]) -> None:
        for label, name in enumerate(classes):
            n = len(list_images(os.fsencode(self.root / rel / name)))
            if not n:
                where = f"the folder (and {name}/ in the other split folder)" if rel else "the folder"
                raise DataError(f"{self.root / rel / name}: class folder has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                                f"add images or remove {where}")
            self.groups.append((f"{rel}{name}/", label, n))

    def __len__(self) -> int:
        return sum(n for _, _, n in self.groups)

    def labels(self) -> np.ndarray:
        """(N,) labels in dataset order, in the smallest integer type that holds them."""
        dtype = np.min_scalar_type(max(label for _, label, _ in self.groups))
        return np.repeat(np.array([label for _, label, _ in self.groups], dtype), [n for _, _, n in self.groups])

    def name_keys(self, seed: int) -> np.ndarray:
        """(N,) uint64 split keys in dataset order: a hash of the seed and each file's path in its
        class folder (`prepared.stratified_split`), one group listed at a time."""
        keys, start, prefix = np.empty(len(self), np.uint64), 0, f"{seed}/".encode()
        for g, (_, _, n) in enumerate(self.groups):  # 8 bytes an image, not a list of Python ints
            keys[start:start + n] = np.fromiter(
                (int.from_bytes(hashlib.blake2b(prefix + nfc(name), digest_size=8).digest(), "big")
                 for name in self._names(g).tolist()), np.uint64, n)
            start += n
        return keys

    def rel_paths(self, start: int, stop: int) -> list[str]:
        """Paths relative to data.root of files start..stop-1, as the manifest records them (in order:
        each group is listed again once, when its first file is asked for)."""
        offsets = np.cumsum([0] + [n for _, _, n in self.groups])
        out = []
        for i in range(start, stop):
            g = int(np.searchsorted(offsets, i, side="right")) - 1
            out.append(self.groups[g][0] + os.fsdecode(self._names(g)[i - offsets[g]]))
        return out

    def _names(self, g: int) -> np.ndarray:
        if self._listed is None or self._listed[0] != g:
            rel, _, n = self.groups[g]
            names = list_images(os.fsencode(self.root / rel))
            if len(names) != n:
                raise DataError(f"{self.root / rel}: changed while it was being prepared ({n} images, now "
                                f"{len(names)}); run prepare again once the folder is complete")
            self._listed = (g, names)
        return self._listed[1]


# --- decoding ------------------------------------------------------------------------------------


def decode_image(blob: bytes, path: Path, size: int, channels: int) -> np.ndarray:
    """One image file's bytes -> (channels, size, size) uint8, or a DataError naming the file."""
    try:
        with Image.open(io.BytesIO(blob)) as img:
            img.load()
            img = ImageOps.exif_transpose(img)  # camera photos store their rotation in EXIF
    except UnidentifiedImageError:
        raise DataError(f"{path}: not an image file (its content matches none of the formats Pillow reads); "
                        f"remove it or replace it with an image") from None
    except Exception as e:  # a damaged file can make a decoder raise nearly anything
        raise DataError(f"{path}: cannot be read as an image ({first_line(e)}); remove or replace it") from None
    if size > MAX_UPSCALE * min(img.size):
        raise DataError(f"{path}: {img.size[0]}x{img.size[1]} is too small for data.image_size {size} "
                        f"(more than {MAX_UPSCALE}x upscaling); remove it or lower image_size")
    with decoding(path, "a convertible image", "remove or replace it"):
        return fit_image(img, size, channels)


def decode_files(root: str, rels: list[str], size: int, channels: int) -> tuple[np.ndarray, list[str]]:
    """A decode task: the files `root/rel` -> ((n, channels, size, size) uint8, their sha256s)."""
    out = np.empty((len(rels), channels, size, size), np.uint8)
    shas = []
    for i, rel in enumerate(rels):
        path = Path(root, rel)
        blob = read_raw(path, "check the folder")
        out[i] = decode_image(blob, path, size, channels)
        shas.append(sha256_hex(blob))
    return out, shas


def default_workers() -> int:
    """The CPUs this process may run on (a SLURM or taskset CPU set, not the whole machine)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group: the parent stops the pool, workers stay quiet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_method():
    """fork where it is safe (Linux, no other Python thread that could hold a lock at the fork): workers
    start at once and share the parent's imports. Otherwise forkserver (or spawn), which start clean
    but re-import the main module (a script run from stdin cannot be)."""
    if sys.platform == "linux" and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def decode_in_order(root: Path, files: FolderFiles, size: int, channels: int, workers: int,
                    inputs: Inputs) -> Iterator[np.ndarray]:
    """Decodes every file of `files`, yielding image chunks in dataset order whatever `workers` is
    (one worker decodes in this process); records each file's sha256 in `inputs` in that order."""
    n, step = len(files), chunk_images((channels, size, size))
    starts = range(0, n, step)
    tasks = ((os.fspath(root), files.rel_paths(s, min(n, s + step)), size, channels) for s in starts)
    workers = max(1, min(workers, len(starts)))

    def done(task, result):
        for rel, sha in zip(task[1], result[1]):
            inputs.add(nfc(rel), sha)
        return result[0]

    if workers == 1:
        for task in tasks:
            yield done(task, decode_files(*task))
        return
    with ProcessPoolExecutor(workers, mp_context=_start_method(), initializer=_worker_init) as pool:
        pending: deque = deque()
        try:
            for task in tasks:
                pending.append((task, pool.submit(decode_files, *task)))
                if len(pending) >= 2 * workers:
                    task_, future = pending.popleft()
                    yield done(task_, future.result())
            while pending:
                task_, future = pending.popleft()
                yield done(task_, future.result())
        finally:
            for _, future in pending:
                future.cancel()
