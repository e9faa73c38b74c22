"""Super-resolution: sampling an upsampler from low-res inputs, and its metrics beside bicubic.

Inputs (`superres.low_res_from`): `test` takes the first `sample.per_class` test images of each
class, area-downsampled and rounded to uint8 (so PSNR and SSIM against the true image exist);
a path takes a base run's samples.npz (uint8 images and their labels): the cascade. Image k
draws its augmentation noise and all its sampling noise from its own generator seeded by
(sample.seed, k), with any sampler, respacing and guidance of `sample.*`.

With `superres.project` each output is projected, after sampling, onto the images whose
area-downsampling is its uint8 input (`model.superres.project`): consistent by construction.

Metrics (docs/SUPERRES.md), each for the model and for bicubic upsampling of the same inputs:
PSNR and SSIM against the true images (test inputs only), consistency (the output area-
downsampled back to the low-res side and rounded, against its uint8 input: mean absolute error in
0-255 levels, and the share of images within CONSISTENCY_TOL of it), and evaluator-space
FID/precision/recall against the high-res test split.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import files, outputs
from ..data import load_prepared, to_model_range, to_uint8
from ..model.superres import augment, bicubic_upsample, downsample, project
from ..model_dir import load_model
from ..params import Params, ParamsError
from ..runtime.autocast_network import with_precision
from ..runtime.memory_layout import memory_layout
from .evaluate import read_samples
from .sample import NOT_IN_THE_IMAGES, bind_labels, check_guidance, image_seed, process, run_sampler, save_grid

# An output is consistent with its input when, downsampled back and rounded, it is within this
# many uint8 levels of it on average (2 levels: the rounding of both images, plus one for the model).
# A diagnostic of fidelity to the input, not a quality score, and not a property the model has
# unless superres.project imposes it (docs/SUPERRES.md, "Consistency").
CONSISTENCY_TOL = 2.0


def low_res_inputs(params: Params, side: int, data: dict, data_dir: Path | None, *, conditional: bool) -> dict:
    """uint8 low-res images (N, C, side, side), their labels, where they come from, and the true
    high-res images when they come from the test split (else None). `data`: the upsampler's
    config.json section; `conditional`: whether it takes class labels."""
    image_size, num_classes = data["image_size"], data["num_classes"]
    sr, per_class = params.superres, params.sample.per_class
    if sr.low_res_from == "test":
        if data_dir is None:
            raise ParamsError("superres.low_res_from is 'test': pass --data, the prepared data directory")
        test = load_prepared(data_dir)
        if test.test_images.shape[-1] != image_size:
            raise ParamsError(f"{data_dir} holds {test.test_images.shape[-1]}x{test.test_images.shape[-1]} images, the "
                              f"upsampler makes {image_size}x{image_size}; prepare the data at data.image_size: "
                              f"{image_size}")
        labels = np.asarray(test.test_labels)
        counts = np.bincount(labels, minlength=test.num_classes)
        if counts.min() < per_class:  # fewer images than asked for, and the written params saying otherwise
            c = int(counts.argmin())
            raise ParamsError(f"sample.per_class: {per_class}, but class {c} has {int(counts[c])} test images in "
                              f"{data_dir} (superres.low_res_from: test); lower it to {int(counts.min())} or less")
        index = np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(test.num_classes)])
        truth = np.stack([np.asarray(test.test_images[i]) for i in index])
        low = to_uint8(downsample(to_model_range(truth), side)).numpy()
        return {"low_res": low, "labels": labels[index], "source_index": index, "truth": truth}
    path = Path(sr.low_res_from)
    if not path.is_file():
        raise ParamsError(f"superres.low_res_from: {path} is not a file; give a base run's samples.npz or 'test'")
    z = read_samples(path, num_classes=num_classes, keys=("images", "labels"), error=ParamsError,
                     fix="give superres.low_res_from a samples.npz written by `ddpmrepro sample`")
    low, labels = z["images"], z["labels"]
    if low.shape[1:] != (data["channels"], side, side):
        raise ParamsError(f"superres.low_res_from: {path} holds images of shape {low.shape[1:]}, the upsampler "
                          f"takes ({data['channels']}, {side}, {side}); sample a base model of that shape")
    if conditional and (labels == -1).all():
        raise ParamsError(f"superres.low_res_from: {path} holds an unconditional model's samples (labels -1), and "
                          "this upsampler is class-conditional; upsample a class-conditional base model's samples")
    return {"low_res": low, "labels": labels.astype(np.int64), "source_index": np.arange(len(low)), "truth": None}


@torch.no_grad()
def upsample(model, diffusion, low_uint8: torch.Tensor, labels: torch.Tensor, seeds: list[int], params: Params,
             level: float, num_classes: int, shape, device) -> torch.Tensor:
    """uint8 high-res images (B, C, H, W) for these low-res inputs, each from its own generator."""
    p = params.sample
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    low = to_model_range(low_uint8)
    cond = {}
    if model.aug_embed is not None:  # the augmentation noise first, then the sampler's noise, per image
        noise = torch.stack([torch.randn(low.shape[1:], generator=g) for g in gens])
        levels = torch.full((len(low),), level)
        low = augment(low, levels, noise)
        cond["aug_level"] = levels.to(device)
    cond["low_res"] = low.to(device)

    def net(x, t, y=None):  # guidance doubles the batch: the conditioning goes twice
        reps = x.shape[0] // len(labels)
        return model(x, t, y, **{k: torch.cat([v] * reps) for k, v in cond.items()})

    model_fn = bind_labels(net, model.label_embed is not None, labels, p.guidance, num_classes, device)
    x = run_sampler(diffusion, model_fn, (len(labels), *shape), gens, p, device).cpu()  # (B, C, H, W) in [-1, 1]
    if params.superres.project:  # onto the clean input, not the augmented one the network saw
        x = project(x, to_model_range(low_uint8))
    return to_uint8(x)


def sample_superres(params: Params, model_dir: Path, out_dir: Path, data_dir: Path | None = None) -> Path:
    """Upsamples every low-res input (one process); writes OUT/samples.npz (images, labels, seeds,
    low_res, source_index, from_test), grid.png and params.yaml."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, trained, config = load_model(model_dir, params.sample.ema_rate, device,
                                         ema_length=params.sample.ema_length, ema_step=params.sample.ema_step)
    memory_layout(model, params.sample.channels_last)  # NHWC weights, as in `sample`
    model = with_precision(model, params.sample.precision, device)
    side = trained.superres.low_res
    if not side:
        raise ParamsError(f"{model_dir} is a base model (superres.low_res: 0 in its config.json); sample it with "
                          "`ddpmrepro sample`, or train an upsampler (docs/SUPERRES.md)")
    check_guidance(params.sample, config, model_dir)
    level = params.superres.sample_noise_aug
    if params.superres.project and config["data"]["image_size"] % side:
        raise ParamsError(f"superres.project: {config['data']['image_size']} is not a whole multiple of the low-res "
                          f"side {side}, so downsampling is not a block mean to project on; set project: false")
    if level > trained.superres.noise_aug:
        raise ParamsError(f"superres.sample_noise_aug: {level} is above the noise_aug the model in {model_dir} was "
                          f"trained with ({trained.superres.noise_aug}); lower it")
    diffusion, _ = process(trained.diffusion, params.sample, model_dir)  # any sampler of sample.sampler
    data = config["data"]
    shape = (data["channels"], data["image_size"], data["image_size"])
    inputs = low_res_inputs(params, side, data, data_dir, conditional=model.label_embed is not None)
    n = len(inputs["labels"])
    seeds = [image_seed(params.sample.seed, k) for k in range(n)]
    images = np.empty((n, *shape), dtype=np.uint8)
    bs = params.sample.batch_size
    for start in range(0, n, bs):
        sl = slice(start, start + bs)
        images[sl] = upsample(model, diffusion, torch.from_numpy(inputs["low_res"][sl]),
                              torch.from_numpy(inputs["labels"][sl]), seeds[sl], params, level,
                              data["num_classes"], shape, device).numpy()
    arrays = {"images": images, "labels": inputs["labels"], "seeds": np.array(seeds, dtype=np.int64),
              "low_res": inputs["low_res"], "source_index": inputs["source_index"].astype(np.int64),
              "from_test": np.array(inputs["truth"] is not None)}
    _write(out_dir, arrays, data["class_names"], params)
    return out_dir / "samples.npz"


def _write(out_dir: Path, arrays: dict, class_names, params: Params) -> None:
    from ..params import save_resolved

    with files.replacing_dir(out_dir, outputs.SAMPLES) as tmp:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        files.atomic_write_bytes(tmp / "samples.npz", lambda f: f.write(buf.getvalue()))
        save_grid(arrays["images"], arrays["labels"], class_names, tmp / "grid.png")
        save_resolved(params, tmp / "params.yaml", sections=("sample", "superres"), omit=NOT_IN_THE_IMAGES)


# --- metrics -----------------------------------------------------------------------------------


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over images of 10 log10(255^2 / MSE) (uint8 images; an exact copy counts as 100 dB)."""
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(1)
    return float(np.mean(10 * np.log10(255.0**2 / np.maximum(mse, 255.0**2 * 1e-10))))


def ssim(a: np.ndarray, b: np.ndarray, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004) over images and channels: Gaussian window of std 1.5 and side 11
    (or the largest odd side that fits a smaller image), valid positions only, K1 = 0.01,
    K2 = 0.03, L = 255, sample statistics weighted by the window."""
    x, y = (torch.from_numpy(np.asarray(v)).double() for v in (a, b))
    n, c, h, w = x.shape
    size = min(11, h - (1 - h % 2), w - (1 - w % 2))
    r = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-r**2 / (2 * sigma**2))
    win = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]  # (1, 1, size, size), sums to 1
    x, y = x.reshape(n * c, 1, h, w), y.reshape(n * c, 1, h, w)

    def filt(z):
        return F.conv2d(z, win)
    mx, my = filt(x), filt(y)
    vx, vy, cxy = filt(x * x) - mx**2, filt(y * y) - my**2, filt(x * y) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean())


def consistency(images: np.ndarray, low_uint8: np.ndarray) -> dict:
    """The outputs downsampled back (area, rounded to uint8) against their low-res inputs."""
    back = to_uint8(downsample(to_model_range(images), low_uint8.shape[-1])).numpy().astype(np.float64)
    mae = np.abs(back - low_uint8.astype(np.float64)).reshape(len(images), -1).mean(1)
    return {"consistency_mae": float(mae.mean()), "consistent_share": float((mae <= CONSISTENCY_TOL).mean()),
            "consistency_tol": CONSISTENCY_TOL}


def evaluate_superres(params: Params, samples_dir: Path, data_dir: Path, evaluator_dir: Path, out: Path,
                      detail_out: Path) -> dict:
    """Writes `out` (headline: model and bicubic side by side) and `detail_out` (everything)."""
    from .evaluator import load_evaluator
    from .metrics import feature_metrics

    path = Path(samples_dir) / "samples.npz"
    data = load_prepared(data_dir)
    fix = "rerun `ddpmrepro sample-superres`"
    s = read_samples(path, num_classes=data.num_classes, fix=fix,
                     keys=("images", "labels", "seeds", "low_res", "source_index", "from_test"))
    if s["images"].shape[1:] != data.test_images.shape[1:]:
        raise ValueError(f"samples are {s['images'].shape[1:]} but the data is {data.test_images.shape[1:]}; "
                         "evaluate against the high-resolution data the upsampler was trained on")
    low, index = s["low_res"], s["source_index"]
    if low.dtype != np.uint8 or low.ndim != 4 or low.shape[:2] != s["images"].shape[:2]:
        raise files.CheckpointError(f"{path}: low_res is {low.dtype} {list(low.shape)}, not uint8 low-res images, one "
                                    f"per image of {list(s['images'].shape)}; {fix}")
    if bool(s["from_test"]) and (index.dtype.kind not in "iu" or index.shape != (len(low),)
                                 or not ((index >= 0) & (index < len(data.test_images))).all()):
        raise files.CheckpointError(f"{path}: source_index does not index the {len(data.test_images)} test images of "
                                    f"{data_dir}, one per image; {fix}")
    evaluator = load_evaluator(evaluator_dir)
    f_test = evaluator.features(data.test_images)
    side = data.test_images.shape[-1]
    truth = np.stack([np.asarray(data.test_images[i]) for i in s["source_index"]]) if bool(s["from_test"]) else None
    detail = {}
    for name, imgs in (("model", s["images"]), ("bicubic", bicubic_upsample(torch.from_numpy(s["low_res"]), side).numpy())):
        m = {}
        if truth is not None:
            m["psnr"], m["ssim"] = psnr(imgs, truth), ssim(imgs, truth)
        m.update(consistency(imgs, s["low_res"]))
        f_gen = evaluator.features(imgs)
        m.update(feature_metrics(f_gen, s["labels"], f_test, data.test_labels, k=params.evaluate.pr_neighbourhood,
                                 kid_subset_size=min(1000, len(f_gen), len(f_test))))
        detail[name] = m
    headline = {}
    for key in ("psnr", "ssim", "fid", "precision", "recall", "consistency_mae"):
        for name in ("model", "bicubic"):
            if key in detail[name]:
                v = detail[name][key]
                headline[f"{'sr' if name == 'model' else 'bicubic'}_{key}"] = None if v is None or not math.isfinite(v) else v
    headline["images"] = int(len(s["images"]))
    files.atomic_write_texts({Path(out): json.dumps(headline, indent=2) + "\n",
                              Path(detail_out): json.dumps(detail, indent=2) + "\n"})  # both or neither
    return headline


__all__ = ["low_res_inputs", "upsample", "sample_superres", "psnr", "ssim", "consistency", "evaluate_superres",
           "CONSISTENCY_TOL"]
