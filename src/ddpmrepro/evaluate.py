"""The evaluate stage: samples + real data + evaluator + model -> metrics.json.

Reported together, because each alone can be fooled (see docs/METRICS.md):
- `class_accuracy`: the evaluator's accuracy on the samples w.r.t. their conditioning label
  (catches broken conditioning, which global FID cannot see);
- `fid`, `kid`, `precision`, `recall`, `is` in the evaluator's standardised feature space,
  against the real test split, plus `fid_per_class_mean` / `fid_class_<c>`;
- `floor_*`: the same metrics for real train images against the same test split at the same
  N: the best a perfect generator could score here (small-N bias is large on digits);
- `bpd`: test-set bits/dim from the full VLB (IDDPM), on `evaluate.bpd_images` images;
- `inception_*`: paper-comparable Inception metrics only with a verified local weights file.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from .checkpoint import CheckpointError, atomic_write_text
from .data import load_prepared, to_model_range
from .diffusion import from_params as diffusion_from_params
from .evaluator import load_evaluator
from .metrics import feature_metrics, inception_metrics, real_floor
from .params import Params
from .sample import load_model


def load_samples(samples_dir: Path) -> dict[str, np.ndarray]:
    path = Path(samples_dir) / "samples.npz"
    if not path.exists():
        raise CheckpointError(f"{path}: not found; run `dvc repro sample` first")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in ("images", "labels", "seeds")}
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}); rerun `dvc repro sample`") from None


@torch.no_grad()
def test_bits_per_dim(params: Params, model_dir: Path, images: np.ndarray, labels: np.ndarray) -> float:
    """Mean bits/dim of the test images under the trained model (full VLB + prior)."""
    model, trained, _ = load_model(model_dir, params.sample.ema_rate)
    diffusion = diffusion_from_params(trained.diffusion)
    x0 = to_model_range(images)
    y = torch.as_tensor(labels, dtype=torch.long)
    # Score several timesteps per model call (~256 rows): one call per timestep at a small
    # batch is dominated by per-call overhead on CPU.
    total, batch = [], 64
    for start in range(0, len(x0), batch):
        xb, yb = x0[start:start + batch], y[start:start + batch]
        k = max(1, 256 // len(xb))
        gens = [torch.Generator().manual_seed(start + i) for i in range(len(xb))]
        out = diffusion.bits_per_dim(lambda x, t, yk=yb.repeat(k): model(x, t, yk), xb, generators=gens,
                                     timesteps_per_call=k)
        total.append(out["total_bpd"])
    return float(torch.cat(total).mean())


def evaluate(params: Params, samples_dir: Path, data_dir: Path, evaluator_dir: Path, model_dir: Path,
             out: Path) -> dict:
    p = params.evaluate
    samples = load_samples(samples_dir)
    data = load_prepared(data_dir)
    evaluator = load_evaluator(evaluator_dir)
    if samples["images"].shape[1:] != data.test_images.shape[1:]:
        raise ValueError(f"samples are {samples['images'].shape[1:]} but the data is {data.test_images.shape[1:]}; "
                         "resample with the model trained on this data")

    # Evaluator-space metrics of the samples against the real test split, and the floor.
    f_gen, logits_gen = evaluator.features_and_logits(samples["images"])
    f_test = evaluator.features(data.test_images)
    f_train, logits_train = evaluator.features_and_logits(data.train_images)
    n = len(f_gen)
    metrics = feature_metrics(f_gen, samples["labels"], f_test, data.test_labels, logits_gen=logits_gen,
                              k=p.pr_neighbourhood, kid_subset_size=min(1000, n, len(f_test)))
    metrics["class_accuracy"] = metrics.pop("accuracy")
    metrics.update(real_floor(f_train, data.train_labels, f_test, data.test_labels, n, logits_a=logits_train,
                              k=p.pr_neighbourhood, kid_subset_size=min(1000, n, len(f_test))))
    eval_metrics = json.loads((Path(evaluator_dir) / "metrics.json").read_text())
    metrics["evaluator_test_accuracy"] = eval_metrics["test_accuracy"]

    # Test bits/dim on a fixed subset (the first images of the test split).
    if p.bpd_images:
        k = min(p.bpd_images, len(data.test_images))
        metrics["bpd"] = test_bits_per_dim(params, model_dir, data.test_images[:k], data.test_labels[:k])

    # Paper-comparable Inception metrics, only from a verified local weights file.
    inc = inception_metrics(samples["images"], data.test_images, p.inception_weights or None, p.inception_sha256)
    metrics.update({(k if k.startswith("inception") else f"inception_{k}"): v for k, v in inc.items()})

    metrics = {k: _clean(v) for k, v in metrics.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(metrics, indent=2) + "\n")
    return metrics


def _clean(v):
    """JSON-friendly: numpy scalars to Python, non-finite numbers to null."""
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
