"""The evaluate stage: samples + real data + evaluator + model -> metrics.json (headline) and
reports/metrics_detail.json (everything). See docs/METRICS.md.

Reported together, because each alone can be fooled:
- `class_acc`: the evaluator's accuracy on the samples w.r.t. their conditioning label
  (catches broken conditioning, which global FID cannot see);
- `fid`, `precision`, `recall` (and KID, IS in the detail file) in the evaluator's
  standardised feature space, against the real test split; per class in the detail file;
- `floor_fid` (and every other `floor` value in the detail file): the same metrics for real
  train images against the same test split at the same N: the best a perfect generator could
  score here (small-N bias is large on digits);
- `bpd`: test-set bits/dim from the full VLB (IDDPM), on `evaluate.bpd_images` images (the
  bits_per_dim stage computes it: bits_per_dim.py);
- `inception_fid`: paper-comparable Inception metrics, only with a verified local weights file;
- `loss`: the training run's last logged loss (dvclive's metrics.json). Its throughput
  (`images_per_sec`, the last value of dvclive's TSV of it) is in the detail file only, with every
  other last value: a timing differs on every run, and the headline is the same to the last bit on
  a rerun (docs/REPRODUCIBILITY.md).

The headline file stays small, with short keys, because `dvc exp show` makes a column of every
key in it and `--only-changed` must fit a 160-column terminal (docs/EXPERIMENTS.md).
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

import numpy as np

from ..data import load_prepared
from ..files import CheckpointError, atomic_write_texts, read_json
from ..outputs import TIMING
from ..params import Params
from . import bits_per_dim
from .evaluator import load_evaluator
from .metrics import feature_metrics, inception_metrics, real_floor


def read_samples(path: Path, *, num_classes: int, keys=("images", "labels", "seeds"), fix: str,
                 error=CheckpointError) -> dict[str, np.ndarray]:
    """The arrays `keys` of a samples.npz as `write_samples` (and sample-superres) write them, each
    checked: uint8 images (N, C, H, W) with N >= 1; labels, N whole numbers, each a class in
    [0, num_classes), or all -1 (an unconditional model's). Anything else is one line, raised as
    `error`, naming the file and ending with `fix`, not a traceback or metrics of the wrong thing."""
    import zipfile

    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: not found; {fix}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":  # np.load would read it as a pickle, and suggest allow_pickle=True
        raise error(f"{path}: not an .npz archive (a zip of .npy arrays, as `ddpmrepro sample` writes); {fix}")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise error(f"{path}: no {', '.join(missing)} array ({', '.join(z.files) or 'none'} only); {fix}")
            arrays = {k: z[k] for k in keys}
    except error:  # ours, above (a ParamsError is a ValueError too: not to be wrapped again)
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise error(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {fix}") from None
    images, labels = arrays["images"], arrays["labels"]
    if images.dtype != np.uint8 or images.ndim != 4 or not len(images):
        raise error(f"{path}: images are {images.dtype} {list(images.shape)}, not uint8 (N, C, H, W) with N >= 1; {fix}")
    if labels.dtype.kind not in "iu" or labels.shape != (len(images),):
        raise error(f"{path}: labels are {labels.dtype} {list(labels.shape)}, not {len(images)} whole numbers, one "
                    f"per image; {fix}")
    if not ((labels == -1).all() or ((labels >= 0) & (labels < num_classes)).all()):
        bad = labels[(labels < 0) | (labels >= num_classes)]
        raise error(f"{path}: label {int(bad[0])} is not a class of the {num_classes} (nor all -1, an unconditional "
                    f"model's); {fix}")
    return arrays


def load_samples(samples_dir: Path, num_classes: int) -> dict[str, np.ndarray]:
    return read_samples(Path(samples_dir) / "samples.npz", num_classes=num_classes,
                        fix="rerun `dvc repro sample` (or `ddpmrepro sample`)")


# The columns of `dvc exp show`, in this order (docs/METRICS.md says why these).
HEADLINE = ("class_acc", "fid", "floor_fid", "precision", "recall", "bpd", "inception_fid", "loss", "evaluator_acc")


def evaluate(params: Params, samples_dir: Path, data_dir: Path, evaluator_dir: Path, model_dir: Path,
             out: Path, detail_out: Path, live_dir: Path | None = None, table_out: Path | None = None,
             bpd_path: Path | None = None) -> dict:
    """Writes `out` (the headline metrics), `detail_out` (all of them) and, if given, `table_out`
    (both as an HTML table, for Snakemake's report); returns the headline. `live_dir` holds the
    training run's dvclive files (its last logged values are copied). `bpd_path`: the bits_per_dim
    stage's result (the pipeline's way); without it bits/dim is computed here from `model_dir`."""
    p = params.evaluate
    data = load_prepared(data_dir)
    samples = load_samples(samples_dir, data.num_classes)
    evaluator = load_evaluator(evaluator_dir)
    if samples["images"].shape[1:] != data.test_images.shape[1:]:
        raise ValueError(f"samples are {samples['images'].shape[1:]} but the data is {data.test_images.shape[1:]}; "
                         "resample with the model trained on this data")

    # Evaluator-space metrics of the samples against the real test split, and the floor.
    f_gen, logits_gen = evaluator.features_and_logits(samples["images"])
    f_test = evaluator.features(data.test_images)
    f_train, logits_train = evaluator.features_and_logits(data.train_images)
    n = len(f_gen)
    kid_subset = min(1000, n, len(f_test))
    gen = feature_metrics(f_gen, samples["labels"], f_test, data.test_labels, logits_gen=logits_gen,
                          k=p.pr_neighbourhood, kid_subset_size=kid_subset)
    # Samples of an unconditional model carry label -1: no class to be right about, so no accuracy.
    unconditional = bool((samples["labels"] < 0).all())
    if unconditional:
        gen["accuracy"] = None
    floor = real_floor(f_train, data.train_labels, f_test, data.test_labels, n, logits_a=logits_train,
                       k=p.pr_neighbourhood, kid_subset_size=kid_subset)
    floor = {k.removeprefix("floor_"): v for k, v in floor.items()}
    evaluator_metrics = read_json(Path(evaluator_dir) / "metrics.json", "re-run `dvc repro fit-evaluator`")

    # Test bits/dim on a fixed subset (the first images of the test split).
    if bpd_path is not None:
        bpd = bits_per_dim.read(bpd_path, params, len(data.test_images))
    else:
        result = bits_per_dim.bits_per_dim(params, data_dir, model_dir)
        bpd = {"bpd": result["bpd"], "images": result["images"]} if result["images"] else None

    # Paper-comparable Inception metrics, only from a verified local weights file.
    inc = inception_metrics(samples["images"], data.test_images, p.inception_weights or None, p.inception_sha256)
    inception = {k.removeprefix("inception_"): v for k, v in inc.items()}

    # The training run's last logged values. (Not models/ddpm/config.json's `final`: a run that
    # resumes at its last step logs nothing, while dvclive's files come back with the checkpoint.)
    live_metrics = Path(live_dir) / "metrics.json" if live_dir else None
    train = read_json(live_metrics, "re-run `dvc repro train`") if live_metrics and live_metrics.is_file() else {}
    if train and TIMING not in train and (rate := last_throughput(live_dir)) is not None:
        train[TIMING] = rate  # dvclive's metrics.json holds no timing (train_log.py): from its TSV

    headline, detail = layout(gen, floor, _per_class(gen, floor, logits_gen, samples["labels"],
                                                     data.manifest["class_names"]),
                              bpd, inception, evaluator_metrics, train, sampling=load_sampling(samples_dir))
    if unconditional:  # shown as not applicable (null), never as a 0 that reads like broken conditioning
        headline = {"class_acc": None, **headline}  # first, as in HEADLINE
        detail["samples"]["conditional"] = False
    files = {out: json.dumps(headline, indent=2) + "\n", detail_out: json.dumps(detail, indent=2) + "\n"}
    if table_out:
        files[table_out] = metrics_html(headline, detail)
    atomic_write_texts(files)  # all three or none: never a new headline beside an old detail
    return headline


def last_throughput(live_dir: Path) -> float | None:
    """The training's last logged images/s, from dvclive's TSV of it (git's; its metrics.json, a DVC
    cached out, holds no timing: training/train_log.py); None if never logged."""
    path = Path(live_dir) / "plots" / "metrics" / f"{TIMING}.tsv"
    try:
        header, *rows = path.read_text().splitlines()
        return float(rows[-1].split("\t")[header.split("\t").index(TIMING)]) if rows else None
    except (OSError, ValueError, IndexError):
        return None


def load_sampling(samples_dir: Path) -> dict | None:
    """The sample stage's sampling.json (sampler, network calls per image, guidance), or None for
    samples written before it existed."""
    path = Path(samples_dir) / "sampling.json"
    return read_json(path, "rerun `dvc repro sample`") if path.is_file() else None


def layout(gen: dict, floor: dict, per_class: dict, bpd: dict | None, inception: dict, evaluator: dict,
           train: dict, sampling: dict | None = None) -> tuple[dict, dict]:
    """(headline, detail): the few numbers `dvc exp show` makes columns of, and everything.

    gen, floor: `feature_metrics` of the samples and of the real floor (keys without `floor_`);
    bpd: {"bpd", "images"} or None; inception: `inception_metrics` without the prefix; evaluator:
    the evaluator's own metrics.json; train: dvclive's last logged values; sampling: the sample
    stage's sampler and network calls (detail only: `dvc exp show` already has sample.* as params
    columns, and the headline stays at nine numbers). A headline key without
    a value (no bits/dim, no Inception weights) is left out rather than shown as a column of nulls.
    """
    detail = {"samples": _without_per_class(gen), "floor": _without_per_class(floor), "per_class": per_class,
              "bpd": bpd, "inception": inception, "evaluator": evaluator, "train": train,
              "sampling": sampling}
    values = {
        "class_acc": gen.get("accuracy"), "fid": gen["fid"], "floor_fid": floor["fid"],
        "precision": gen["precision"], "recall": gen["recall"], "bpd": bpd["bpd"] if bpd else None,
        "inception_fid": inception.get("fid"), "loss": train.get("loss"),
        "evaluator_acc": evaluator.get("test_accuracy"),
    }
    headline = {k: _clean(values[k]) for k in HEADLINE if values[k] is not None}
    return headline, _clean(detail)


def _without_per_class(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("fid_class_")}


MEANING = {
    "class_acc": "samples classified as the class they were conditioned on",
    "fid": "Fréchet distance to the real test split (evaluator features)",
    "floor_fid": "the same for real training images: the best reachable at this N",
    "precision": "samples inside the real data's k-NN manifold (fidelity)",
    "recall": "real images inside the samples' k-NN manifold (coverage)",
    "bpd": "test bits/dim, full variational bound",
    "inception_fid": "FID with the TF-ported Inception network (paper-comparable)",
    "loss": "training loss, last logging interval",
    "evaluator_acc": "the evaluator's own accuracy on the real test split",
}
FLOOR_OF = {"class_acc": "accuracy", "fid": "fid", "precision": "precision", "recall": "recall"}


def metrics_html(headline: dict, detail: dict) -> str:
    """A self-contained HTML page: the headline with its floor values, then the per-class values."""
    def num(v) -> str:
        return "–" if v is None else f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))

    rows = "".join(f"<tr><td><code>{k}</code></td><td>{num(v)}</td>"
                   f"<td>{num(detail['floor'].get(FLOOR_OF[k])) if k in FLOOR_OF else ''}</td>"
                   f"<td>{html.escape(MEANING[k])}</td></tr>" for k, v in headline.items())
    per_class = "".join(f"<tr><td>{html.escape(name)}</td><td>{c['n']}</td><td>{num(c['accuracy'])}</td>"
                        f"<td>{num(c['fid'])}</td><td>{num(c['floor_fid'])}</td></tr>"
                        for name, c in detail["per_class"].items())
    style = ("body{font-family:sans-serif;margin:1em} table{border-collapse:collapse;margin-bottom:1.5em}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} td:first-child,td:last-child{text-align:left}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>metrics</title><style>{style}</style></head><body>\n"
            f"<h3>Headline (metrics.json)</h3>\n<table><tr><th>metric</th><th>value</th><th>real-vs-real floor</th>"
            f"<th>meaning</th></tr>{rows}</table>\n"
            f"<h3>Per class ({detail['samples']['n_gen']} samples)</h3>\n<table><tr><th>class</th><th>samples</th>"
            f"<th>accuracy</th><th>FID</th><th>floor FID</th></tr>{per_class}</table>\n"
            "<p>All values: reports/metrics_detail.json; what they mean: docs/METRICS.md.</p></body></html>\n")


def _per_class(gen: dict, floor: dict, logits_gen: np.ndarray, labels: np.ndarray, class_names: list) -> dict:
    """{class name: FID, floor FID, accuracy and count of the samples conditioned on it}."""
    pred = np.asarray(logits_gen).argmax(1)
    out = {}
    for c, name in enumerate(class_names):
        mine = labels == c
        out[str(name)] = {"fid": gen.get(f"fid_class_{c}"), "floor_fid": floor.get(f"fid_class_{c}"),
                          "accuracy": float((pred[mine] == c).mean()) if mine.any() else None,
                          "n": int(mine.sum())}
    return out


def _clean(v):
    """JSON-friendly, recursively: numpy scalars to Python, non-finite numbers to null."""
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
