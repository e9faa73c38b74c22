"""The evaluate stage's output layout: a small headline (the `dvc exp show` columns) and every
detail beside it. The metric values themselves are tested in test_metrics.py; end to end in
test_pipeline.py."""
from __future__ import annotations

import html
import math

import numpy as np
import pytest

from ddpmrepro.evaluation.evaluate import HEADLINE, _per_class, layout, metrics_html
from ddpmrepro.evaluation.metrics import feature_metrics, real_floor


def _inputs(inception: dict | None = None, bpd: dict | None = None):
    rng = np.random.default_rng(0)
    f_gen, f_real = rng.normal(size=(40, 6)), rng.normal(size=(60, 6))
    y_gen, y_real = np.repeat(np.arange(4), 10), np.repeat(np.arange(4), 15)
    logits = rng.normal(size=(40, 4))
    logits[np.arange(40), y_gen] += 2.0  # mostly right
    gen = feature_metrics(f_gen, y_gen, f_real, y_real, logits_gen=logits, kid_subset_size=20)
    floor = {k.removeprefix("floor_"): v for k, v in
             real_floor(f_real, y_real, f_real, y_real, 40, logits_a=np.eye(4)[y_real] * 5, kid_subset_size=20).items()}
    per_class = _per_class(gen, floor, logits, y_gen, ["zero", "one", "two", "three"])
    train = {"loss": 0.25, "images_per_sec": 600.0, "step": 1500, "loss_q0": 0.4}
    return gen, floor, per_class, bpd, inception or {"status": "skipped: no weights"}, {"test_accuracy": 0.99}, train, logits, y_gen


def test_headline_is_the_few_decision_numbers_in_order_and_leaves_out_what_was_not_computed():
    gen, floor, per_class, bpd, inception, evaluator, train, *_ = _inputs()
    headline, detail = layout(gen, floor, per_class, bpd, inception, evaluator, train)
    assert list(headline) == ["class_acc", "fid", "floor_fid", "precision", "recall", "loss",
                              "evaluator_acc"]  # no bpd, no inception: not computed
    assert headline["class_acc"] == gen["accuracy"] and headline["floor_fid"] == floor["fid"]
    # The throughput is a timing: in the detail file (with every last logged value), never in the
    # headline, which a rerun reproduces to the last bit.
    assert headline["loss"] == 0.25 and detail["train"]["images_per_sec"] == 600.0
    assert not [k for k in headline if "per_sec" in k]
    headline, _ = layout(gen, floor, per_class, {"bpd": 3.5, "images": 8}, {"status": "ok", "fid": 12.5},
                         evaluator, train)
    assert list(headline) == [k for k in HEADLINE] and headline["bpd"] == 3.5 and headline["inception_fid"] == 12.5


def test_detail_holds_everything_and_per_class_agrees_with_the_global_numbers():
    gen, floor, per_class, bpd, inception, evaluator, train, logits, y = _inputs()
    headline, detail = layout(gen, floor, per_class, bpd, inception, evaluator, train)
    assert set(detail) == {"samples", "floor", "per_class", "bpd", "inception", "evaluator", "train", "sampling"}
    assert detail["sampling"] is None  # samples without sampling.json
    sampling = {"sampler": "unipc", "nfe": 10, "guidance": 0.5}
    assert layout(gen, floor, per_class, bpd, inception, evaluator, train, sampling)[1]["sampling"] == sampling
    assert not any(k.startswith("fid_class_") for k in detail["samples"]) and "kid_std" in detail["samples"]
    assert detail["train"] == train and detail["inception"] == inception
    assert list(detail["per_class"]) == ["zero", "one", "two", "three"]
    # per-class accuracy, weighted by count, is the global class accuracy (a second computation)
    acc = sum(c["accuracy"] * c["n"] for c in detail["per_class"].values()) / len(y)
    assert math.isclose(acc, headline["class_acc"]) and acc == float((logits.argmax(1) == y).mean())
    assert [c["fid"] for c in detail["per_class"].values()] == [gen[f"fid_class_{i}"] for i in range(4)]


def test_non_finite_values_become_null_and_numpy_scalars_plain_numbers():
    gen, floor, per_class, bpd, inception, evaluator, train, *_ = _inputs()
    gen = {**gen, "kid": np.float64("nan"), "n_gen": np.int64(40)}
    _, detail = layout(gen, floor, per_class, bpd, inception, evaluator, train)
    assert detail["samples"]["kid"] is None and type(detail["samples"]["n_gen"]) is int


def test_the_html_table_shows_each_headline_value_with_its_floor_and_each_class():
    gen, floor, per_class, bpd, inception, evaluator, train, *_ = _inputs()
    headline, detail = layout(gen, floor, per_class, {"bpd": 3.5, "images": 8}, inception, evaluator, train)
    page = metrics_html(headline, detail)
    for key, value in headline.items():
        assert f"<td><code>{key}</code></td><td>{value:.4g}</td>" in page
    assert f"<td>{floor['recall']:.4g}</td>" in page
    for name in ("zero", "one", "two", "three"):
        assert f"<tr><td>{html.escape(name)}</td><td>10</td>" in page


def test_a_damaged_json_of_another_stage_is_one_line_naming_it(tmp_path):
    """The evaluator's and dvclive's metrics.json, sampling.json: invalid JSON was
    "Error: Expecting property name enclosed in double quotes", naming no file."""
    from ddpmrepro.files import read_json
    from ddpmrepro.files import CheckpointError

    path = tmp_path / "metrics.json"
    for text, words in (("{'a': 1}", "not valid JSON (Expecting property name enclosed in double quotes"),
                        ("[1]", "a JSON list, not an object"), (b"\xff", "not valid JSON ('utf-8' codec")):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(CheckpointError) as e:
            read_json(path, "re-run it")
        assert str(e.value).startswith(f"{path}: ") and words in str(e.value) and str(e.value).endswith("; re-run it")
    path.write_text('{"a": 1}')
    assert read_json(path, "") == {"a": 1}
