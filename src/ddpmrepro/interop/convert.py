"""`ddpmrepro import` and `ddpmrepro export`: published weights <-> the model directory `train` writes.

An imported directory is what `train` exports, so `sample`, `evaluate` and the DVC stages read it
unchanged: `<ema_rate>` weights as safetensors and a `config.json` holding the resolved params (its
`model:` and `diffusion:` sections describe the imported network), the data it is evaluated on, and
`source` (format, file name, sha256) where `train` would record its data and code. The format is
`ddpmrepro.model_dir`'s, which writes the directory whole: nothing is written unless the whole
conversion succeeded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import files, outputs
from ..data.prepared import read_manifest
from ..model.unet import PRESETS, SHARED_DEFAULTS
from ..model_dir import build_model, data_section, load_model, write_model
from ..params import Params, from_dict, trained_dict
from . import ConversionError
from . import diffusers_unet as DF
from . import improved_diffusion as ID

FORMATS = ("improved-diffusion", "guided-diffusion", "diffusers")
DIFFUSERS_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")


def _find_diffusers_unet(src: Path) -> tuple[Path, Path | None]:
    """(folder holding the UNet's config.json, scheduler_config.json if any) of a model or pipeline folder."""
    unet_dir = src / "unet" if (src / "unet" / "config.json").is_file() else src
    if not (unet_dir / "config.json").is_file():
        raise ConversionError(f"{src}: no config.json (a diffusers UNet2DModel folder, or a pipeline folder with unet/)")
    for candidate in (src / "scheduler" / "scheduler_config.json", src / "scheduler_config.json"):
        if candidate.is_file():
            return unet_dir, candidate
    return unet_dir, None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not readable JSON ({type(e).__name__}: {str(e)[:120]})") from None


def _diffusers_weights(unet_dir: Path) -> tuple[dict, Path]:
    for name in DIFFUSERS_WEIGHTS:
        path = unet_dir / name
        if path.is_file():
            if name.endswith(".bin"):
                return ID.load_state_dict(path), path
            try:
                return files.load_weights(path), path
            except files.CheckpointError:
                raise ConversionError(f"{path}: not a valid safetensors file (truncated or damaged); download it "
                                      "again and check its sha256") from None
    raise ConversionError(f"{unet_dir}: none of {', '.join(DIFFUSERS_WEIGHTS)}")


def _check_upsampler(state: dict, params: Params, channels: int, src: Path) -> None:
    """An improved-/guided-diffusion `SuperResModel` is a `UNetModel` whose first conv takes 2C channels
    (the noisy image and the upsampled low-res input): the file shows whether it is one, but not the
    low-res side, which params.yaml's superres.low_res must give. One line where the two disagree."""
    first = state.get("input_blocks.0.0.weight")
    if not isinstance(first, torch.Tensor) or first.ndim != 4:
        return  # ID.to_ours names what is missing or malformed
    low_res, took = params.superres.low_res, first.shape[1]
    if took == 2 * channels and not low_res:
        raise ConversionError(f"{src}: a super-resolution model (its first conv takes {took} = 2 x {channels} "
                              "channels: the image and the upsampled low-res input); set superres.low_res to the "
                              "side of its low-res input (64 for 64_256_upsampler.pt; docs/MODELS.md)")
    if took == channels and low_res:
        raise ConversionError(f"{src}: a base model ({took}-channel input), not a super-resolution model; "
                              f"superres.low_res ({low_res}) is for SuperResModel files: set it to 0")
    if low_res and params.superres.noise_aug:
        # Their upsampler was trained without conditioning augmentation: it has no noise-level embedding.
        raise ConversionError(f"superres.noise_aug: {params.superres.noise_aug}: a SuperResModel has no "
                              "noise-level input; set superres.noise_aug: 0 and superres.sample_noise_aug: 0")


def _with(params: Params, section: str, **keys) -> Params:
    raw = params.to_dict()
    raw[section] = {**raw[section], **keys}
    return from_dict(raw)


def import_model(src: Path, fmt: str, out: Path, params: Params, data_dir: Path, ema_rate: float | None = None,
                 attention_order: str = "legacy") -> dict:
    """Converts `src` into a model directory at `out`; returns its config.json.

    :param src: an improved-/guided-diffusion `.pt` state dict (a `UNetModel`, or with
        `superres.low_res` > 0 a `SuperResModel`), or a diffusers UNet2DModel (or pipeline) folder.
    :param fmt: one of FORMATS.
    :param params: params.yaml; for `.pt` files its `model:` and `diffusion:` sections describe the
        checkpoint (the file holds only tensors). A diffusers folder brings its own: its config.json
        sets every `model:` key, its scheduler_config.json (if present) the `diffusion:` keys.
    :param data_dir: the prepared data the model is evaluated on (its manifest gives image size,
        channels and classes).
    :param ema_rate: which EMA the weights are (published improved-diffusion files `ema_0.9999_*.pt`
        are 0.9999); None: `sample.ema_rate`, so `ddpmrepro sample` with the same params finds them.
    :raises ConversionError: one line naming the file or key; nothing is written.
    """
    if fmt not in FORMATS:
        raise ConversionError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    if not src.exists():  # first: the data's manifest or a missing config.json would be named instead
        what = "a diffusers UNet2DModel or pipeline folder" if fmt == "diffusers" else f"an {fmt} .pt file"
        raise ConversionError(f"{src}: not found; pass the path of {what}")
    manifest = read_manifest(Path(data_dir))
    if fmt == "diffusers":
        if params.superres.low_res:
            raise ConversionError(f"superres.low_res: {params.superres.low_res}: diffusers has no layout of IDDPM's "
                                  "upsampler (a UNet2DModel folder is a base model); set superres.low_res: 0")
        unet_dir, sched_path = _find_diffusers_unet(src)
        config = _read_json(unet_dir / "config.json")
        params = _with(params, "model", **DF.model_keys(config, source=str(unet_dir / "config.json")))
        if sched_path is not None:
            params = _with(params, "diffusion", **DF.diffusion_keys(_read_json(sched_path), source=str(sched_path)))
        if int(config.get("in_channels", 3)) != manifest["channels"] or \
                int(config.get("sample_size", manifest["image_size"])) != manifest["image_size"]:
            raise ConversionError(f"{unet_dir / 'config.json'}: a {config.get('in_channels')}-channel "
                                  f"{config.get('sample_size')}px model, but {data_dir} holds {manifest['channels']}-"
                                  f"channel {manifest['image_size']}px images; prepare matching data")
        state, weights_path = _diffusers_weights(unet_dir)
    else:
        state, weights_path = ID.load_state_dict(src), src
        _check_upsampler(state, params, manifest["channels"], src)
    with torch.device("meta"):  # the target's names and shapes only; the weights come from the file
        model = build_model(params, data_section(manifest))  # an upsampler with superres.low_res > 0
    if fmt == "diffusers":
        weights = DF.from_diffusers(state, model, source=str(weights_path))
        if (config.get("num_class_embeds") or 0) not in (0, manifest["num_classes"] + 1):
            raise ConversionError(f"{unet_dir / 'config.json'}: num_class_embeds {config['num_class_embeds']} is not "
                                  f"{manifest['num_classes']} classes + the null label of {data_dir}")
    else:
        weights = ID.to_ours(state, model, source=str(src), attention_order=attention_order)
    bad = next((k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad is not None:  # it would import, and sample black images with exit 0
        raise ConversionError(f"{weights_path}: {bad} holds NaN or infinite values; a diverged or damaged model "
                              "cannot be sampled, so it is not imported")

    rate = params.sample.ema_rate if ema_rate is None else float(ema_rate)
    config_out = {
        "params": trained_dict(params),
        # The architecture as built (preset, overrides and defaults resolved), for a reader without the code.
        "architecture": {**SHARED_DEFAULTS, **PRESETS[params.model.preset], **params.model.overrides(),
                         "class_cond": params.model.class_cond},
        "data": data_section(manifest),
        "ema_rates": [rate] if rate else [],
        "source": {"format": fmt, "file": weights_path.name, "sha256": files.sha256(weights_path),
                   **({"attention_order": attention_order} if fmt != "diffusers" else {}),
                   # improved-/guided-diffusion have no null label: its row is zero, never trained.
                   **({"untrained_null_label": True} if fmt != "diffusers" and params.model.class_cond else {})},
        "torch": torch.__version__,
    }
    write_model(out, config_out, None if rate else weights, {rate: weights} if rate else {})
    return config_out


def use_published(params: Params, data_dir: Path, out: Path, live_dir: Path, introspect_dir: Path) -> dict:
    """The train stage under `train.import_from`: imports the published model into `out` as the
    EMA of `train.ema_rates[0]`, and leaves the training logs empty (no loss, no gradient tables:
    nothing was trained, and nothing pretends it was). Returns the model's config.json."""
    config = import_model(Path(params.train.import_from), params.train.import_format, out, params, data_dir,
                          ema_rate=params.train.ema_rates[0])
    with files.replacing_dir(Path(live_dir), outputs.TRAIN_LOG) as tmp:
        (tmp / "plots" / "metrics").mkdir(parents=True)
        files.atomic_write_text(tmp / "metrics.json", "{}\n")
    with files.replacing_dir(Path(introspect_dir), outputs.INTROSPECTION):
        pass  # empty
    return config


def export_diffusers(model_dir: Path, out: Path, ema_rate: float, ema_length: float | None = 0.0,
                     ema_step: int = 0) -> dict:
    """Writes a diffusers pipeline folder: `unet/` (UNet2DModel config + safetensors),
    `scheduler/scheduler_config.json` (DDPMScheduler) and `model_index.json` (DDPMPipeline).
    Returns the UNet config. ConversionError if diffusers cannot express the model exactly.
    `ema_length` > 0 exports the post-hoc EMA of that length (reconstructed) instead of `ema_rate`'s,
    as it stood after step `ema_step` (0: the last)."""
    model, trained, config = load_model(Path(model_dir), ema_rate, ema_length=ema_length, ema_step=ema_step)
    if trained.superres.low_res:
        # diffusers' super-resolution pipelines condition otherwise (LDM's in a VQ-VAE latent space, IF's
        # through a text-conditioned UNet2DConditionModel): none feeds a UNet2DModel the bilinearly
        # upsampled low-res image (DDPMPipeline would feed it 2C channels of noise and nothing else).
        raise ConversionError(f"{model_dir} is an upsampler (superres.low_res: {trained.superres.low_res}); diffusers "
                              "has no pipeline for IDDPM's super-resolution UNet, so only base models export")
    unet_cfg = DF.unet2d_config(model, config["data"]["image_size"])
    sched_cfg = DF.scheduler_config(trained.diffusion)
    with files.replacing_dir(Path(out), outputs.DIFFUSERS) as tmp:
        (tmp / "unet").mkdir()
        (tmp / "scheduler").mkdir()
        files.save_weights(DF.to_diffusers(model), tmp / "unet" / "diffusion_pytorch_model.safetensors",
                           metadata={"format": "pt"})
        (tmp / "unet" / "config.json").write_text(json.dumps(unet_cfg, indent=2))
        (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched_cfg, indent=2))
        (tmp / "model_index.json").write_text(json.dumps({
            "_class_name": "DDPMPipeline", "scheduler": ["diffusers", "DDPMScheduler"],
            "unet": ["diffusers", "UNet2DModel"],
        }, indent=2))
        (tmp / "ddpmrepro.json").write_text(json.dumps({  # where it came from, and what the null label is
            "model_dir": str(model_dir), "ema_rate": ema_rate,
            **({"ema_length": ema_length} if ema_length else {}),
            **({"ema_step": ema_step} if ema_step else {}), "null_class": config["data"]["num_classes"]
            if model.label_embed is not None else None, "class_names": config["data"]["class_names"],
            "guidance": "eps = (1 + w) eps(y) - w eps(null): diffusers' guidance scale s = 1 + w",
        }, indent=2))
    return unet_cfg


__all__ = ["FORMATS", "import_model", "export_diffusers", "ConversionError"]
