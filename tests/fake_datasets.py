"""Small fake datasets written in the exact on-disk formats of the real ones, for tests.

* `fake_mnist`: torchvision's `root/<MNIST|FashionMNIST>/raw/*-ubyte` IDX files (big-endian header,
  uint8 data; optionally only the downloaded `.gz` form).
* `fake_cifar10`: `root/cifar-10-batches-py/` as the official archive has it: protocol-2 pickles as
  Python 2's cPickle wrote them (byte strings, `numpy.core.multiarray._reconstruct`), loaded by
  torchvision with `pickle.load(f, encoding="latin1")`.
* `fake_image_folder`: `root/<class>/<i>.<ext>` images in any PIL format.

Each returns the arrays it wrote, so tests can compare what the loaders read against the truth.
"""
from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path

import numpy as np
from PIL import Image

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# --- IDX ---------------------------------------------------------------------------------------


def write_idx(path: Path, arr: np.ndarray, compress: bool = False) -> None:
    """IDX/SN3: bytes 0,0, type 0x08 (uint8), ndim; the dims as big-endian uint32; then the raw data."""
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        f.write(header + arr.tobytes())


def fake_mnist(root: Path, folder: str = "MNIST", n_train: int = 40, n_test: int = 20, seed: int = 0,
               gz_only: bool = False) -> dict:
    """Writes the four IDX files torchvision's MNIST/FashionMNIST read; returns {split: (images, labels)}."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        suffix = ".gz" if gz_only else ""
        write_idx(raw / f"{prefix}-images-idx3-ubyte{suffix}", x, compress=gz_only)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte{suffix}", y, compress=gz_only)
        out[split] = (x, y.astype(np.int64))
    return out


# --- Python 2 style pickles (CIFAR) -------------------------------------------------------------


def py2_pickle(obj) -> bytes:
    """Protocol-2 pickle of dicts, lists, tuples, str, int, bool, None and uint8 arrays, emitted as
    Python 2's cPickle did for the CIFAR archive: str as byte strings, arrays via
    `numpy.core.multiarray._reconstruct` with a byte-string state. Memo opcodes are omitted."""
    out = bytearray(b"\x80\x02")

    def s(b: bytes) -> None:  # a Python 2 str
        out.extend(b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b)

    def g(module: str, name: str) -> None:
        out.extend(b"c" + module.encode() + b"\n" + name.encode() + b"\n")

    def emit(o) -> None:
        if o is None:
            out.extend(b"N")
        elif isinstance(o, bool):
            out.extend(b"\x88" if o else b"\x89")
        elif isinstance(o, int):
            out.extend(b"K" + bytes([o]) if 0 <= o < 256 else b"J" + struct.pack("<i", o))
        elif isinstance(o, (str, bytes)):
            s(o.encode("latin1") if isinstance(o, str) else o)
        elif isinstance(o, tuple):
            out.extend(b"(")
            for v in o:
                emit(v)
            out.extend(b"t")
        elif isinstance(o, list):
            out.extend(b"](")
            for v in o:
                emit(v)
            out.extend(b"e")
        elif isinstance(o, dict):
            out.extend(b"}(")
            for k, v in o.items():
                emit(k)
                emit(v)
            out.extend(b"u")
        elif isinstance(o, np.ndarray):
            assert o.dtype == np.uint8, "only uint8 arrays"
            g("numpy.core.multiarray", "_reconstruct")
            g("numpy", "ndarray")
            emit((0,))
            s(b"b")
            out.extend(b"\x87R")  # TUPLE3, REDUCE
            out.extend(b"(K\x01")  # state: (version 1, shape, dtype, fortran, data)
            emit(tuple(o.shape))
            g("numpy", "dtype")
            emit(("u1", 0, 1))
            out.extend(b"R")
            emit((3, "|", None, None, None, -1, -1, 0))
            out.extend(b"b")  # BUILD the dtype
            emit(False)
            s(np.ascontiguousarray(o).tobytes())
            out.extend(b"tb")  # TUPLE, BUILD the array
        else:
            raise TypeError(f"py2_pickle cannot write {type(o).__name__}")

    emit(obj)
    out.extend(b".")
    return bytes(out)


def fake_cifar10(root: Path, n_per_batch: int = 6, n_test: int = 10, seed: int = 0) -> dict:
    """Writes root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}.

    Returns {"train": (images, labels), "test": (...), "md5": {file: md5}}; images are (N, 3, 32, 32).
    """
    rng = np.random.default_rng(seed)
    d = Path(root) / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    xs, ys = {"train": [], "test": []}, {"train": [], "test": []}
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        n = n_test if name == "test_batch" else n_per_batch
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in (np.arange(n) + i) % 10]
        batch = {"batch_label": f"testing batch 1 of 1" if name == "test_batch" else f"training batch {i + 1} of 5",
                 "labels": labels, "data": data, "filenames": [f"img_{i}_{j}.png" for j in range(n)]}
        (d / name).write_bytes(py2_pickle(batch))
        split = "test" if name == "test_batch" else "train"
        xs[split].append(data.reshape(-1, 3, 32, 32))
        ys[split].append(np.array(labels, np.int64))
    meta = {"num_cases_per_batch": n_per_batch, "label_names": CIFAR10_NAMES, "num_vis": 3072}
    (d / "batches.meta").write_bytes(py2_pickle(meta))
    out = {s: (np.concatenate(xs[s]), np.concatenate(ys[s])) for s in ("train", "test")}
    out["md5"] = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in d.iterdir()}
    return out


# --- image folders -----------------------------------------------------------------------------


def fake_image_folder(root: Path, classes=("cat", "dog", "fox"), per_class: int = 5, size=(20, 14),
                      fmt: str = "PNG", mode: str = "RGB", seed: int = 0) -> dict:
    """Writes root/<class>/<i>.<ext> images; returns {class: [uint8 arrays as written]}."""
    rng = np.random.default_rng(seed)
    ext = {"PNG": "png", "JPEG": "jpg", "BMP": "bmp"}.get(fmt, fmt.lower())
    out = {}
    for c in classes:
        (Path(root) / c).mkdir(parents=True, exist_ok=True)
        out[c] = []
        for i in range(per_class):
            shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
            arr = rng.integers(0, 256, shape, dtype=np.uint8)
            Image.fromarray(arr).save(Path(root) / c / f"{i:03d}.{ext}", format=fmt)
            out[c].append(arr)
    return out
