"""The class-conditional UNet of DDPM (Ho et al. 2020) and IDDPM (Nichol & Dhariwal 2021).

One pure `nn.Module`: it knows nothing of DDP, autocast, EMA or logging, and uses no in-place
activations (the introspection code hooks module outputs). Submodules are named so that a
parameter table reads well: `time_embed`, `label_embed`, `input_blocks.{i}`, `middle_block`,
`output_blocks.{i}`, `out`.

Layout (the DDPM/IDDPM UNet): a 3x3 input conv, then per resolution level `num_res_blocks`
residual blocks (followed by self-attention where the feature map's side is listed in
`attention_resolutions`) and a strided-conv downsample between levels; a middle block of
res-attention-res; the mirror image on the way up, with one extra residual block per level that
consumes the skip from the downsample, and nearest-neighbour+conv upsampling; then
GroupNorm-SiLU-conv to the output.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Architecture kwargs per preset, keyed as in `ModelParams` (params.yaml `model:` section).
PRESETS: dict[str, dict] = {
    # Ho et al. 2020, CIFAR-10: 35.7M params. One attention head (256 channels at 16x16 and in the
    # middle), additive time conditioning. Use with diffusion variance fixed_* and loss mse.
    "ddpm-cifar10": dict(
        channels=128, channel_mult=[1, 2, 2, 2], num_res_blocks=2, attention_resolutions=[16],
        num_head_channels=256, dropout=0.1, scale_shift_norm=False,
    ),
    # Nichol & Dhariwal 2021, CIFAR-10 L_hybrid: ~52.5M params with learned sigma. Four heads of
    # 64 channels, scale-shift norm (AdaGN). Use with variance learned_range and loss hybrid.
    "iddpm-cifar10": dict(
        channels=128, channel_mult=[1, 2, 2, 2], num_res_blocks=3, attention_resolutions=[16, 8],
        num_head_channels=64, dropout=0.3, scale_shift_norm=True,
    ),
    # The CPU default: 8x8 single-channel digits, ~0.46M params. Two levels (8x8, 4x4) at full
    # width rather than three widening ones: (1, 2, 2) would be 1.7M params and twice as slow.
    "tiny": dict(
        channels=32, channel_mult=[1, 1], num_res_blocks=2, attention_resolutions=[4],
        num_head_channels=32, dropout=0.1, scale_shift_norm=True,
    ),
}

# Keys every preset shares (this UNet's own choices); other values reproduce published models
# exactly (docs/MODELS.md): DDPM's TF release needs time_embedding "ddpm", downsample_padding
# "asymmetric" and norm_eps 1e-6; improved-diffusion's num_heads is a fixed head count per layer.
SHARED_DEFAULTS: dict = dict(time_embedding="iddpm", downsample_padding="symmetric", norm_eps=1e-5, num_heads=None,
                             num_heads_upsample=None, resblock_updown=False)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0, kind: str = "iddpm") -> torch.Tensor:
    """Sinusoidal embedding of (possibly non-integer) timesteps, as in the Transformer.

    :param t: (B,) timesteps; the model embeds whatever index it is given.
    :param dim: embedding width (an odd width gets a zero last column).
    :param max_period: the longest wavelength.
    :param kind: "iddpm": frequencies max_period^(-i/half), [cos | sin] (improved-diffusion);
        "ddpm": max_period^(-i/(half-1)), [sin | cos], as the TF release of Ho et al. (and
        diffusers' `flip_sin_to_cos=False, freq_shift=1`) computes it.
    :return: (B, dim) float32 embedding.
    """
    half = dim // 2
    denominator = half - 1 if kind == "ddpm" else half
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / denominator)
    args = t.float()[:, None] * freqs[None]  # (B, half)
    parts = [torch.sin(args), torch.cos(args)] if kind == "ddpm" else [torch.cos(args), torch.sin(args)]
    emb = torch.cat(parts, dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def group_norm(channels: int, eps: float = 1e-5) -> nn.GroupNorm:
    """GroupNorm with 32 groups, or the largest count below 32 that divides `channels` (small widths).
    `eps` 1e-5 is torch's default; the TF release of DDPM used 1e-6."""
    groups = next(g for g in range(min(32, channels), 0, -1) if channels % g == 0)
    return nn.GroupNorm(groups, channels, eps=eps)


def zero_module(module: nn.Module) -> nn.Module:
    """Zeroes a module's parameters, so a residual branch starts as the identity (IDDPM)."""
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


class ResBlock(nn.Module):
    """Residual block conditioned on the (time + label) embedding.

    Two 3x3 convs, each after GroupNorm+SiLU; dropout before the second. The embedding enters
    either additively after the first conv (DDPM) or as a scale and shift of the second
    normalisation, `norm(h) * (1 + scale) + shift` (IDDPM's AdaGN, `scale_shift_norm=True`).
    """

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, dropout: float,
                 scale_shift_norm: bool, norm_eps: float = 1e-5, updown: str | None = None):
        """
        :param in_channels: input feature channels.
        :param out_channels: output feature channels (a 1x1 conv matches the skip if they differ).
        :param emb_channels: width of the conditioning embedding.
        :param dropout: dropout probability before the second conv.
        :param scale_shift_norm: AdaGN conditioning if True, additive otherwise.
        :param norm_eps: GroupNorm epsilon.
        :param updown: "down" or "up": also halve (2x2 average) or double (nearest) the resolution,
            on both paths, between the first SiLU and conv (ADM's `resblock_updown`); None: neither.
        """
        super().__init__()
        self.scale_shift_norm, self.updown = scale_shift_norm, updown
        self.in_layers = nn.Sequential(
            group_norm(in_channels, norm_eps), nn.SiLU(), nn.Conv2d(in_channels, out_channels, 3, padding=1)
        )
        # AdaGN needs a scale and a shift per channel, hence twice the width.
        self.emb_layers = nn.Sequential(
            nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels if scale_shift_norm else out_channels)
        )
        self.out_norm = group_norm(out_channels, norm_eps)
        self.out_layers = nn.Sequential(
            nn.SiLU(), nn.Dropout(dropout),
            # Zero-init: the block starts as the identity, which keeps deep UNets stable early on.
            zero_module(nn.Conv2d(out_channels, out_channels, 3, padding=1)),
        )
        self.skip = nn.Identity() if in_channels == out_channels else nn.Conv2d(in_channels, out_channels, 1)

    def _resample(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, 2) if self.updown == "down" else F.interpolate(x, scale_factor=2, mode="nearest")

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if self.updown is None:
            h = self.in_layers(x)  # (B, C_out, H, W)
        else:  # (B, C_out, H/2 or 2H, W/2 or 2W)
            h = self.in_layers[2](self._resample(self.in_layers[1](self.in_layers[0](x))))
            x = self._resample(x)
        e = self.emb_layers(emb)[:, :, None, None]  # (B, C_out or 2*C_out, 1, 1)
        if self.scale_shift_norm:
            scale, shift = e.chunk(2, dim=1)
            h = self.out_norm(h) * (1 + scale) + shift
        else:
            h = self.out_norm(h + e)
        return self.skip(x) + self.out_layers(h)


class AttentionBlock(nn.Module):
    """Multi-head self-attention over the spatial positions of a feature map, with a residual."""

    def __init__(self, channels: int, num_head_channels: int, norm_eps: float = 1e-5, num_heads: int | None = None):
        """
        :param channels: feature channels; a multiple of `num_head_channels`, or fewer (one head).
        :param num_head_channels: channels per head (heads = channels // num_head_channels).
        :param norm_eps: GroupNorm epsilon.
        :param num_heads: if given, this many heads whatever the width (improved-diffusion's
            `num_heads`); it replaces `num_head_channels`.
        """
        super().__init__()
        if num_heads is not None:
            if channels % num_heads:
                raise ValueError(f"attention over {channels} channels cannot be split into {num_heads} heads; "
                                 f"choose num_heads dividing {channels}")
            num_head_channels = channels // num_heads
        # A narrow override of a wide preset (e.g. channels=32 with 256-channel heads) gets one head.
        num_head_channels = min(num_head_channels, channels)
        if channels % num_head_channels:
            raise ValueError(
                f"attention over {channels} channels cannot be split into heads of {num_head_channels}; "
                f"choose num_head_channels dividing {channels}"
            )
        self.num_heads = channels // num_head_channels
        self.norm = group_norm(channels, norm_eps)
        self.qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.proj_out = zero_module(nn.Conv1d(channels, channels, 1))

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        b, c, hgt, wid = x.shape
        qkv = self.qkv(self.norm(x).reshape(b, c, hgt * wid))  # (B, 3C, L)
        # (B, heads, L, head_ch) for each of q, k, v
        q, k, v = qkv.reshape(b, 3, self.num_heads, c // self.num_heads, hgt * wid).permute(1, 0, 2, 4, 3)
        h = F.scaled_dot_product_attention(q, k, v)  # (B, heads, L, head_ch)
        h = h.permute(0, 1, 3, 2).reshape(b, c, hgt * wid)
        return x + self.proj_out(h).reshape(b, c, hgt, wid)


class Downsample(nn.Module):
    """Halves the resolution with a strided 3x3 conv (DDPM)."""

    def __init__(self, channels: int, asymmetric_padding: bool = False):
        """
        :param asymmetric_padding: pad one row and column at the bottom and right only, then
            convolve unpadded (TF's "SAME" padding of a stride-2 conv, as the DDPM release does);
            default: one pixel on every side (improved-diffusion). Same weights, other outputs.
        """
        super().__init__()
        self.asymmetric_padding = asymmetric_padding
        self.op = nn.Conv2d(channels, channels, 3, stride=2, padding=0 if asymmetric_padding else 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        if self.asymmetric_padding:
            x = F.pad(x, (0, 1, 0, 1))
        return self.op(x)


class Upsample(nn.Module):
    """Doubles the resolution by nearest-neighbour upsampling and a 3x3 conv (DDPM)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor | None = None) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class EmbedSequential(nn.Sequential):
    """A Sequential whose layers take the embedding too (plain layers ignore it).

    With `grad_checkpoint` (set by the UNet), each residual and attention block keeps only its
    inputs for backward and recomputes its activations there (`torch.utils.checkpoint`,
    non-reentrant). Non-reentrant because it restores the RNG state for the recompute, so dropout
    draws the same mask and the gradients are bitwise those without checkpointing, and because
    backward still runs through the forward pass's own graph: a tensor hook registered in the
    forward fires once, whatever the recompute does (improved-diffusion's helper does neither).
    """

    grad_checkpoint = False

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        for layer in self:
            if self.grad_checkpoint and torch.is_grad_enabled() and isinstance(layer, (ResBlock, AttentionBlock)):
                x = checkpoint(layer, x, emb, use_reentrant=False)
            elif isinstance(layer, (ResBlock, AttentionBlock, Downsample, Upsample)):
                x = layer(x, emb)
            else:
                x = layer(x)
        return x


class UNet(nn.Module):
    """Class-conditional UNet predicting eps (or x0), and optionally the variance interpolant v.

    Labels in [0, num_classes) are classes; `num_classes` itself is the null label used for
    classifier-free guidance, so the label table has num_classes + 1 rows.
    """

    # The blocks the network is mostly made of, a few distinct shapes repeated: what regional
    # compilation compiles (runtime/compilation.py, `train.compile: blocks`).
    repeated_blocks: tuple[type[nn.Module], ...] = (ResBlock, AttentionBlock)

    def __init__(self, image_size: int, in_channels: int, model_channels: int, out_channels: int,
                 num_res_blocks: int, attention_resolutions, dropout: float, channel_mult,
                 num_classes: int | None, num_head_channels: int, scale_shift_norm: bool, *,
                 time_embedding: str = "iddpm", downsample_padding: str = "symmetric", norm_eps: float = 1e-5,
                 num_heads: int | None = None, num_heads_upsample: int | None = None, resblock_updown: bool = False,
                 grad_checkpoint: bool = False):
        """
        :param image_size: side of the (square) input in pixels; 2**(len(channel_mult)-1) must divide it.
        :param in_channels: image channels (1 or 3).
        :param model_channels: base width; level i has model_channels * channel_mult[i] channels.
        :param out_channels: in_channels, or 2 * in_channels when the variance is learned.
        :param num_res_blocks: residual blocks per level on the way down (one more on the way up).
        :param attention_resolutions: feature-map sides (pixels) at which to add self-attention,
            e.g. [16] for 32x32 CIFAR; sides that never occur are ignored.
        :param dropout: dropout in every residual block.
        :param channel_mult: width multiplier per level.
        :param num_classes: number of classes, or None for an unconditional model (y must be None).
        :param num_head_channels: channels per attention head.
        :param scale_shift_norm: IDDPM AdaGN conditioning if True, DDPM additive otherwise.
        :param time_embedding: "iddpm" or "ddpm" (see `timestep_embedding`).
        :param downsample_padding: "symmetric" (1 pixel each side) or "asymmetric" (TF's 0,1,0,1).
        :param norm_eps: epsilon of every GroupNorm.
        :param num_heads: a fixed number of heads per attention layer (replaces num_head_channels).
        :param num_heads_upsample: a fixed number of heads in the up path's attention layers (the
            output blocks; improved-diffusion's `num_heads_upsample`); None: as the other layers.
        :param resblock_updown: resample with residual blocks (ADM) instead of strided/upsampling convs.
        The last six default to this UNet's own choices; the others reproduce published models.
        :param grad_checkpoint: recompute each residual/attention block's activations in backward
            instead of keeping them (less memory, about one more forward per step, same numbers).
        """
        super().__init__()
        if time_embedding not in ("iddpm", "ddpm") or downsample_padding not in ("symmetric", "asymmetric"):
            raise ValueError(f"time_embedding must be iddpm|ddpm and downsample_padding symmetric|asymmetric, got "
                             f"{time_embedding!r}, {downsample_padding!r}")
        self.time_embedding_kind = time_embedding
        factor = 2 ** (len(channel_mult) - 1)
        if image_size % factor:
            raise ValueError(
                f"image_size {image_size} is not divisible by {factor}, which {len(channel_mult)} levels "
                f"(channel_mult={list(channel_mult)}) need; use fewer levels or another image size"
            )
        self.image_size, self.in_channels, self.out_channels = image_size, in_channels, out_channels
        self.model_channels, self.num_classes = model_channels, num_classes
        self.channel_mult, self.num_res_blocks = list(channel_mult), num_res_blocks  # read by interop's mappings
        attention_resolutions = set(attention_resolutions)
        emb_ch = 4 * model_channels

        self.time_embed = nn.Sequential(
            nn.Linear(model_channels, emb_ch), nn.SiLU(), nn.Linear(emb_ch, emb_ch)
        )
        self.label_embed = nn.Embedding(num_classes + 1, emb_ch) if num_classes is not None else None

        def res(cin: int, cout: int, updown: str | None = None) -> ResBlock:
            return ResBlock(cin, cout, emb_ch, dropout, scale_shift_norm, norm_eps, updown)

        def attn(c: int, up: bool = False) -> AttentionBlock:
            heads = num_heads_upsample if up and num_heads_upsample is not None else num_heads
            return AttentionBlock(c, num_head_channels, norm_eps, heads)

        # Down path: remember each block's output width, for the skips the up path concatenates.
        ch, side = model_channels, image_size
        self.input_blocks = nn.ModuleList([EmbedSequential(nn.Conv2d(in_channels, ch, 3, padding=1))])
        skip_chs = [ch]
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers = [res(ch, model_channels * mult)]
                ch = model_channels * mult
                if side in attention_resolutions:
                    layers.append(attn(ch))
                self.input_blocks.append(EmbedSequential(*layers))
                skip_chs.append(ch)
            if level != len(channel_mult) - 1:
                self.input_blocks.append(EmbedSequential(
                    res(ch, ch, "down") if resblock_updown else Downsample(ch, downsample_padding == "asymmetric")))
                skip_chs.append(ch)
                side //= 2

        self.middle_block = EmbedSequential(res(ch, ch), attn(ch), res(ch, ch))

        # Up path: num_res_blocks + 1 blocks per level, each eating one skip.
        self.output_blocks = nn.ModuleList()
        for level, mult in reversed(list(enumerate(channel_mult))):
            for i in range(num_res_blocks + 1):
                layers = [res(ch + skip_chs.pop(), model_channels * mult)]
                ch = model_channels * mult
                if side in attention_resolutions:
                    layers.append(attn(ch, up=True))
                if level and i == num_res_blocks:
                    layers.append(res(ch, ch, "up") if resblock_updown else Upsample(ch))
                    side *= 2
                self.output_blocks.append(EmbedSequential(*layers))

        self.out = nn.Sequential(
            group_norm(ch, norm_eps), nn.SiLU(), zero_module(nn.Conv2d(ch, out_channels, 3, padding=1))
        )
        for m in self.modules():
            if isinstance(m, EmbedSequential):
                m.grad_checkpoint = grad_checkpoint

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
                emb_extra: torch.Tensor | None = None) -> torch.Tensor:
        """
        :param x: (B, C, H, W) noisy images.
        :param t: (B,) timesteps, embedded as given: respaced samplers pass the original indices
            (int64), or t * 1000 / T (float) under `diffusion.rescale_timesteps`.
        :param y: (B,) int64 labels in [0, num_classes] (num_classes = null label), or None for an
            unconditional model.
        :param emb_extra: (B, 4 * model_channels) added to the conditioning embedding (the
            super-resolution model's noise-augmentation level), or None.
        :return: (B, out_channels, H, W).
        """
        if (y is None) != (self.label_embed is None):
            raise ValueError(
                "labels y are required by a class-conditional UNet (pass num_classes as the null label)"
                if y is None else "this UNet is unconditional (num_classes=None); pass y=None"
            )
        emb = self.time_embed(timestep_embedding(t, self.model_channels, kind=self.time_embedding_kind))  # (B, 4ch)
        if y is not None:
            emb = emb + self.label_embed(y)
        if emb_extra is not None:
            emb = emb + emb_extra
        h, skips = x, []
        for block in self.input_blocks:
            h = block(h, emb)
            skips.append(h)
        h = self.middle_block(h, emb)
        for block in self.output_blocks:
            h = block(torch.cat([h, skips.pop()], dim=1), emb)
        return self.out(h)


def unet_arguments(model_params, *, image_size: int, in_channels: int, num_classes: int | None,
                   learn_sigma: bool) -> dict:
    """The `UNet` arguments of `PRESETS[model_params.preset]` with the keys set in params.yaml overriding:
    the one place where `model:` keys become a network, for the base model and the upsampler alike.

    :param model_params: a `ddpmrepro.params.ModelParams`.
    :param image_size: image side in pixels.
    :param in_channels: image channels.
    :param num_classes: classes (the null label is added), or None for unconditional; ignored
        (unconditional) when `model_params.class_cond` is false.
    :param learn_sigma: output 2 * in_channels (eps and the variance interpolant v).
    """
    if model_params.preset not in PRESETS:
        raise ValueError(f"unknown model preset {model_params.preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = {**SHARED_DEFAULTS, **PRESETS[model_params.preset], **model_params.overrides()}
    return dict(
        image_size=image_size, in_channels=in_channels, model_channels=cfg["channels"],
        out_channels=2 * in_channels if learn_sigma else in_channels,
        num_res_blocks=cfg["num_res_blocks"], attention_resolutions=cfg["attention_resolutions"],
        dropout=cfg["dropout"], channel_mult=cfg["channel_mult"],
        num_classes=num_classes if getattr(model_params, "class_cond", True) else None,
        num_head_channels=cfg["num_head_channels"], scale_shift_norm=cfg["scale_shift_norm"],
        # Options that reproduce published models (docs/MODELS.md); unset: this UNet's defaults.
        **{k: cfg[k] for k in SHARED_DEFAULTS},
        grad_checkpoint=model_params.grad_checkpoint,
    )


def build_unet(model_params, *, image_size: int, in_channels: int, num_classes: int | None,
               learn_sigma: bool) -> UNet:
    """Builds the UNet of `PRESETS[model_params.preset]`, with the keys set in params.yaml overriding
    (arguments: `unet_arguments`)."""
    return UNet(**unet_arguments(model_params, image_size=image_size, in_channels=in_channels,
                                 num_classes=num_classes, learn_sigma=learn_sigma))


def count_parameters(model_params, **shape) -> int:
    """Parameters of `build_unet(model_params, **shape)`, built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = build_unet(model_params, **shape)
    return sum(p.numel() for p in model.parameters())


__all__ = ["UNet", "PRESETS", "SHARED_DEFAULTS", "build_unet", "unet_arguments", "count_parameters", "timestep_embedding"]
