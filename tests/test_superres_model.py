"""The super-resolution UNet against improved-diffusion's own `SuperResModel` (the code of
improved-diffusion@1bc7bbb, shipped unchanged in the PyPI package improved-diffusion-for-SMLM,
a test-only extra), on the same randomised weights; and the low-res pipeline's pieces."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddpmrepro import params as P
from ddpmrepro.model.superres import SuperResUNet, bicubic_upsample, build_superres, downsample, project
from ddpmrepro.model.unet import AttentionBlock

oracle = pytest.importorskip("improved_diffusion_for_SMLM.improved_diffusion.unet")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors, one thread


def to_improved_diffusion(model: torch.nn.Module) -> dict:
    """Our state dict under improved-diffusion's names. Their ResBlock keeps the second norm as
    out_layers.0 (ours: out_norm) and its conv as out_layers.3; their qkv rows are [q|k|v] per
    head, ours q|k|v over all heads; their label table counts our null label as a class."""
    heads = {n: m.num_heads for n, m in model.named_modules() if isinstance(m, AttentionBlock)}
    out = {}
    for k, v in model.state_dict().items():
        name = (k.replace("label_embed.", "label_emb.").replace(".skip.", ".skip_connection.")
                .replace(".out_norm.", ".out_layers.0.").replace(".out_layers.2.", ".out_layers.3."))
        if ".qkv." in k:
            h = heads[k.rsplit(".qkv.", 1)[0]]
            v = v.reshape(3, h, v.shape[0] // 3 // h, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
        out[name] = v
    return out


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every weight random: our zero-initialised convs would make a fresh model output 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)


@pytest.mark.parametrize("scale_shift_norm, learn_sigma, classes", [(True, True, 3), (False, False, None)])
def test_forward_equals_improved_diffusions_superresmodel_on_random_weights(scale_shift_norm, learn_sigma, classes):
    C = 3
    ours = SuperResUNet(image_size=16, in_channels=C, model_channels=32, out_channels=2 * C if learn_sigma else C,
                        num_res_blocks=2, attention_resolutions=[8, 4], dropout=0.0, channel_mult=[1, 2, 2],
                        num_classes=classes, num_head_channels=32, scale_shift_norm=scale_shift_norm).eval()
    randomise(ours)
    # attention at sides 8 and 4 of 16 = downsampling rates 2 and 4; 64 channels / 32 = 2 heads
    theirs = oracle.SuperResModel(C, 32, 2 * C if learn_sigma else C, 2, attention_resolutions=(2, 4), dropout=0.0,
                                  channel_mult=(1, 2, 2), num_classes=None if classes is None else classes + 1,
                                  num_heads=2, use_scale_shift_norm=scale_shift_norm).eval()
    theirs.load_state_dict(to_improved_diffusion(ours), strict=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, C, 16, 16, generator=g)
    low = torch.rand(4, C, 8, 8, generator=g) * 2 - 1
    t = torch.tensor([0, 3, 400, 999])
    kw = {} if classes is None else {"y": torch.tensor([0, 1, 2, 3])}  # 3 = the null label
    with torch.no_grad():
        a = ours(x, t, kw.get("y"), low_res=low)
        b = theirs(x, t, low_res=low, **kw)
    assert b.abs().mean() > 0.1  # a real output, not the zero of a fresh model
    assert ((a - b).norm() / b.norm()).item() <= 1e-5
    assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item() * 10
    # and the low-res image matters: another one changes the output
    with torch.no_grad():
        assert not torch.allclose(ours(x, t, kw.get("y"), low_res=low.flip(-1)), a)


def test_noise_augmented_model_needs_and_uses_its_level():
    mp = P.ModelParams(preset="tiny", channels=16, channel_mult=[1, 2], num_res_blocks=1, attention_resolutions=[4],
                       num_head_channels=16)
    model = build_superres(mp, P.SuperresParams(low_res=4, noise_aug=0.2), image_size=8, in_channels=1,
                           num_classes=2, learn_sigma=False).eval()
    randomise(model)
    x, low, t, y = torch.randn(2, 1, 8, 8), torch.rand(2, 1, 4, 4) * 2 - 1, torch.tensor([1, 5]), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="aug_level"):
        model(x, t, y, low_res=low)
    with torch.no_grad():
        a = model(x, t, y, low_res=low, aug_level=torch.tensor([0.0, 0.0]))
        b = model(x, t, y, low_res=low, aug_level=torch.tensor([0.1, 0.1]))
    assert not torch.allclose(a, b)
    plain = build_superres(mp, P.SuperresParams(low_res=4, noise_aug=0.0), image_size=8, in_channels=1,
                           num_classes=2, learn_sigma=False)
    assert set(model.state_dict()) - set(plain.state_dict()) == {f"aug_embed.{i}.{w}" for i in (0, 2)
                                                                 for w in ("weight", "bias")}


def test_area_downsampling_is_the_block_mean_and_deterministic():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (3, 2, 28, 28), generator=g, dtype=torch.uint8)
    low = downsample(x, 14)
    blocks = x.double().reshape(3, 2, 14, 2, 14, 2).mean(dim=(3, 5))
    assert torch.allclose(low.double(), blocks, atol=1e-4)
    assert torch.equal(downsample(x, 14), low)


def test_bicubic_upsampling_keeps_constant_images_and_rounds_to_uint8():
    flat = torch.full((1, 1, 7, 7), 93, dtype=torch.uint8)
    assert torch.equal(bicubic_upsample(flat, 14), torch.full((1, 1, 14, 14), 93, dtype=torch.uint8))
    ramp = torch.arange(0, 250, 10, dtype=torch.uint8).reshape(1, 1, 5, 5)
    up = bicubic_upsample(ramp, 10)
    ref = F.interpolate(ramp.float(), size=(10, 10), mode="bicubic", align_corners=False).round().clamp(0, 255)
    assert up.dtype == torch.uint8 and torch.equal(up.float(), ref)


def test_projection_is_the_nearest_consistent_image_in_range():
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(3, 2, 12, 12, generator=g) * 2.4 - 1.2).clamp(-1, 1)  # many pixels at -1 and 1
    low = torch.rand(3, 2, 4, 4, generator=g) * 2 - 1
    low[0, 0, 0, 0], low[0, 0, 0, 1] = -1.0, 1.0  # the range's ends: the whole block clipped
    out = project(x, low)
    assert out.min() >= -1 and out.max() <= 1
    assert torch.allclose(downsample(out, 4), low, atol=1e-6)
    assert torch.allclose(project(out, low), out, atol=1e-6)  # idempotent
    # nearest: no other consistent image in range is closer (consistent ones made from other images)
    for seed in range(5):
        other = project(torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1, low)
        assert (out - x).norm() <= (other - x).norm() + 1e-6
    # where nothing clips it is x + up(low - down(x)), nearest-neighbour up: the low frequencies swapped
    small = x * 0.1
    mid = low * 0.5
    up = F.interpolate(mid - downsample(small, 4), scale_factor=3, mode="nearest")
    assert torch.allclose(project(small, mid), small + up, atol=1e-6)
    with pytest.raises(ValueError, match="whole multiple"):
        project(torch.zeros(1, 1, 10, 10), torch.zeros(1, 1, 4, 4))
