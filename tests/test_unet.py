"""UNet: preset sizes against the papers, shapes, conditioning contract, no in-place ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ddpmrepro.params import ModelParams
from ddpmrepro.model.unet import PRESETS, SHARED_DEFAULTS, UNet, build_unet


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def small_unet(**kw) -> UNet:
    cfg = dict(image_size=8, in_channels=1, model_channels=16, out_channels=1, num_res_blocks=1,
               attention_resolutions=[4], dropout=0.0, channel_mult=(1, 2), num_classes=10,
               num_head_channels=16, scale_shift_norm=True)
    cfg.update(kw)
    return UNet(**cfg)


# --- presets ------------------------------------------------------------------------------------


def test_presets_have_the_keys_of_model_params():
    keys = set(ModelParams().__dataclass_fields__) - set(ModelParams.NOT_ARCHITECTURE)
    for name, cfg in PRESETS.items():
        assert set(cfg) | set(SHARED_DEFAULTS) == keys, name
    assert set(PRESETS) == set(ModelParams.__dataclass_fields__["preset"].metadata["choices"])


@pytest.mark.parametrize("preset,kw,expected,rel", [
    # Ho et al. 2020, CIFAR-10, unconditional: 35.7M parameters. Ours: 35,746,307.
    ("ddpm-cifar10", dict(image_size=32, in_channels=3, num_classes=None, learn_sigma=False), 35.7e6, 0.01),
    # Nichol & Dhariwal 2021, CIFAR-10 L_hybrid (learned sigma): ~52.5M. Ours: 52,546,438.
    ("iddpm-cifar10", dict(image_size=32, in_channels=3, num_classes=None, learn_sigma=True), 52.5e6, 0.02),
    # The CPU default for 8x8 digits, 10 classes: ours 457,761.
    ("tiny", dict(image_size=8, in_channels=1, num_classes=10, learn_sigma=False), 0.5e6, 0.2),
])
def test_preset_parameter_counts(preset, kw, expected, rel):
    with torch.device("meta"):  # counting needs no memory or init time
        model = build_unet(ModelParams(preset=preset), **kw)
    assert count(model) == pytest.approx(expected, rel=rel)


def test_exact_preset_parameter_counts():
    """The exact values, so that any architecture change is a deliberate one."""
    with torch.device("meta"):
        ddpm = build_unet(ModelParams(preset="ddpm-cifar10"), image_size=32, in_channels=3,
                          num_classes=None, learn_sigma=False)
        iddpm = build_unet(ModelParams(preset="iddpm-cifar10"), image_size=32, in_channels=3,
                           num_classes=None, learn_sigma=True)
        tiny = build_unet(ModelParams(preset="tiny"), image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    assert (count(ddpm), count(iddpm), count(tiny)) == (35_746_307, 52_546_438, 457_761)


def test_overrides_replace_preset_values():
    model = build_unet(ModelParams(preset="tiny", channels=16, channel_mult=[1, 2, 2]), image_size=8,
                       in_channels=1, num_classes=10, learn_sigma=True)
    assert model.model_channels == 16 and model.out_channels == 2
    assert model(torch.randn(2, 1, 8, 8), torch.tensor([0, 5]), torch.tensor([1, 10])).shape == (2, 2, 8, 8)


def test_image_size_not_divisible_by_the_levels_raises():
    with pytest.raises(ValueError, match="image_size 12 is not divisible by 8"):
        build_unet(ModelParams(preset="ddpm-cifar10"), image_size=12, in_channels=3, num_classes=None,
                   learn_sigma=False)


# --- shapes and conditioning ---------------------------------------------------------------------


@pytest.mark.parametrize("channels,size,learn_sigma", [(1, 8, False), (3, 8, True), (1, 16, True), (3, 32, False)])
def test_output_shape(channels, size, learn_sigma):
    model = small_unet(image_size=size, in_channels=channels, out_channels=channels * (2 if learn_sigma else 1),
                       channel_mult=(1, 2, 2), attention_resolutions=[size // 2])
    x = torch.randn(3, channels, size, size)
    out = model(x, torch.tensor([0, 10, 999]), torch.tensor([0, 9, 10]))
    assert out.shape == (3, channels * (2 if learn_sigma else 1), size, size)


def test_output_is_zero_at_init_and_every_res_block_starts_as_identity():
    model = small_unet()
    out = model(torch.randn(2, 1, 8, 8), torch.tensor([3, 4]), torch.tensor([1, 2]))
    assert torch.equal(out, torch.zeros_like(out))
    for name, module in model.named_modules():
        if type(module).__name__ == "ResBlock":
            assert module.out_layers[-1].weight.abs().max() == 0, name


def test_labels_and_time_change_the_output():
    torch.manual_seed(0)
    model = small_unet(dropout=0.0).eval()
    for p in model.parameters():  # leave the zero-init so the output depends on the inputs
        nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 1, 8, 8)
    base = model(x, torch.tensor([5]), torch.tensor([3]))
    assert not torch.allclose(base, model(x, torch.tensor([6]), torch.tensor([3])))
    assert not torch.allclose(base, model(x, torch.tensor([5]), torch.tensor([10])))  # the null label


def test_conditioning_contract():
    cond, uncond = small_unet(), small_unet(num_classes=None)
    x, t = torch.randn(2, 1, 8, 8), torch.tensor([1, 2])
    assert uncond.label_embed is None and cond.label_embed.num_embeddings == 11  # + the null label
    assert uncond(x, t).shape == (2, 1, 8, 8)
    with pytest.raises(ValueError, match="labels"):
        cond(x, t)
    with pytest.raises(ValueError, match="unconditional"):
        uncond(x, t, torch.tensor([0, 1]))


def test_submodule_names_read_well():
    names = {n for n, _ in small_unet().named_modules()}
    for expected in ["time_embed", "label_embed", "input_blocks.0", "middle_block", "output_blocks.0", "out"]:
        assert expected in names


# --- no in-place ops ---------------------------------------------------------------------------------


def test_no_inplace_modules_and_module_outputs_never_modified_later():
    """The introspection hooks keep module outputs; an in-place op downstream would change them."""
    model = small_unet(dropout=0.1).train()
    assert not [n for n, m in model.named_modules() if getattr(m, "inplace", False)]
    seen = []
    handles = [m.register_forward_hook(lambda m, i, o: seen.append((o, o._version)))
               for m in model.modules() if m is not model]
    out = model(torch.randn(2, 1, 8, 8), torch.tensor([1, 2]), torch.tensor([1, 2]))
    out.square().sum().backward()
    for h in handles:
        h.remove()
    assert seen and all(o._version == v for o, v in seen)
