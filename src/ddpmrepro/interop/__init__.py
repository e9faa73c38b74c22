"""Published models in, ours out: weight mappings between ddpmrepro's UNet and its peers.

- `improved_diffusion`: openai/improved-diffusion and guided-diffusion `UNetModel` state dicts (.pt);
- `diffusers_unet`: diffusers `UNet2DModel` folders, both directions, and a `DDPMScheduler` config;
- `model_dir`: `ddpmrepro import` / `export`: the model directory `train` writes, from those files.

Every mapping is exact (a renaming plus, for improved-diffusion's attention, a permutation of the
qkv rows); docs/MODELS.md lists what loads and which `model:` keys each source needs.
"""


class ConversionError(ValueError):
    """A file that cannot become (or come from) this architecture; one line naming the key or file."""


def float_weights(v, name: str, source: str):
    """A published tensor as our fp32 weight. fp16/bf16/fp64 convert exactly enough; an integer,
    boolean or complex tensor is no trained weight (a mislabelled file, a buffer saved in a weight's
    place), and casting it would import nonsense without a word."""
    import torch

    if not isinstance(v, torch.Tensor):
        raise ConversionError(f"{source}: {name} is a {type(v).__name__}, not a tensor")
    if not v.is_floating_point():
        raise ConversionError(f"{source}: {name} holds {str(v.dtype).removeprefix('torch.')} values, not "
                              "floating-point weights; not a model's state dict as saved by its trainer")
    return v.detach().to(torch.float32)

