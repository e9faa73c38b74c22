"""Prepared format v2: shards written as a stream, read back as one array, whatever the shard size
or the number of decode workers."""
from __future__ import annotations

import hashlib
import json
import shutil
import types

import numpy as np
import pytest
from click.testing import CliRunner

from ddpmrepro.data import DataError, ShardedArray, image_folder, load_prepared, prepare, shards, sources
from ddpmrepro.params import DataParams
from fake_datasets import fake_image_folder


def files(d) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


# --- ShardedArray against the concatenated array ----------------------------------------------------


def test_sharded_array_indexes_like_the_concatenated_array():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, (n, 2, 3), dtype=np.uint8) for n in (3, 1, 5, 4)]
    a, ref = ShardedArray(parts), np.concatenate(parts)
    assert len(a) == 13 and a.shape == ref.shape and a.dtype == ref.dtype and a.ndim == 3
    keys = [0, 3, 4, 12, -1, -13, np.int64(8), slice(None), slice(2, 9), slice(4, 9), slice(3, 4), slice(9, 2),
            slice(None, None, 3), slice(11, 1, -2), slice(-3, None), [5, 0, 12, 5], np.array([[1, 2], [11, 3]]),
            np.array([], np.int64), ref[:, 0, 0] > 128, (slice(None), 0), (2, 1), (2, 1, 2), ([4, 0], 1),
            (slice(2, 6), slice(None), 1)]
    for key in keys:
        assert np.array_equal(a[key], ref[key]), key
    assert np.array_equal(np.asarray(a), ref) and np.array_equal(np.concatenate([a, a]), np.concatenate([ref, ref]))
    assert all(np.array_equal(x, y) for x, y in zip(a, ref)) and len(list(a)) == 13
    assert np.shares_memory(a[4:9], parts[2])  # within one shard: a view, nothing read
    for bad in (13, -14, [0, 13], slice(None, None, 0)):
        with pytest.raises((IndexError, ValueError)):
            a[bad]
    with pytest.raises(IndexError):
        a[np.array([0.5])]


def test_a_single_shard_split_is_a_plain_memory_map(tmp_path):
    prepare(DataParams(), tmp_path / "p")
    d = load_prepared(tmp_path / "p")
    assert isinstance(d.train_images, np.memmap) and not isinstance(d.train_labels, np.memmap)
    d.train_images[0, 0, 0, 0] ^= 255  # copy-on-write: the file (and DVC's cache behind it) never changes
    assert not np.array_equal(load_prepared(tmp_path / "p").train_images[0], d.train_images[0])


# --- writing: shard size and worker count change nothing but the layout -------------------------------


def test_many_small_shards_hold_exactly_the_one_shard_arrays(tmp_path, monkeypatch):
    one = prepare(DataParams(image_size=12, channels=3), tmp_path / "one")
    monkeypatch.setattr(shards, "SHARD_BYTES", 3 * 12 * 12 * 100)  # 100 images per shard
    many = prepare(DataParams(image_size=12, channels=3), tmp_path / "many")
    assert [len(many["splits"][s]["shards"]) for s in ("train", "test")] == [15, 4]
    assert [s["count"] for s in many["splits"]["train"]["shards"]] == [100] * 14 + [38]
    assert many["shard_size"] == 100 and one["shard_size"] == (128 << 20) // 432
    a, b = load_prepared(tmp_path / "one"), load_prepared(tmp_path / "many")
    assert isinstance(b.train_images, ShardedArray) and len(b.train_images.parts) == 15
    for name in ("train_images", "train_labels", "test_images", "test_labels"):
        assert np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name))), name
    assert one["counts"] == many["counts"] and one["inputs"] == many["inputs"]
    # The manifest's checksums are those of the files, and each split's digest is over its shards in order.
    for name, sha in many["files"].items():
        assert sha == hashlib.sha256((tmp_path / "many" / name).read_bytes()).hexdigest()
    entry = many["splits"]["test"]
    lines = "".join(f"{s[k]}\0{many['files'][s[k]]}\n" for s in entry["shards"] for k in ("images", "labels"))
    assert entry["sha256"] == hashlib.sha256(lines.encode()).hexdigest()


def test_decode_workers_never_change_a_byte(tmp_path, monkeypatch):
    fake_image_folder(tmp_path / "raw", classes=("b", "a", "c"), per_class=40, size=(13, 9), fmt="PNG")
    fake_image_folder(tmp_path / "raw" / "a" / "nested", classes=("x",), per_class=3, size=(9, 9), fmt="JPEG", seed=2)
    monkeypatch.setattr(sources, "CHUNK_IMAGES", 7)  # 18 decode tasks
    monkeypatch.setattr(shards, "SHARD_BYTES", 3 * 8 * 8 * 25)
    pools = []
    real = image_folder._start_method
    monkeypatch.setattr(image_folder, "_start_method", lambda: pools.append(1) or real())
    params = DataParams(source="image_folder", root=str(tmp_path / "raw"), image_size=8, channels=3)
    outputs = {}
    for workers in (1, 2, 3):
        m = prepare(params, tmp_path / f"w{workers}", workers=workers)
        outputs[workers] = files(tmp_path / f"w{workers}")
    assert len(pools) == 2  # 2 and 3 workers ran in a process pool, 1 in this process
    assert outputs[1] == outputs[2] == outputs[3]
    assert m["counts"] == {"train": [34, 32, 32], "test": [9, 8, 8]} and m["inputs"]["num_files"] == 123
    # Files in path order (nested ones too), each where a direct decode puts it.
    d = load_prepared(tmp_path / "w3")
    images = np.concatenate([np.asarray(d.train_images), np.asarray(d.test_images)])
    path = tmp_path / "raw" / "a" / "nested" / "x" / "001.jpg"
    ref = image_folder.decode_image(path.read_bytes(), path, 8, 3)
    assert sum(np.array_equal(x, ref) for x in images) == 1


def test_a_worker_error_is_one_line_and_leaves_the_old_output(tmp_path, monkeypatch):
    fake_image_folder(tmp_path / "raw", classes=("a", "b"), per_class=30, size=(8, 8))
    monkeypatch.setattr(sources, "CHUNK_IMAGES", 4)
    params = DataParams(source="image_folder", root=str(tmp_path / "raw"), image_size=8, channels=3)
    prepare(params, tmp_path / "out")
    before = files(tmp_path / "out")
    (tmp_path / "raw" / "b" / "017.png").write_bytes(b"GIF89a but not really")
    with pytest.raises(DataError, match=r"raw/b/017\.png: cannot be read as an image|raw/b/017\.png: not an image"):
        prepare(params, tmp_path / "out", workers=2)
    assert files(tmp_path / "out") == before and sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"]


def test_not_enough_disk_space_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000))
    with pytest.raises(DataError, match=r"p: no space left on the device for the prepared data \(it needs 0\.2 MiB, "
                                          r"0\.0 MiB is free\)"):
        prepare(DataParams(), tmp_path / "p")
    assert not (tmp_path / "p").exists() and list(tmp_path.iterdir()) == []


# --- readers of the prepared data ----------------------------------------------------------------------


def test_the_evaluator_fits_the_same_on_many_shards(tmp_path, monkeypatch):
    """fit-evaluator and its features read a ShardedArray split exactly as a single memory map."""
    from ddpmrepro.cli import main
    from ddpmrepro.evaluation.evaluator import load_evaluator

    prepare(DataParams(), tmp_path / "one")
    monkeypatch.setattr(shards, "SHARD_BYTES", 64 * 300)
    prepare(DataParams(), tmp_path / "many")
    (tmp_path / "params.yaml").write_text("evaluator:\n  epochs: 1\n")
    for name in ("one", "many"):
        result = CliRunner().invoke(main, ["fit-evaluator", "--params", str(tmp_path / "params.yaml"),
                                           "--data", str(tmp_path / name), "--out", str(tmp_path / f"ev-{name}")])
        assert result.exit_code == 0, result.output
    assert files(tmp_path / "ev-one") == files(tmp_path / "ev-many")
    ev = load_evaluator(tmp_path / "ev-one")
    a, b = load_prepared(tmp_path / "one"), load_prepared(tmp_path / "many")
    assert isinstance(b.test_images, ShardedArray)
    assert np.array_equal(ev.features(a.test_images), ev.features(b.test_images))
    assert json.loads((tmp_path / "many" / "manifest.json").read_text())["splits"]["train"]["count"] == 1438


def test_a_class_folder_that_changes_during_prepare_is_refused(tmp_path):
    """Names are listed again, class by class, when decoded: a folder that changed in between is refused."""
    fake_image_folder(tmp_path / "raw", classes=("a", "b"), per_class=3, size=(8, 8))
    files = image_folder.FolderFiles(tmp_path / "raw")
    files.add_classes("", ["a", "b"])
    assert files.labels().tolist() == [0, 0, 0, 1, 1, 1] and files.labels().dtype == np.uint8
    assert files.rel_paths(1, 3) == ["a/001.png", "a/002.png"]
    shutil.copy(tmp_path / "raw" / "b" / "000.png", tmp_path / "raw" / "b" / "003.png")
    with pytest.raises(DataError, match=r"raw/b: changed while it was being prepared \(3 images, now 4\)"):
        files.rel_paths(3, 6)
