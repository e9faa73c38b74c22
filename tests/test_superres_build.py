"""The upsampler is built from the same `model:` keys as the base model (issue 31, item 1): it is the
base UNet with 2C input channels, whatever the keys say, and every key reaches it."""
import dataclasses

import pytest
import torch

from ddpmrepro.params import ModelParams, SuperresParams
from ddpmrepro.model.superres import build_superres
from ddpmrepro.model.unet import build_unet

SHAPE = dict(image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
# One value per `model:` key that differs from the tiny preset's and from the UNet's defaults.
CHANGED = {
    "channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [8],
    "num_head_channels": 8, "dropout": 0.3, "scale_shift_norm": False, "time_embedding": "ddpm",
    "downsample_padding": "asymmetric", "norm_eps": 1e-6, "num_heads": 2, "num_heads_upsample": 4,
    "resblock_updown": True,
    "class_cond": False,
}
PLAIN = (int, float, str, bool, tuple, list, type(None))


def signature(model: torch.nn.Module, *, skip_root=("image_channels", "in_channels")) -> list:
    """Every module's type and plain attributes (heads, eps, p, padding, embedding kind, ...) and
    every tensor's shape: what two networks built from the same keys must share."""
    out = []
    for name, m in model.named_modules():
        if name.startswith("aug_embed") or name == "input_blocks.0.0":  # the upsampler's own parts
            continue
        attrs = {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, PLAIN)
                 and not (name == "" and k in skip_root)}
        out.append((name, type(m).__name__ if name else "root", sorted(attrs.items(), key=str)))
    out += [(k, tuple(v.shape)) for k, v in model.state_dict().items() if not k.startswith(("aug_embed", "input_blocks.0.0"))]
    return out


def test_every_model_key_is_covered_here():
    keys = {f.name for f in dataclasses.fields(ModelParams)} - {"preset", "grad_checkpoint"}
    assert keys == set(CHANGED), "add the new model: key to CHANGED"


@pytest.mark.parametrize("key", sorted(CHANGED))
def test_every_model_key_changes_the_upsampler_as_it_changes_the_base_model(key):
    default, changed = ModelParams(), ModelParams(**{key: CHANGED[key]})
    sr = SuperresParams(low_res=4)
    base0, base1 = build_unet(default, **SHAPE), build_unet(changed, **SHAPE)
    up0, up1 = build_superres(default, sr, **SHAPE), build_superres(changed, sr, **SHAPE)
    assert signature(base0) != signature(base1), f"{key} does not change the base model"
    # the upsampler is the base model with 2C inputs, with and without the key
    assert signature(up1) == signature(base1)
    assert signature(up0) == signature(base0)
    assert up1.input_blocks[0][0].in_channels == 2 * SHAPE["in_channels"]


def test_num_heads_reaches_the_upsampler():
    """The report's reproduction: num_heads: 2 gave the upsampler 1 head per layer."""
    up = build_superres(ModelParams(num_heads=2), SuperresParams(low_res=4), **SHAPE)
    heads = {m.num_heads for m in up.modules() if hasattr(m, "num_heads") and type(m).__name__ != "SuperResUNet"}
    assert heads == {2}
