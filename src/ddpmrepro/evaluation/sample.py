"""Sampling: N images per class from the EMA weights, reproducible per image seed.

Image k (class k // per_class) draws all its noise from its own generator seeded by
(sample.seed, k), so it is the same whatever the batch size or the number of processes.
Under torchrun, rank r makes images r, r + W, r + 2W, ...; rank 0 gathers them in order.
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from .. import files, outputs
from ..data import to_uint8
from ..model.diffusion import from_params as diffusion_from_params
from ..model.diffusion import guided_model_fn
from ..model import samplers
from ..model_dir import load_model
from ..params import Params, ParamsError, SampleParams
from ..runtime import compilation
from ..runtime import distributed as D
from ..runtime.autocast_network import with_precision
from ..runtime.memory_layout import memory_layout
from ..runtime.graphed_network import GraphedNetwork


def image_seed(base: int, k: int) -> int:
    return (base * 1_000_003 + k) % (2**63 - 1)


@torch.no_grad()
def generate(model, diffusion, labels: torch.Tensor, seeds: list[int], p: SampleParams, num_classes: int,
             shape: tuple[int, int, int], device, progress=None) -> torch.Tensor:
    """uint8 images (B, C, H, W) for these labels, each from its own seeded generator.

    :param diffusion: for ddpm/ddim the respaced GaussianDiffusion, for the fast solvers a
        `samplers.Plan` (see `process`).
    """
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    model_fn = bind_labels(model, model.label_embed is not None, labels, p.guidance, num_classes, device)
    return to_uint8(run_sampler(diffusion, model_fn, (len(labels), *shape), gens, p, device, progress).cpu())


def bind_labels(net, conditional: bool, labels: torch.Tensor, guidance: float, num_classes: int, device):
    """`model_fn(x, t)` for the samplers from `net(x, t, y)`: guided with `labels`, or for an
    unconditional network with no labels at all (nothing to guide)."""
    if conditional:
        return guided_model_fn(net, labels.to(device), guidance, num_classes)

    def model_fn(x, t):
        return net(x, t)
    model_fn.device = torch.device(device)
    return model_fn


def run_sampler(diffusion, model_fn, shape, gens: list[torch.Generator], p: SampleParams, device,
                progress=None) -> torch.Tensor:
    """x_0 in [-1, 1] from `model_fn(x, t)` with `sample.sampler`: `diffusion` as `process` made it."""
    if p.sampler in samplers.SAMPLERS:
        return diffusion.sample(model_fn, shape, generators=gens, progress=progress, device=device)
    run = diffusion.ddim_sample if p.sampler == "ddim" else diffusion.ddpm_sample
    kwargs = {"eta": p.eta} if p.sampler == "ddim" else {}
    if p.thresholding != "static":  # only passed when not the default, so ddpm/ddim run exactly as before
        kwargs["clip_denoised"] = False
    return run(model_fn, shape, generators=gens, progress=progress, device=device, **kwargs)


def process(trained_diffusion, p: SampleParams, model_dir: Path):
    """(what `generate` samples with, network calls per image): the respaced GaussianDiffusion of
    ddpm/ddim, or the fast solver's `samplers.Plan`, for the model's own T and schedule."""
    try:  # params.yaml was checked against its own diffusion.timesteps; the model may have another T
        if p.sampler in samplers.SAMPLERS:
            plan = samplers.from_params(trained_diffusion, p)
            return plan, plan.nfe
        # Respacing applies to both samplers (IDDPM samples DDPM on respaced steps too).
        diffusion = diffusion_from_params(trained_diffusion, respacing=p.respacing)
        return diffusion, diffusion.num_timesteps
    except ValueError as e:
        raise ValueError(f"sample.respacing: {e} (the model in {model_dir} has "
                         f"{trained_diffusion.timesteps} timesteps)") from None


def check_guidance(p: SampleParams, config: dict, model_dir: Path) -> None:
    """Guidance needs a trained null label: an imported improved-/guided-diffusion model has none, nor
    has a model trained with train.label_dropout: 0 (the null label never replaced a class)."""
    if p.guidance and config.get("source", {}).get("untrained_null_label"):
        raise ParamsError(f"sample.guidance={p.guidance:g}: {model_dir} was imported from a model without a null "
                          "label (docs/MODELS.md), so guidance means nothing; set sample.guidance: 0")
    trained = config.get("params", {})
    if p.guidance and not config.get("source") and trained.get("model", {}).get("class_cond", True) \
            and trained.get("train", {}).get("label_dropout") == 0:
        raise ParamsError(f"sample.guidance={p.guidance:g}: {model_dir} was trained with train.label_dropout: 0, so "
                          "its null label was never trained and guidance means nothing; set sample.guidance: 0, or "
                          "retrain with label_dropout > 0 (0.1 is usual)")


def sample(params: Params, model_dir: Path, out_dir: Path) -> Path:
    p = params.sample
    device = torch.device("cuda", D.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    compiler = compilation.Compiler(p.compile, device, cache_dir=compilation.DEFAULT_CACHE_DIR, key="sample.compile")
    D.init(device.type)
    rank, world = D.rank(), D.world_size()
    model, trained, config = load_model(model_dir, p.ema_rate, device, ema_length=p.ema_length,
                                         ema_step=p.ema_step)
    memory_layout(model, p.channels_last)  # NHWC weights: each convolution lays out its output as its weight is
    compiler(model)  # the network is called nfe times per batch: its blocks compiled once
    model = with_precision(model, p.precision, device)  # bf16/fp16 forwards; the solver in float32
    if p.cuda_graphs:  # and replayed from a CUDA graph per batch shape (the solver's arithmetic stays eager)
        model = GraphedNetwork(model, device)
    if trained.superres.low_res:
        raise ParamsError(f"{model_dir} is an upsampler (superres.low_res: {trained.superres.low_res}); sample it "
                          "with `ddpmrepro sample-superres` (docs/SUPERRES.md)")
    check_guidance(p, config, model_dir)
    data = config["data"]
    diffusion, nfe = process(trained.diffusion, p, model_dir)
    num_classes, shape = data["num_classes"], (data["channels"], data["image_size"], data["image_size"])

    n = num_classes * p.per_class
    mine = list(range(rank, n, world))
    images = torch.empty(len(mine), *shape, dtype=torch.uint8)
    bar = _bar(D.is_main(), len(mine))
    for start in range(0, len(mine), p.batch_size):
        ks = mine[start:start + p.batch_size]
        labels = torch.tensor([k // p.per_class for k in ks])
        images[start:start + len(ks)] = generate(model, diffusion, labels, [image_seed(p.seed, k) for k in ks],
                                                 p, num_classes, shape, device)
        bar(len(ks))

    # Gather shards through the filesystem (works with gloo and NCCL alike), then write atomically.
    shard_dir = out_dir.with_name(f".{out_dir.name}.shards")
    if world > 1:
        if D.is_main():
            shutil.rmtree(shard_dir, ignore_errors=True)
        D.barrier()
        shard_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"k": torch.tensor(mine), "images": images}, shard_dir / f"rank{rank}.pt")
        D.barrier()
    if D.is_main():
        all_images = torch.empty(n, *shape, dtype=torch.uint8)
        if world > 1:
            for r in range(world):
                shard = torch.load(shard_dir / f"rank{r}.pt", weights_only=True)
                all_images[shard["k"]] = shard["images"]
            shutil.rmtree(shard_dir)
        else:
            all_images[mine] = images
        labels = np.arange(n) // p.per_class
        if model.label_embed is None:  # an unconditional model was conditioned on nothing: label -1
            labels = np.full(n, -1)
        seeds = np.array([image_seed(p.seed, k) for k in range(n)], dtype=np.int64)
        write_samples(out_dir, all_images.numpy(), labels, seeds, data["class_names"], params,
                      sampling={"sampler": p.sampler, "nfe": nfe, "guidance": p.guidance})
    D.barrier()
    D.cleanup()
    return out_dir / "samples.npz"


# The images do not depend on these, up to the rounding of batched convolutions (at most one uint8
# level, in under 1% of the pixels: tests/test_sample.py). The params.yaml beside the samples leaves
# them out: where the images come out the same, samples/ is byte for byte as it was and DVC does not
# score them again; where a pixel moved, samples.npz says so.
NOT_IN_THE_IMAGES = ("sample.batch_size", "sample.nproc")


def write_samples(out_dir: Path, images: np.ndarray, labels: np.ndarray, seeds: np.ndarray, class_names,
                  params: Params, sampling: dict | None = None) -> None:
    """samples.npz + grid.png + params.yaml (the sample section that made them, but
    NOT_IN_THE_IMAGES) (+ sampling.json: the sampler and its network calls per image, which
    evaluate copies into the metrics), swapped into place together."""
    from ..params import save_resolved

    with files.replacing_dir(out_dir, outputs.SAMPLES) as tmp:
        buf = io.BytesIO()
        np.savez(buf, images=images, labels=labels.astype(np.int64), seeds=seeds)
        files.atomic_write_bytes(tmp / "samples.npz", lambda f: f.write(buf.getvalue()))
        save_grid(images, labels, class_names, tmp / "grid.png")
        save_resolved(params, tmp / "params.yaml", sections=("sample",), omit=NOT_IN_THE_IMAGES)
        if sampling is not None:
            files.atomic_write_text(tmp / "sampling.json", json.dumps(sampling, indent=2) + "\n")


def save_grid(images: np.ndarray, labels: np.ndarray, class_names, path: Path, per_row: int = 10) -> None:
    """One row per class, the first `per_row` samples of each, upscaled for viewing."""
    from PIL import Image

    if (labels < 0).all():  # unconditional samples: rows of `per_row` in order
        labels = np.arange(len(labels)) // max(1, len(labels) // 10)
    n_cls = int(labels.max()) + 1
    c, h, w = images.shape[1:]
    grid = np.zeros((n_cls * (h + 1), per_row * (w + 1), c), dtype=np.uint8)
    for cls in range(n_cls):
        for j, img in enumerate(images[labels == cls][:per_row]):
            grid[cls * (h + 1):cls * (h + 1) + h, j * (w + 1):j * (w + 1) + w] = img.transpose(1, 2, 0)
    scale = max(1, 256 // grid.shape[0])
    mode = "L" if c == 1 else "RGB"
    im = Image.fromarray(grid[..., 0] if c == 1 else grid, mode=mode)
    im.resize((im.width * scale, im.height * scale), Image.NEAREST).save(path)


def _bar(main: bool, total: int):
    import sys

    if not main or not sys.stderr.isatty():
        return lambda n: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="sample", dynamic_ncols=True)
    return bar.update

