"""Published models in, ours out: weight mappings between ddpmrepro's UNet and its peers.

- `improved_diffusion`: openai/improved-diffusion and guided-diffusion `UNetModel` state dicts (.pt);
- `diffusers_unet`: diffusers `UNet2DModel` folders, both directions, and a `DDPMScheduler` config;
- `model_dir`: `ddpmrepro import` / `export`: the model directory `train` writes, from those files.

Every mapping is exact (a renaming plus, for improved-diffusion's attention, a permutation of the
qkv rows); docs/MODELS.md lists what loads and which `model:` keys each source needs.
"""


class ConversionError(ValueError):
    """A file that cannot become (or come from) this architecture; one line naming the key or file."""
