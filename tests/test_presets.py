"""The GPU presets in configs/: each is a valid params.yaml with the published configuration."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ddpmrepro import params as P
from ddpmrepro.model.unet import PRESETS, build_unet

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def n_params(p: P.Params, num_classes: int | None = 10) -> int:
    with torch.device("meta"):  # shapes only: no memory, no time
        model = build_unet(p.model, image_size=p.data.image_size, in_channels=p.data.channels,
                           num_classes=num_classes, learn_sigma=p.diffusion.variance == "learned_range")
    return sum(t.numel() for t in model.parameters())


def resolved(p: P.Params, key: str):
    """An architecture value as built: the params file's override, else the preset's."""
    return p.model.overrides().get(key, PRESETS[p.model.preset][key])


def global_batch(t: P.TrainParams) -> int:
    return t.batch_per_proc * t.nproc * t.grad_accum


def test_there_are_the_three_presets_and_two_published_models():
    assert [c.name for c in CONFIGS] == ["ddpm-cifar10-published.yaml", "ddpm-cifar10.yaml",
                                         "iddpm-cifar10-published.yaml", "iddpm-cifar10.yaml", "mnist.yaml"]


def test_the_published_iddpm_config_describes_cifar10_uncond_50M_500K():
    """improved-diffusion's CIFAR-10 flags: 128 ch, 3 res blocks, 4 heads, attention at 16 and 8,
    learned sigma, cosine, T=4000, rescale_timesteps; unconditional: 52,546,438 parameters."""
    p = P.load(ROOT / "configs/iddpm-cifar10-published.yaml")
    assert not p.model.class_cond and p.diffusion.rescale_timesteps and p.diffusion.timesteps == 4000
    assert p.train.import_from == "models/published/cifar10_uncond_50M_500K.pt"
    assert n_params(p) == 52_546_438


@pytest.mark.parametrize("path", CONFIGS, ids=lambda c: c.stem)
def test_preset_loads_and_sets_every_section(path):
    import yaml

    P.load(path)  # raises ParamsError on any unknown key, wrong type or value
    assert set(yaml.safe_load(path.read_text())) == {f.name for f in dataclasses.fields(P.Params)}


def test_ddpm_cifar10_is_the_papers_configuration():
    p = P.load(ROOT / "configs/ddpm-cifar10.yaml")
    assert (p.data.source, p.data.image_size, p.data.channels) == ("cifar10", 32, 3)
    assert (p.diffusion.timesteps, p.diffusion.schedule, p.diffusion.prediction, p.diffusion.variance,
            p.diffusion.loss) == (1000, "linear", "eps", "fixed_large", "mse")
    t = p.train
    assert global_batch(t) == 128 and t.lr == 2e-4 and t.warmup_steps == 5000 and t.anneal == "none"
    assert t.ema_rates == [0.9999] and t.grad_clip == 1.0 and t.steps == 800_000
    assert p.model.preset == "ddpm-cifar10" and resolved(p, "dropout") == 0.1
    # Ho et al. 2020: 35.7M parameters (the unconditional model); ours adds an 11 x 512 label table.
    assert n_params(p, num_classes=None) == 35_746_307
    assert n_params(p) == 35_746_307 + 11 * 4 * resolved(p, "channels")


def test_iddpm_cifar10_is_the_papers_configuration():
    p = P.load(ROOT / "configs/iddpm-cifar10.yaml")
    assert (p.data.source, p.data.image_size, p.data.channels) == ("cifar10", 32, 3)
    assert (p.diffusion.timesteps, p.diffusion.schedule, p.diffusion.variance, p.diffusion.loss) == (
        4000, "cosine", "learned_range", "hybrid")
    t = p.train
    assert global_batch(t) == 128 and t.lr == 1e-4 and t.ema_rates == [0.9999] and t.steps == 500_000
    assert t.timestep_sampler == "loss-second-moment"
    assert p.model.preset == "iddpm-cifar10" and resolved(p, "dropout") == 0.3
    assert n_params(p, num_classes=None) == 52_546_438  # the 52.5M of the README, with learned sigma


def test_mnist_is_a_modest_grey_model():
    p = P.load(ROOT / "configs/mnist.yaml")
    assert (p.data.source, p.data.image_size, p.data.channels) == ("mnist", 32, 1)
    assert n_params(p) == 6_949_697


@pytest.mark.parametrize("path", CONFIGS, ids=lambda c: c.stem)
def test_parameter_counts_in_the_comments_are_the_built_models(path):
    import re

    p = P.load(path)
    stated = [int(s.replace(",", "")) for s in re.findall(r"(\d{1,3}(?:,\d{3})+) parameters", path.read_text())]
    assert stated, "state the parameter count in the file"
    assert set(stated) <= {n_params(p), n_params(p, num_classes=None)}
