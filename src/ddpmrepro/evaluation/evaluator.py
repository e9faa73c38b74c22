"""The evaluation classifier: a small CNN trained on the real training split.

Its penultimate layer is the feature space for FID/KID/precision/recall (see `metrics.py`) and
its logits give conditional accuracy and an inception-style score. Numbers in this space are
only comparable between runs that use the same frozen evaluator (same `model.safetensors`).

Layout of an evaluator folder (written atomically by `fit_evaluator`):
  model.safetensors   the weights
  config.json         architecture kwargs, num_classes, image shape, class names,
                      input normalisation, sha256 of model.safetensors, training params
  metrics.json        {"test_accuracy": ..., "train_accuracy": ...}
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

from .. import files, outputs
from ..params import EvaluatorParams

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# The model sees (x - mean) / std of the uint8 pixels, i.e. [-1, 1] as in the data contract.
NORMALISATION = {"mean": 127.5, "std": 127.5}
DEFAULT_WIDTHS = (32, 64, 128)


class EvaluatorError(ValueError):
    """A missing, corrupt or mismatched evaluator; the message is one line naming the file and the fix."""


# --- network ----------------------------------------------------------------------------------


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.SiLU())


class EvaluatorNet(nn.Module):
    """Conv-BN-SiLU stages (two convs each, 2x average-pool between stages), global average pool.

    Works for any channel count and any image size >= 8 (three stages take 8x8 to 2x2).
    `features` is the pooled output of the last stage: (B, widths[-1]).

    Why BatchNorm and not GroupNorm: a per-sample normalisation maps out-of-distribution inputs
    (e.g. uniform noise) into the middle of the real feature cloud, where k-NN recall cannot see
    them (digits, noise vs real test split: recall 0.67 with GroupNorm, 0.13 with BatchNorm).
    In eval mode BatchNorm is a fixed affine map, so abnormal inputs stay abnormal.
    """

    def __init__(self, in_channels: int, num_classes: int, widths: tuple[int, ...] = DEFAULT_WIDTHS):
        super().__init__()
        stages, c = [], in_channels
        for i, w in enumerate(widths):
            pool = [nn.AvgPool2d(2, ceil_mode=True)] if i > 0 else []
            stages.append(nn.Sequential(*pool, _block(c, w), _block(w, w)))
            c = w
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(x).mean(dim=(2, 3))  # (B, C, H, W) -> (B, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.forward_features(x)
        return f, self.head(f)


def _init_weights(net: nn.Module, generator: torch.Generator) -> None:
    """Kaiming-uniform init drawn from `generator`, so the init never touches the global RNG."""
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=generator)
            bound = 1.0 / math.sqrt(m.weight[0].numel())
            nn.init.uniform_(m.bias, -bound, bound, generator=generator)


def _to_input(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(images)
    return (x.float() - NORMALISATION["mean"]) / NORMALISATION["std"]


def _random_shift(x: torch.Tensor, generator: torch.Generator, max_shift: int = 1) -> torch.Tensor:
    """Shifts each image by up to `max_shift` pixels in x and y (edge pixels replicated)."""
    s = max_shift
    n, _, h, w = x.shape
    padded = F.pad(x, (s, s, s, s), mode="replicate")
    dy, dx = torch.randint(0, 2 * s + 1, (2, n), generator=generator)
    out = torch.empty_like(x)
    for oy in range(2 * s + 1):
        for ox in range(2 * s + 1):
            idx = ((dy == oy) & (dx == ox)).nonzero().squeeze(1)
            out[idx] = padded[idx, :, oy : oy + h, ox : ox + w]
    return out


# --- training ---------------------------------------------------------------------------------


def _check_images(images, labels, num_classes: int, name: str) -> None:
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"{name}_images: expected a uint8 array (N, C, H, W)")
    if images.shape[1] not in (1, 3) or min(images.shape[2:]) < 8:
        raise ValueError(f"{name}_images: expected 1 or 3 channels and images of at least 8x8, got {images.shape}")
    if labels.shape != (len(images),) or (len(labels) and (labels.min() < 0 or labels.max() >= num_classes)):
        raise ValueError(f"{name}_labels: expected ({len(images)},) ints in [0, {num_classes})")


@torch.inference_mode()
def _accuracy(net: EvaluatorNet, images: np.ndarray, labels: np.ndarray, batch_size: int = 1024) -> float:
    if len(images) == 0:
        return float("nan")
    preds = [net(_to_input(images[i : i + batch_size]))[1].argmax(1) for i in range(0, len(images), batch_size)]
    return float((torch.cat(preds).numpy() == labels).mean())


def fit_evaluator(
    train_images: np.ndarray,
    train_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    params: EvaluatorParams,
    out_dir: Path,
    *,
    num_classes: int,
    class_names: list[str],
    num_threads: int | None = None,
) -> dict:
    """Trains the evaluator on the training split and writes it to `out_dir` atomically.

    Deterministic for a given `params.seed`: init, shuffling and augmentation all draw from one
    seeded `torch.Generator`. Returns (and writes to metrics.json) the train and test accuracy.

    `num_threads` caps torch's intra-op threads for the duration of the fit (restored after).
    On a busy 2-core machine, 2 spinning OpenMP threads made the digits fit 15x slower than 1
    thread (220 s vs 14.5 s); on an idle one 2 threads take ~6 s.
    """
    if num_threads is None:
        return _fit(train_images, train_labels, test_images, test_labels, params, out_dir,
                    num_classes=num_classes, class_names=class_names)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return _fit(train_images, train_labels, test_images, test_labels, params, out_dir,
                    num_classes=num_classes, class_names=class_names)
    finally:
        torch.set_num_threads(before)


def _fit(train_images, train_labels, test_images, test_labels, params: EvaluatorParams, out_dir: Path, *,
         num_classes: int, class_names: list[str]) -> dict:
    out_dir = Path(out_dir)
    # A split of several prepared shards (a ShardedArray) is read whole: the fit holds every image anyway.
    train_images, test_images = np.asarray(train_images), np.asarray(test_images)
    train_labels, test_labels = np.asarray(train_labels, np.int64), np.asarray(test_labels, np.int64)
    _check_images(train_images, train_labels, num_classes, "train")
    _check_images(test_images, test_labels, num_classes, "test")
    if test_images.shape[1:] != train_images.shape[1:]:
        raise ValueError(f"test images {test_images.shape[1:]} differ in shape from train images {train_images.shape[1:]}")
    if len(class_names) != num_classes:
        raise ValueError(f"class_names has {len(class_names)} names for {num_classes} classes")
    t0 = time.perf_counter()

    # Build the network from the seed.
    g = torch.Generator().manual_seed(params.seed)
    arch = {"in_channels": int(train_images.shape[1]), "num_classes": num_classes, "widths": list(DEFAULT_WIDTHS)}
    with torch.random.fork_rng(devices=[]):  # nn layers draw a default init from the global RNG
        net = EvaluatorNet(**{**arch, "widths": tuple(arch["widths"])})
    _init_weights(net, g)

    # Train: AdamW, cosine decay to zero, +-1 px random shifts.
    x_all, y_all = _to_input(train_images), torch.from_numpy(train_labels)
    steps_per_epoch = math.ceil(len(x_all) / params.batch_size)
    total_steps = params.epochs * steps_per_epoch
    opt = torch.optim.AdamW(net.parameters(), lr=params.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    net.train()
    for epoch in range(params.epochs):
        perm = torch.randperm(len(x_all), generator=g)
        loss_sum = 0.0
        for i in range(0, len(perm), params.batch_size):
            idx = perm[i : i + params.batch_size]
            if len(idx) < 2:
                continue  # BatchNorm cannot train on a batch of one
            x = _random_shift(x_all[idx], g)  # (B, C, H, W)
            loss = F.cross_entropy(net(x)[1], y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item() * len(idx)
        log.info("evaluator epoch %d/%d loss %.4f", epoch + 1, params.epochs, loss_sum / len(x_all))
    net.eval()

    # Measure and write.
    metrics = {
        "test_accuracy": _accuracy(net, test_images, test_labels),
        "train_accuracy": _accuracy(net, train_images, train_labels),
    }
    config = {
        "format_version": FORMAT_VERSION,
        "architecture": arch,
        "num_classes": num_classes,
        "class_names": list(class_names),
        "image_shape": list(train_images.shape[1:]),
        "feature_dim": arch["widths"][-1],
        "normalisation": NORMALISATION,
        "params": dataclasses.asdict(params),
    }
    _write_atomic(out_dir, net, config, metrics)
    log.info("evaluator: test accuracy %.4f, train accuracy %.4f, fit %.1f s",
             metrics["test_accuracy"], metrics["train_accuracy"], time.perf_counter() - t0)
    return metrics


def _write_atomic(out_dir: Path, net: nn.Module, config: dict, metrics: dict) -> None:
    """Writes the three files into a temp dir beside `out_dir`, which then replaces it whole."""
    with files.replacing_dir(out_dir, outputs.EVALUATOR) as tmp:
        files.save_weights(net.state_dict(), tmp / "model.safetensors", metadata={"format": "pt"})
        config = {**config, "model_sha256": files.sha256(tmp / "model.safetensors")}
        files.atomic_write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        files.atomic_write_text(tmp / "metrics.json", json.dumps(metrics, indent=2) + "\n")


# --- loading and inference --------------------------------------------------------------------


class Evaluator:
    """A frozen evaluator: uint8 images (N, C, H, W) in, float64 features/logits out."""

    def __init__(self, net: EvaluatorNet, config: dict, device: str | torch.device = "cpu"):
        self.net = net.to(device).eval().requires_grad_(False)
        self.config = config
        self.device = torch.device(device)
        self.num_classes: int = config["num_classes"]
        self.class_names: list[str] = config["class_names"]
        self.image_shape: tuple[int, ...] = tuple(config["image_shape"])
        self.feature_dim: int = config["feature_dim"]

    @torch.inference_mode()
    def _run(self, images: np.ndarray | torch.Tensor, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        x = torch.as_tensor(images if isinstance(images, torch.Tensor) else np.asarray(images))  # ShardedArray too
        if x.dtype != torch.uint8 or x.ndim != 4 or tuple(x.shape[1:]) != self.image_shape:
            raise ValueError(f"expected uint8 images (N, {', '.join(map(str, self.image_shape))}), "
                             f"got {x.dtype} {tuple(x.shape)}")
        feats, logits = [], []
        for i in range(0, len(x), batch_size):
            f, l = self.net(_to_input(x[i : i + batch_size]).to(self.device))
            feats.append(f.double().cpu())
            logits.append(l.double().cpu())
        if not feats:
            return np.zeros((0, self.feature_dim)), np.zeros((0, self.num_classes))
        return torch.cat(feats).numpy(), torch.cat(logits).numpy()

    def features_and_logits(self, images, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """(N, D) float64 features and (N, num_classes) float64 logits in one pass."""
        return self._run(images, batch_size)

    def features(self, images, batch_size: int = 1024) -> np.ndarray:
        """(N, D) float64 penultimate-layer features."""
        return self._run(images, batch_size)[0]

    def logits(self, images, batch_size: int = 1024) -> np.ndarray:
        """(N, num_classes) float64 logits."""
        return self._run(images, batch_size)[1]

    def predict(self, images, batch_size: int = 1024) -> np.ndarray:
        """(N,) int64 predicted classes."""
        return self.logits(images, batch_size).argmax(1).astype(np.int64)


def load_evaluator(directory: str | Path, device: str | torch.device = "cpu") -> Evaluator:
    """Loads an evaluator written by `fit_evaluator` (safetensors only, checked against config.json)."""
    d = Path(directory)
    fix = "re-run `ddpmrepro fit-evaluator` (or `dvc repro fit-evaluator`)"
    cfg_path, model_path = d / "config.json", d / "model.safetensors"
    for p in (cfg_path, model_path):
        if not p.is_file():
            raise EvaluatorError(f"{p}: not found; {fix}")
    try:
        config = json.loads(cfg_path.read_text())
        arch = config["architecture"]
        net = EvaluatorNet(arch["in_channels"], arch["num_classes"], tuple(arch["widths"]))
    except (ValueError, KeyError, TypeError) as e:
        raise EvaluatorError(f"{cfg_path}: unreadable evaluator config ({type(e).__name__}: {e}); {fix}") from None
    if config.get("format_version") != FORMAT_VERSION:
        raise EvaluatorError(f"{cfg_path}: format_version {config.get('format_version')!r} != {FORMAT_VERSION}; {fix}")
    expected_sha = config.get("model_sha256")  # written with every evaluator of this format_version
    if not isinstance(expected_sha, str):
        raise EvaluatorError(f"{cfg_path}: no model_sha256, so the weights cannot be checked; {fix}")
    if files.sha256(model_path) != expected_sha:
        raise EvaluatorError(f"{model_path}: sha256 does not match config.json (corrupt or replaced file); {fix}")
    try:
        state = load_file(model_path)
    except Exception as e:  # safetensors raises its own error types for truncated/garbled headers
        raise EvaluatorError(f"{model_path}: not a readable safetensors file ({e}); {fix}") from None
    own = net.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    bad_shape = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or bad_shape:
        raise EvaluatorError(f"{model_path}: weights do not fit config.json (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}, wrong shape {bad_shape[:3]}); {fix}")
    net.load_state_dict(state)
    return Evaluator(net, config, device)


__all__ = ["Evaluator", "EvaluatorError", "EvaluatorNet", "fit_evaluator", "load_evaluator"]
