"""Shards of the prepared format (version 2): fixed-size `.npy` files, written as a stream and read
back as memory maps.

A split of N images is cut, in order, into shards of `shard_size` images (the last one smaller);
shard k is two plain `.npy` files, `<split>-<k:05d>.images.npy` (uint8 `(n, C, H, W)`) and
`<split>-<k:05d>.labels.npy` (int64 `(n,)`). `.npy` is the simplest format numpy memory-maps
(a header, then the raw C-order array), so a reader maps a shard without reading it and gathers rows
at `offset + i * row_bytes`.

`SplitWriter` writes a split from chunks of images arriving in order (the header first: every
shard's length is known in advance), hashing the bytes as they go, so `prepare` never holds more
than a chunk. `ShardedArray` presents several shards' memory maps as one array to the readers
(`load_prepared`), and a single shard is returned as the plain `np.memmap` it is.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

# About 128 MiB of images per shard: few files for DVC and the verifier (a 16 GB dataset is ~130),
# each large enough to stream at disk speed, small enough to hash in parallel and re-fetch alone.
SHARD_BYTES = 128 * 2**20


def shard_size(image_shape: tuple[int, ...]) -> int:
    """Images per shard for images of this (C, H, W) shape."""
    return max(1, SHARD_BYTES // int(np.prod(image_shape)))


def shard_names(split: str, k: int) -> tuple[str, str]:
    return f"{split}-{k:05d}.images.npy", f"{split}-{k:05d}.labels.npy"


def _header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The `.npy` header numpy itself writes for this shape and dtype (version 1.0, 64-byte aligned)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                              "fortran_order": False, "shape": tuple(int(s) for s in shape)})
    return buf.getvalue()


class _NpyStream:
    """One `.npy` file written front to back: header, then rows; sha256 of every byte written."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype):
        self.path, self.dtype, self.rows_left = path, np.dtype(dtype), shape[0]
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self._put(_header(shape, self.dtype))

    def _put(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)

    def write(self, rows: np.ndarray) -> None:
        assert rows.dtype == self.dtype and len(rows) <= self.rows_left
        self._put(memoryview(np.ascontiguousarray(rows)).cast("B"))
        self.rows_left -= len(rows)

    def close(self) -> str:
        assert self.rows_left == 0, f"{self.path}: {self.rows_left} rows missing"
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.sha.hexdigest()

    def abort(self) -> None:
        self.f.close()


class SplitWriter:
    """Writes one split as shards in `directory`: images and labels arrive in order, in chunks of any
    size; the split's size `count` is known in advance (so is every shard's). `close()` returns the
    split's manifest entry and records every file's sha256 in `files`."""

    def __init__(self, directory: Path, split: str, count: int, image_shape: tuple[int, ...], files: dict[str, str]):
        self.directory, self.split, self.total = directory, split, count
        self.image_shape, self.files = tuple(image_shape), files
        self.per_shard = shard_size(self.image_shape)
        self.count = 0  # images written so far
        self.shards: list[dict] = []
        self.current: _NpyStream | None = None
        self.labels: list[np.ndarray] = []  # of the current shard

    def write(self, images: np.ndarray, labels: np.ndarray) -> None:
        assert len(images) == len(labels)
        while len(images):
            if self.current is None:
                self._open()
            take = min(self.current.rows_left, len(images))
            self.current.write(images[:take])
            self.labels.append(labels[:take])
            self.count += take
            images, labels = images[take:], labels[take:]
            if self.current.rows_left == 0:
                self._finish()

    def _open(self) -> None:
        n = min(self.per_shard, self.total - self.count)
        assert n > 0, f"more {self.split} images than announced"
        images_name, labels_name = shard_names(self.split, len(self.shards))
        self.current = _NpyStream(self.directory / images_name, (n, *self.image_shape), np.uint8)
        self.shards.append({"images": images_name, "labels": labels_name, "count": n})

    def _finish(self) -> None:
        entry = self.shards[-1]
        self.files[entry["images"]] = self.current.close()
        self.current = None
        labels = _NpyStream(self.directory / entry["labels"], (entry["count"],), np.int64)
        labels.write(np.concatenate(self.labels).astype(np.int64))
        self.labels = []
        self.files[entry["labels"]] = labels.close()

    def close(self) -> dict:
        """The split's manifest entry: count, shards, and one sha256 over its files in order."""
        if self.count != self.total:
            raise AssertionError(f"{self.split}: {self.count} images written of {self.total}")
        return {"count": self.count, "sha256": split_digest(self.shards, self.files), "shards": self.shards}

    def abort(self) -> None:
        if self.current is not None:
            self.current.abort()


def split_digest(shards: list[dict], files: dict[str, str]) -> str:
    """One sha256 for a split: over `name\\0sha256\\n` of each shard's images and labels file, in order."""
    h = hashlib.sha256()
    for shard in shards:
        for name in (shard["images"], shard["labels"]):
            h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


# --- reading ---------------------------------------------------------------------------------------


def open_npy(path: Path) -> np.memmap:
    """A `.npy` file as a copy-on-write memory map: nothing is read until used, and a consumer that
    writes into the array changes its private copy, never the file (nor DVC's cache it may link to)."""
    return np.load(path, mmap_mode="c", allow_pickle=False)


class ShardedArray:
    """Several arrays (a split's shards) seen as one along the first axis, without copying them.

    What the readers of prepared data use: `len`, `shape`, `dtype`, `ndim`, iteration, indexing by an
    int, a slice, an int or bool index array, or a tuple whose first item is one of these (the rest
    applies to the rows), and `np.asarray(a)` (which reads everything). Rows come from the memory
    maps, so only the rows used are read. A slice within one shard is a view; anything else is a copy.
    """

    def __init__(self, parts: list[np.ndarray]):
        if not parts or any(p.shape[1:] != parts[0].shape[1:] or p.dtype != parts[0].dtype for p in parts):
            raise ValueError("ShardedArray needs one or more arrays of the same row shape and dtype")
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])  # (len(parts) + 1,)
        self.dtype = parts[0].dtype
        self.shape = (int(self.starts[-1]), *parts[0].shape[1:])
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ShardedArray(shape={self.shape}, dtype={self.dtype}, shards={len(self.parts)})"

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(self.parts) if len(self.parts) > 1 else np.array(self.parts[0])
        return out if dtype is None else out.astype(dtype, copy=False)

    def __iter__(self):
        for part in self.parts:
            yield from part

    def __getitem__(self, key):
        if isinstance(key, tuple):
            return self[key[0]][(slice(None), *key[1:])] if not _is_int(key[0]) else self[key[0]][key[1:]]
        if _is_int(key):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"index {key} is out of bounds for axis 0 with size {len(self)}")
            k = int(np.searchsorted(self.starts, i, side="right")) - 1
            return self.parts[k][i - self.starts[k]]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1:
                k = int(np.searchsorted(self.starts, start, side="right")) - 1
                if k < len(self.parts) and stop <= self.starts[k + 1]:  # within one shard: a view
                    return self.parts[k][start - self.starts[k]:max(start, stop) - self.starts[k]]
            return self.take(np.arange(start, stop, step))
        index = np.asarray(key)
        if index.dtype == bool:
            if index.shape != (len(self),):
                raise IndexError(f"boolean index of shape {index.shape} for {len(self)} rows")
            index = np.flatnonzero(index)
        return self.take(index)

    def take(self, index) -> np.ndarray:
        """Rows `index` (any shape of ints, negative allowed) gathered from the shards: (*index.shape, *row)."""
        index = np.asarray(index)
        if index.dtype.kind not in "iu":
            raise IndexError(f"arrays used as indices must be of integer type, got {index.dtype}")
        flat = index.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + len(self), flat)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"index out of bounds for axis 0 with size {len(self)}")
        out = np.empty((flat.size, *self.shape[1:]), self.dtype)
        k = np.searchsorted(self.starts, flat, side="right") - 1
        for j in np.unique(k):
            sel = np.flatnonzero(k == j)
            out[sel] = self.parts[j][flat[sel] - self.starts[j]]
        return out.reshape(*index.shape, *self.shape[1:])


def _is_int(key) -> bool:
    return isinstance(key, (int, np.integer)) and not isinstance(key, bool)


def concat(parts: list[np.ndarray]):
    """One array for a split: the memory map itself if it has one shard, else a ShardedArray."""
    return parts[0] if len(parts) == 1 else ShardedArray(parts)


def row_sources(images) -> list[tuple[str, int, int]] | None:
    """(file, byte offset of row 0, rows) of each memory-mapped part of `images`, or None if any part
    is an in-memory array. Lets a reader fetch rows with pread instead of through the map."""
    parts = images.parts if isinstance(images, ShardedArray) else [images]
    if not all(isinstance(p, np.memmap) and p.filename and p.flags.c_contiguous and _whole_file(p) for p in parts):
        return None
    return [(p.filename, int(p.offset), len(p)) for p in parts]


def _whole_file(m: np.memmap) -> bool:
    """Whether `m` maps all rows of its .npy file (a slice of a map keeps its parent's offset: reading
    by offset would return the wrong rows). Decided from the file's header, not its size, so a file
    truncated since it was mapped still counts and its reader reports the short read."""
    try:
        with open(m.filename, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            return f.tell() == m.offset and tuple(shape) == m.shape and dtype == m.dtype and not fortran
    except (OSError, ValueError):
        return False
