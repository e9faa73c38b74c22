"""The evaluator classifier: accuracy on digits, determinism, safetensors round trip, clear errors."""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ddpmrepro.evaluation.evaluator import EvaluatorError, fit_evaluator, load_evaluator
from ddpmrepro.params import EvaluatorParams

CLASS_NAMES = [str(i) for i in range(10)]


pytestmark = pytest.mark.usefixtures("one_thread")


def digits_split():
    """sklearn digits as prepared uint8 (N, 1, 8, 8) arrays, stratified 20% test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = np.rint(d.images * 255 / 16).astype(np.uint8)[:, None]  # (N, 1, 8, 8)
    y = d.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    xtr, xte, ytr, yte = digits_split()
    out = tmp_path_factory.mktemp("ev") / "evaluator"
    t0 = time.perf_counter()
    metrics = fit_evaluator(xtr, ytr, xte, yte, EvaluatorParams(), out, num_classes=10, class_names=CLASS_NAMES,
                            num_threads=1)  # robust on a shared CPU; see fit_evaluator
    seconds = time.perf_counter() - t0
    print(f"\nevaluator on digits: {metrics}, fit {seconds:.1f} s")
    return {"dir": out, "metrics": metrics, "seconds": seconds, "data": (xtr, xte, ytr, yte)}


def test_reaches_acceptance_accuracy_on_digits(fitted):
    assert fitted["metrics"]["test_accuracy"] >= 0.97
    assert fitted["metrics"]["train_accuracy"] >= 0.97
    assert fitted["seconds"] < 120  # ~6 s on an idle 2-core machine; generous for loaded CI


def test_writes_the_documented_files(fitted):
    d = fitted["dir"]
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "metrics.json", "model.safetensors"]
    assert json.loads((d / "metrics.json").read_text()) == fitted["metrics"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_classes"] == 10 and cfg["class_names"] == CLASS_NAMES
    assert cfg["image_shape"] == [1, 8, 8] and cfg["architecture"]["in_channels"] == 1
    assert cfg["normalisation"] == {"mean": 127.5, "std": 127.5}
    assert cfg["params"] == {"seed": 0, "epochs": 30, "lr": 1e-3, "batch_size": 128}
    # No temp or backup folders left beside the output.
    assert [p.name for p in d.parent.iterdir()] == ["evaluator"]


def test_loaded_model_is_the_trained_one(fitted):
    """Accuracy recomputed from the loaded file equals what fit_evaluator measured in memory."""
    xtr, xte, ytr, yte = fitted["data"]
    ev = load_evaluator(fitted["dir"])
    assert float((ev.predict(xte) == yte).mean()) == fitted["metrics"]["test_accuracy"]
    f, logits = ev.features(xte), ev.logits(xte)
    assert f.dtype == np.float64 and f.shape == (len(xte), ev.feature_dim)
    assert logits.dtype == np.float64 and logits.shape == (len(xte), 10)
    # Batch size does not change the outputs (BatchNorm runs on stored statistics in eval mode).
    np.testing.assert_allclose(ev.logits(xte, batch_size=7), logits, rtol=0, atol=1e-5)


def test_logits_match_a_direct_forward_pass(fitted):
    """Independent path: raw safetensors weights into a fresh net, normalisation written out by hand."""
    from ddpmrepro.evaluation.evaluator import EvaluatorNet

    _, xte, _, _ = fitted["data"]
    cfg = json.loads((fitted["dir"] / "config.json").read_text())
    net = EvaluatorNet(1, 10, tuple(cfg["architecture"]["widths"])).eval()
    net.load_state_dict(load_file(fitted["dir"] / "model.safetensors"))
    with torch.no_grad():
        _, logits = net(torch.from_numpy(xte).float() / 127.5 - 1.0)
    # (x - 127.5) / 127.5 and x / 127.5 - 1 round differently in float32: equal to ~1e-6.
    np.testing.assert_allclose(load_evaluator(fitted["dir"]).logits(xte), logits.double().numpy(), rtol=0, atol=1e-4)


def test_safetensors_round_trip_gives_identical_logits(fitted, tmp_path):
    _, xte, _, _ = fitted["data"]
    ev = load_evaluator(fitted["dir"])
    copy = tmp_path / "copy"
    copy.mkdir()
    save_file({k: v.contiguous() for k, v in ev.net.state_dict().items()}, copy / "model.safetensors")
    cfg = json.loads((fitted["dir"] / "config.json").read_text())
    cfg["model_sha256"] = hashlib.sha256((copy / "model.safetensors").read_bytes()).hexdigest()  # new bytes
    (copy / "config.json").write_text(json.dumps(cfg))
    np.testing.assert_array_equal(load_evaluator(copy).logits(xte), ev.logits(xte))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing", "flip_byte"])
def test_corrupt_model_file_gives_clear_error(fitted, tmp_path, damage):
    d = tmp_path / "ev"
    shutil.copytree(fitted["dir"], d)
    model = d / "model.safetensors"
    blob = model.read_bytes()
    if damage == "truncate":
        model.write_bytes(blob[: len(blob) // 2])
    elif damage == "garbage":
        model.write_bytes(b"not a safetensors file")
    elif damage == "missing":
        model.unlink()
    else:  # a flipped bit in the tensor data still parses; only the checksum sees it
        model.write_bytes(blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:])
    with pytest.raises(EvaluatorError, match="model.safetensors.*fit-evaluator"):
        load_evaluator(d)


def test_no_checksum_an_unreadable_file_with_its_checksum_and_wrong_shapes(fitted, tmp_path):
    d = tmp_path / "ev"
    shutil.copytree(fitted["dir"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("model_sha256")  # every evaluator is written with it: without it nothing would check the weights
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EvaluatorError, match=r"config.json: no model_sha256, so the weights cannot be checked; "
                                             r"re-run `ddpmrepro fit-evaluator`"):
        load_evaluator(d)

    bad = b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json"
    (d / "model.safetensors").write_bytes(bad)
    cfg["model_sha256"] = hashlib.sha256(bad).hexdigest()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EvaluatorError, match="not a readable safetensors file"):
        load_evaluator(d)

    shutil.copy(fitted["dir"] / "model.safetensors", d / "model.safetensors")
    cfg["model_sha256"] = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    cfg["architecture"]["widths"] = [16, 32, 64]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EvaluatorError, match="do not fit config.json"):
        load_evaluator(d)

    (d / "config.json").write_text("{")
    with pytest.raises(EvaluatorError, match="config.json"):
        load_evaluator(d)


def test_rejects_wrong_inputs(fitted):
    ev = load_evaluator(fitted["dir"])
    with pytest.raises(ValueError, match="uint8"):
        ev.features(np.zeros((2, 1, 8, 8), np.float32))
    with pytest.raises(ValueError, match="uint8"):
        ev.features(np.zeros((2, 1, 16, 16), np.uint8))
    xtr, xte, ytr, yte = fitted["data"]
    with pytest.raises(ValueError, match="labels"):
        fit_evaluator(xtr, ytr + 5, xte, yte, EvaluatorParams(epochs=1), Path("/nonexistent/x"),
                      num_classes=10, class_names=CLASS_NAMES)


def test_fit_is_deterministic_and_replaces_old_output(tmp_path):
    xtr, xte, ytr, yte = digits_split()
    xtr, ytr = xtr[:300], ytr[:300]
    p = EvaluatorParams(epochs=1, seed=3)
    a, b = tmp_path / "a", tmp_path / "b"
    b.mkdir()
    for name in ("config.json", "metrics.json", "model.safetensors", "stale.txt"):  # an earlier evaluator's
        (b / name).write_text("from an earlier run")
    ma = fit_evaluator(xtr, ytr, xte, yte, p, a, num_classes=10, class_names=CLASS_NAMES)
    mb = fit_evaluator(xtr, ytr, xte, yte, p, b, num_classes=10, class_names=CLASS_NAMES)
    assert ma == mb
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert not (b / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    # The global RNG is neither used nor disturbed by the fit.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fit_evaluator(xtr, ytr, xte, yte, p, tmp_path / "c", num_classes=10, class_names=CLASS_NAMES)
    assert torch.equal(torch.rand(3), expected)
