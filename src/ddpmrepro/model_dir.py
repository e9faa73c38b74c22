"""The model directory (`models/ddpm/`): the one format `train` and `import` write and `sample`,
`evaluate` and `export` read.

    model.safetensors          the raw weights (train; import when it is given no EMA rate)
    ema_<rate>.safetensors     one per EMA rate, as listed in config.json's `ema_rates`
    config.json                `params` (resolved), `data` (`DATA_KEYS` of the manifest it was made
                               for), `ema_rates`, `torch`, and what made it: train adds the data's
                               sha256, the code version, the run hash and the last logged values;
                               import adds the architecture as built and the `source` file

The producers build config.json (each has its own provenance keys, in an order that is part of the
bytes DVC hashes); this module checks what every reader relies on, writes the directory whole
(`files.replacing_dir`) and builds the network back from it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import files
from .model.superres import build_superres
from .model.unet import UNet, build_unet
from .params import Params, ParamsError, from_dict

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DATA_KEYS = ("source", "num_classes", "image_size", "channels", "class_names")


def weights_file(ema_rate: float) -> str:
    """The file of the EMA at `ema_rate`; rate 0 means the raw weights."""
    return f"ema_{ema_rate:g}.safetensors" if ema_rate else MODEL_FILE


def data_section(manifest: dict) -> dict:
    """config.json's `data`: what a reader needs of the prepared data, without the data itself."""
    return {k: manifest[k] for k in DATA_KEYS}


# --- writing ---------------------------------------------------------------------------------------


def write_model(out: Path, config: dict, weights: dict[str, torch.Tensor] | None,
                emas: dict[float, dict[str, torch.Tensor]]) -> None:
    """Writes the model directory `out` whole: it holds the old directory or all of the new one.

    :param config: config.json's content, written as `json.dumps(config, indent=2)`; its
        `ema_rates` must list the keys of `emas`, in order.
    :param weights: the raw weights (model.safetensors), or None where there are none (an import of
        one EMA).
    :param emas: rate -> EMA weights.
    """
    missing = [k for k in ("params", "data", "ema_rates") if k not in config]
    if missing or list(config["ema_rates"]) != list(emas) or weights is None and not emas:
        raise ValueError(f"not a model directory's config.json (missing {missing}, ema_rates "
                         f"{config.get('ema_rates')} for EMA weights {list(emas)})")
    with files.replacing_dir(out) as tmp:
        if weights is not None:
            files.save_weights(weights, tmp / MODEL_FILE)
        for rate, ema in emas.items():
            files.save_weights(ema, tmp / weights_file(rate))
        files.atomic_write_text(tmp / CONFIG_FILE, json.dumps(config, indent=2))


# --- reading ---------------------------------------------------------------------------------------


def read_config(model_dir: Path) -> dict:
    """config.json of a model directory; CheckpointError (one line) where there is none."""
    model_dir = Path(model_dir)
    files.recover_dir(model_dir)  # a writer killed mid-swap where directories cannot be exchanged
    path = model_dir / CONFIG_FILE
    if not path.exists():
        raise files.CheckpointError(f"{path}: not found; train first (`dvc repro train`)")
    return json.loads(path.read_text())


def build_model(trained: Params, data: dict) -> UNet:
    """The network (fresh weights) that params `trained` and config.json's `data` describe. An
    upsampler (superres.low_res > 0) is IDDPM's super-resolution UNet. `import` builds its target
    with this too, so what it writes is what `load_model` reads back."""
    shape = dict(image_size=data["image_size"], in_channels=data["channels"], num_classes=data["num_classes"],
                 learn_sigma=trained.diffusion.variance == "learned_range")
    if trained.superres.low_res:
        return build_superres(trained.model, trained.superres, **shape)
    return build_unet(trained.model, **shape)


def load_model(model_dir: Path, ema_rate: float, device="cpu"):
    """(the network with the chosen EMA weights (rate 0: the raw weights), eval mode on `device`;
    the params it was made with; config.json)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    trained = from_dict(config["params"])
    if ema_rate and ema_rate not in [float(r) for r in config["ema_rates"]]:
        raise ParamsError(f"sample.ema_rate={ema_rate:g} was not trained; available: "
                          f"{', '.join(f'{float(r):g}' for r in config['ema_rates'])} (or 0 for raw weights)")
    name = weights_file(ema_rate)
    model = build_model(trained, config["data"])
    state = files.load_weights(model_dir / name)
    missing = set(model.state_dict()) ^ set(state)
    if missing:
        raise files.CheckpointError(f"{model_dir / name}: tensors do not match the architecture in config.json "
                                    f"(e.g. {sorted(missing)[0]}); retrain or restore the model directory")
    model.load_state_dict(state)
    return model.to(device).eval(), trained, config


__all__ = ["MODEL_FILE", "CONFIG_FILE", "DATA_KEYS", "weights_file", "data_section", "write_model", "read_config",
           "build_model", "load_model"]
