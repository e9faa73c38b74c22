"""IDDPM's super-resolution UNet (improved-diffusion `SuperResModel`), and what it is trained on.

The network is our UNet with 2C input channels: the noisy high-resolution image x_t and the
low-resolution image upsampled bilinearly to x_t's size (`align_corners=False`, as IDDPM),
concatenated on channels. Labels and classifier-free guidance are the base model's. With
conditioning augmentation on (Cascaded Diffusion Models, Ho et al. 2021), the low-res input
carries Gaussian noise whose standard deviation `aug_level` the network is told through one more
embedding, added to the timestep's: `noise_aug: 0` builds exactly IDDPM's model.

Pure: nothing of DDP, autocast, EMA or logging (docs/SUPERRES.md says how it is trained and sampled).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .unet import UNet, timestep_embedding, unet_arguments

# The augmentation level is a std in the [-1, 1] image range; it is embedded like a timestep
# after scaling by this, so that levels 0..1 span the sinusoids' range as t = 0..1000 does.
AUG_LEVEL_SCALE = 1000.0


class SuperResUNet(UNet):
    """`UNet` conditioned on a low-resolution image: forward(x, t, y, low_res[, aug_level])."""

    def __init__(self, *, in_channels: int, noise_aug: bool = False, **kwargs):
        """
        :param in_channels: image channels C (the network itself takes 2C).
        :param noise_aug: add an embedding of the low-res input's noise level (CDM's conditioning
            augmentation); False: IDDPM's SuperResModel exactly.
        :param kwargs: the `UNet` arguments.
        """
        super().__init__(in_channels=2 * in_channels, **kwargs)
        self.image_channels = in_channels
        emb_ch = 4 * self.model_channels
        self.aug_embed = nn.Sequential(
            nn.Linear(self.model_channels, emb_ch), nn.SiLU(), nn.Linear(emb_ch, emb_ch)
        ) if noise_aug else None

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
                low_res: torch.Tensor | None = None, aug_level: torch.Tensor | None = None) -> torch.Tensor:
        """
        :param x: (B, C, H, W) noisy high-resolution images.
        :param t: (B,) timesteps.
        :param y: (B,) labels (num_classes = null), or None for an unconditional model.
        :param low_res: (B, C, h, w) low-resolution images in [-1, 1] (noised when augmented).
        :param aug_level: (B,) the std of the noise in `low_res` (required with noise_aug, else ignored).
        :return: (B, out_channels, H, W).
        """
        if low_res is None:
            raise ValueError("a super-resolution UNet needs low_res, the (B, C, h, w) image to upsample")
        up = F.interpolate(low_res, size=x.shape[-2:], mode="bilinear", align_corners=False)  # (B, C, H, W)
        extra = None
        if self.aug_embed is not None:
            if aug_level is None:
                raise ValueError("this super-resolution UNet was trained with noise augmentation; pass aug_level")
            extra = self.aug_embed(timestep_embedding(aug_level.float() * AUG_LEVEL_SCALE, self.model_channels))
        return super().forward(torch.cat([x, up], dim=1), t, y, emb_extra=extra)


def build_superres(model_params, superres_params, *, image_size: int, in_channels: int, num_classes: int | None,
                   learn_sigma: bool) -> SuperResUNet:
    """The upsampler of `PRESETS[model_params.preset]` at `image_size`: the base UNet's construction
    (`unet_arguments`: every `model:` key, `class_cond` included) with 2C inputs."""
    args = unet_arguments(model_params, image_size=image_size, in_channels=in_channels, num_classes=num_classes,
                          learn_sigma=learn_sigma)
    return SuperResUNet(**args, noise_aug=superres_params.noise_aug > 0)


def downsample(x: torch.Tensor, side: int) -> torch.Tensor:
    """Area downsampling to side x side (IDDPM's `F.interpolate(mode="area")`): the mean of each
    block of pixels when the factor is an integer. Deterministic."""
    return F.interpolate(x.float(), size=(side, side), mode="area")


def low_res_input(x0: torch.Tensor, side: int, quantise: bool) -> torch.Tensor:
    """The low-res conditioning image of high-res images x0 in [-1, 1]: area-downsampled, and
    with `quantise` rounded to the 256 levels of a uint8 image, which is what sampling feeds
    (a base run's samples, or test images downsampled and stored as uint8). (B, C, side, side)."""
    low = downsample(x0, side)
    if quantise:
        low = ((low + 1) * 127.5).round().clamp(0, 255) / 127.5 - 1
    return low


def augment(low: torch.Tensor, level: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """CDM's Gaussian conditioning augmentation: low + level * noise, per example. (The image is
    not clipped: the network is told the level and learns to look through the noise.)"""
    return low + level.to(low.dtype)[:, None, None, None] * noise


def project(x: torch.Tensor, low: torch.Tensor, iters: int = 40) -> torch.Tensor:
    """The image nearest to `x` (in L2) among those in [-1, 1] whose area-downsampling is `low`.

    Area downsampling by an integer factor k takes the mean of each k x k block, so the constraint
    is one mean per block, and the nearest image shifts each block by one constant c and clips it:
    clip(x + c), with c such that the clipped block's mean is the low-res pixel (the Euclidean
    projection onto a box intersected with a hyperplane has this form). Without clipping this is
    x + up(low - down(x)) with nearest-neighbour `up`: the output's low frequencies replaced by the
    input's, its detail kept. The block mean of clip(x + c) grows with c, so c is found by
    bisection, per block, in float64 (40 halvings of [-2, 2]: below float32's resolution).

    :param x: (B, C, H, W) images in [-1, 1].
    :param low: (B, C, h, w) low-res images in [-1, 1], with H = k h and W = k w.
    :return: (B, C, H, W) in [-1, 1], with `downsample(result, h)` equal to `low` (to float precision).
    """
    (b, ch, hh, ww), (h, w) = x.shape, low.shape[-2:]
    if hh % h or ww % w:
        raise ValueError(f"project: {hh}x{ww} is not a whole multiple of {h}x{w}")
    blocks = x.double().reshape(b, ch, h, hh // h, w, ww // w)       # (B, C, h, k, w, k)
    target = low.double()[:, :, :, None, :, None]                    # (B, C, h, 1, w, 1)
    lo, hi = torch.full_like(target, -2.0), torch.full_like(target, 2.0)  # c = -2: all -1; c = 2: all 1
    for _ in range(iters):
        c = (lo + hi) / 2
        below = (blocks + c).clamp(-1, 1).mean(dim=(3, 5), keepdim=True) < target
        lo, hi = torch.where(below, c, lo), torch.where(below, hi, c)
    out = (blocks + (lo + hi) / 2).clamp(-1, 1)
    return out.reshape(b, ch, hh, ww).to(x.dtype)


def bicubic_upsample(low_res_uint8: torch.Tensor, side: int) -> torch.Tensor:
    """The baseline: bicubic upsampling of uint8 images to side x side, rounded back to uint8."""
    x = F.interpolate(low_res_uint8.float(), size=(side, side), mode="bicubic", align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8)


__all__ = ["SuperResUNet", "build_superres", "downsample", "low_res_input", "augment", "project", "bicubic_upsample",
           "AUG_LEVEL_SCALE"]
