"""diffusers `UNet2DModel` <-> ddpmrepro's UNet, exactly, both ways; and the `DDPMScheduler` config.

Module for module (diffusers 0.42.1, `models/unets/unet_2d.py`):
  input_blocks.0.0              conv_in
  input_blocks.* (level l)      down_blocks.l.resnets.j / .attentions.j / .downsamplers.0.conv
  middle_block.0, .1, .2        mid_block.resnets.0, mid_block.attentions.0, mid_block.resnets.1
  output_blocks.* (level u)     up_blocks.u.resnets.i / .attentions.i / .upsamplers.0.conv
  out.0, out.2                  conv_norm_out, conv_out
  time_embed.0, .2 / label_embed  time_embedding.linear_1, .linear_2 / class_embedding
Inside a residual block in_layers.0/2, emb_layers.1, out_norm, out_layers.2, skip are norm1/conv1,
time_emb_proj, norm2, conv2, conv_shortcut; an attention block's qkv (a 1x1 Conv1d to [q | k | v])
is to_q, to_k, to_v (Linear layers) and proj_out is to_out.0.

What the weights do not say is in diffusers' config: `flip_sin_to_cos`/`freq_shift` (our
`time_embedding`), `downsample_padding`, `norm_eps`, `attention_head_dim`, and
`attn_norm_num_groups=32`, without which diffusers drops the middle attention's GroupNorm under
`resnet_time_scale_shift="scale_shift"`.
"""
from __future__ import annotations

import json
import math

import torch

from ..model.unet import AttentionBlock, Downsample, ResBlock, UNet, Upsample
from . import ConversionError, float_weights

RES_NAMES = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj", "out_norm": "norm2",
             "out_layers.2": "conv2", "skip": "conv_shortcut"}


def module_map(model: UNet) -> dict[str, tuple[str, type]]:
    """Our module prefix -> (diffusers prefix, our module type), walking the UNet's blocks in order."""
    levels = len(model.channel_mult)
    nrb = model.num_res_blocks
    out: dict[str, tuple[str, type]] = {"input_blocks.0.0": ("conv_in", None)}
    i = 1
    for level in range(levels):
        for j in range(nrb):
            for k, layer in enumerate(model.input_blocks[i]):
                kind = "resnets" if isinstance(layer, ResBlock) else "attentions"
                out[f"input_blocks.{i}.{k}"] = (f"down_blocks.{level}.{kind}.{j}", type(layer))
            i += 1
        if level != levels - 1:  # a strided conv, or a residual block that downsamples (ADM)
            out[f"input_blocks.{i}.0"] = (f"down_blocks.{level}.downsamplers.0", type(model.input_blocks[i][0]))
            i += 1
    for k, name in enumerate(("resnets.0", "attentions.0", "resnets.1")):
        out[f"middle_block.{k}"] = (f"mid_block.{name}", type(model.middle_block[k]))
    i = 0
    for up in range(levels):
        for j in range(nrb + 1):
            for k, layer in enumerate(model.output_blocks[i]):
                if isinstance(layer, Upsample) or getattr(layer, "updown", None) == "up":
                    out[f"output_blocks.{i}.{k}"] = (f"up_blocks.{up}.upsamplers.0", type(layer))
                else:
                    kind = "resnets" if isinstance(layer, ResBlock) else "attentions"
                    out[f"output_blocks.{i}.{k}"] = (f"up_blocks.{up}.{kind}.{j}", type(layer))
            i += 1
    return out


def _their_names(key: str, modules: dict) -> list[str]:
    """The diffusers key(s) of our tensor `key` (qkv: three)."""
    fixed = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
             "label_embed": "class_embedding", "out.0": "conv_norm_out", "out.2": "conv_out"}
    prefix, param = key.rsplit(".", 1)
    if prefix in fixed:
        return [f"{fixed[prefix]}.{param}"]
    if prefix in modules:  # the input conv
        return [f"{modules[prefix][0]}.{param}"]
    block = next(p for p in modules if prefix.startswith(p + "."))
    theirs, kind = modules[block]
    inner = prefix[len(block) + 1:]
    if kind is ResBlock:
        return [f"{theirs}.{RES_NAMES[inner]}.{param}"]
    if kind is AttentionBlock:
        if inner == "qkv":
            return [f"{theirs}.to_{n}.{param}" for n in "qkv"]
        return [f"{theirs}.{dict(norm='group_norm', proj_out='to_out.0')[inner]}.{param}"]
    return [f"{theirs}.conv.{param}"]  # Downsample.op / Upsample.conv


def to_diffusers(model: UNet) -> dict[str, torch.Tensor]:
    """`model`'s weights under UNet2DModel's names (Conv1d weights squeezed to Linear ones)."""
    modules = module_map(model)
    out = {}
    for key, v in model.state_dict().items():
        names = _their_names(key, modules)
        parts = v.chunk(3) if len(names) == 3 else [v]
        for name, part in zip(names, parts):
            if part.ndim == 3:  # Conv1d (C_out, C_in, 1) -> Linear (C_out, C_in)
                part = part[..., 0]
            out[name] = part.clone().contiguous()
    return out


def from_diffusers(state: dict[str, torch.Tensor], model: UNet, *, source: str) -> dict[str, torch.Tensor]:
    """A UNet2DModel state dict as `model`'s, strictly (every tensor used, every shape checked)."""
    modules, expected = module_map(model), model.state_dict()
    wanted = {key: _their_names(key, modules) for key in expected}
    missing = [n for names in wanted.values() for n in names if n not in state]
    if missing:
        raise ConversionError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all): not a "
                              "UNet2DModel of the architecture its config.json describes")
    used = {n for names in wanted.values() for n in names}
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise ConversionError(f"{source}: unexpected tensor {unexpected[0]} ({len(unexpected)} in all): a block "
                              "type or option ddpmrepro's UNet does not have")
    ours = {}
    for key, names in wanted.items():
        parts = [float_weights(state[n], n, source) for n in names]
        v = torch.cat(parts) if len(parts) == 3 else parts[0]
        if expected[key].ndim == 3 and v.ndim == 2:
            v = v[..., None]
        if v.shape != expected[key].shape:
            raise ConversionError(f"{source}: {names[0]} has shape {list(parts[0].shape)}, which does not fit "
                                  f"{key} {list(expected[key].shape)} of the model its config.json describes")
        ours[key] = v.contiguous()
    return ours


def unet2d_config(model: UNet, image_size: int) -> dict:
    """The UNet2DModel config of `model`; ConversionError if diffusers cannot express it."""
    widths = [model.model_channels * m for m in model.channel_mult]
    attn_levels, head_dims = [], set()
    i = 1
    for level in range(len(widths)):
        blocks = model.input_blocks[i:i + model.num_res_blocks]
        attn = [layer for b in blocks for layer in b if isinstance(layer, AttentionBlock)]
        attn_levels.append(bool(attn))
        head_dims |= {widths[level] // a.num_heads for a in attn}
        i += model.num_res_blocks + (level != len(widths) - 1)
    mid = model.middle_block[1]
    head_dims.add(widths[-1] // mid.num_heads)
    if len(head_dims) != 1:
        raise ConversionError(f"the attention layers have heads of {sorted(head_dims)} channels; diffusers' "
                              "UNet2DModel has one attention_head_dim for all of them")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    if any(n.num_groups != 32 for n in norms):
        raise ConversionError("a GroupNorm has fewer than 32 groups (a width not divisible by 32); diffusers' "
                              "UNet2DModel uses 32 everywhere")
    res = next(m for m in model.modules() if isinstance(m, ResBlock))
    down = [m for m in model.modules() if isinstance(m, Downsample)]
    ddpm_time = model.time_embedding_kind == "ddpm"
    resnet = any(getattr(m, "updown", None) for m in model.modules())  # ADM's resblock_updown
    plain_down, plain_up = ("ResnetDownsampleBlock2D", "ResnetUpsampleBlock2D") if resnet else ("DownBlock2D", "UpBlock2D")
    return {
        "_class_name": "UNet2DModel",
        "sample_size": image_size, "in_channels": model.in_channels, "out_channels": model.out_channels,
        "block_out_channels": widths, "layers_per_block": model.num_res_blocks,
        "down_block_types": ["AttnDownBlock2D" if a else plain_down for a in attn_levels],
        "up_block_types": ["AttnUpBlock2D" if a else plain_up for a in reversed(attn_levels)],
        "downsample_type": "resnet" if resnet else "conv", "upsample_type": "resnet" if resnet else "conv",
        "attention_head_dim": head_dims.pop(),
        "resnet_time_scale_shift": "scale_shift" if res.scale_shift_norm else "default",
        "dropout": res.out_layers[1].p,
        "norm_num_groups": 32, "attn_norm_num_groups": 32, "norm_eps": norms[0].eps,
        "flip_sin_to_cos": not ddpm_time, "freq_shift": 1 if ddpm_time else 0,
        "downsample_padding": 0 if down and down[0].asymmetric_padding else 1,
        "num_class_embeds": None if model.label_embed is None else model.num_classes + 1,
        "time_embedding_type": "positional", "act_fn": "silu", "center_input_sample": False,
        "mid_block_scale_factor": 1, "add_attention": True, "class_embed_type": None,
    }


# What ddpmrepro's UNet is in diffusers' terms; any other value is refused on import.
FIXED = {"time_embedding_type": "positional", "act_fn": "silu", "center_input_sample": False,
         "mid_block_scale_factor": 1, "add_attention": True, "class_embed_type": None,
         "resnet_time_scale_shift": ("default", "scale_shift"), "norm_num_groups": 32,
         "downsample_type": ("conv", "resnet"), "upsample_type": ("conv", "resnet"), "resnet_skip_time_act": False,
         "resnet_out_scale_factor": 1.0}


# The config.json keys model_keys reads: (JSON types allowed, required). A damaged or hand-edited file
# is refused naming the key, before anything reads it (a KeyError or AttributeError is a crash, not a message).
_NUMBER, _INT, _NULL = (int, float), (int,), (type(None),)
UNET_CONFIG_KEYS = {
    "block_out_channels": ((list,), True), "down_block_types": ((list,), True), "up_block_types": ((list,), True),
    "sample_size": (_INT, False), "in_channels": (_INT, False), "out_channels": (_INT, False),
    "layers_per_block": (_INT, False), "dropout": (_NUMBER, False), "norm_eps": (_NUMBER, False),
    "attention_head_dim": (_INT + _NULL + (list,), False), "num_class_embeds": (_INT + _NULL, False),
    "flip_sin_to_cos": ((bool,), False), "freq_shift": (_INT, False), "downsample_padding": (_INT, False),
    "resnet_time_scale_shift": ((str,), False), "attn_norm_num_groups": (_INT + _NULL, False),
}


def check_config(config, schema: dict, *, source: str, what: str) -> None:
    """ConversionError naming the first missing or mistyped key of a diffusers config.json."""
    if not isinstance(config, dict):
        raise ConversionError(f"{source}: holds a JSON {type(config).__name__}, not the object of settings of a {what}")
    for key, (types, required) in schema.items():
        if key not in config:
            if required:
                raise ConversionError(f"{source}: no {key!r}, which every {what} config.json has; the file is damaged "
                                      "or not a diffusers config (download it again)")
            continue
        value = config[key]
        # bool is an int in Python; JSON true for an integer setting is still wrong
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else {"int": "integer", "float": "number"}.get(
                t.__name__, t.__name__) for t in types)
            raise ConversionError(f"{source}: {key} is {json.dumps(value)}, not a {names}; the file is damaged "
                                  "(download it again)")
    for key in ("block_out_channels", "down_block_types", "up_block_types"):
        if key in schema and key in config:
            items = config[key]
            kind = int if key == "block_out_channels" else str
            if not items or not all(isinstance(v, kind) and not isinstance(v, bool) and (kind is str or v > 0)
                                    for v in items):
                raise ConversionError(f"{source}: {key} is {json.dumps(items)}, not a non-empty list of "
                                      f"{'positive integers' if kind is int else 'block names'}")


def model_keys(config: dict, *, source: str) -> dict:
    """params.yaml `model:` keys (all architecture keys) and whether it is class-conditional,
    from a UNet2DModel config.json. ConversionError names the first option we cannot reproduce,
    or the first key that is missing or malformed."""
    check_config(config, UNET_CONFIG_KEYS, source=source, what="UNet2DModel")
    if config.get("_class_name", "UNet2DModel") != "UNet2DModel":
        raise ConversionError(f"{source}: a {config['_class_name']}, not a UNet2DModel")
    for key, allowed in FIXED.items():
        value = config.get(key, allowed if not isinstance(allowed, tuple) else allowed[0])
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise ConversionError(f"{source}: {key}={value!r} is not supported (ddpmrepro's UNet has {allowed!r})")
    widths = list(config["block_out_channels"])
    down, up = list(config["down_block_types"]), list(config["up_block_types"])
    resnet = config.get("downsample_type", "conv") == "resnet"
    if resnet != (config.get("upsample_type", "conv") == "resnet"):
        raise ConversionError(f"{source}: downsample_type and upsample_type must both be conv or both resnet")
    plain = "ResnetDownsampleBlock2D" if resnet else "DownBlock2D"
    kinds = {plain: False, "AttnDownBlock2D": True}
    mirror = {plain: plain.replace("Down", "Up"), "AttnDownBlock2D": "AttnUpBlock2D"}
    if any(d not in kinds for d in down) or up != [mirror[d] for d in reversed(down)]:
        raise ConversionError(f"{source}: block types {down} / {up} are not supported ({plain} and "
                              "AttnDownBlock2D, mirrored on the way up)")
    if any(w % widths[0] for w in widths):
        raise ConversionError(f"{source}: block_out_channels {widths} are not multiples of the first")
    if (config.get("attn_norm_num_groups") is None and config.get("resnet_time_scale_shift") == "scale_shift"):
        raise ConversionError(f"{source}: its middle attention has no GroupNorm (scale_shift without "
                              "attn_norm_num_groups), which ddpmrepro's UNet always has")
    size = int(config.get("sample_size", 32))
    head_dim = config.get("attention_head_dim")
    if isinstance(head_dim, list):  # diffusers allows one per block; ours is one size for every layer
        if len(set(map(str, head_dim))) != 1 or not isinstance(head_dim[0], int) or isinstance(head_dim[0], bool):
            raise ConversionError(f"{source}: attention_head_dim {json.dumps(head_dim)} differs between blocks (or is "
                                  "not integers); ddpmrepro's UNet has one head size for every attention layer")
        head_dim = head_dim[0]
    keys = {
        "channels": widths[0], "channel_mult": [w // widths[0] for w in widths],
        "num_res_blocks": int(config.get("layers_per_block", 2)),
        "attention_resolutions": [size // 2 ** i for i, d in enumerate(down) if kinds[d]],
        "dropout": float(config.get("dropout", 0.0)),
        "scale_shift_norm": config.get("resnet_time_scale_shift", "default") == "scale_shift",
        "norm_eps": float(config.get("norm_eps", 1e-5)),
        "downsample_padding": "asymmetric" if config.get("downsample_padding", 1) == 0 else "symmetric",
        "class_cond": config.get("num_class_embeds") is not None,
        "resblock_updown": resnet,
    }
    # attention_head_dim None: one head per layer, whatever its width (google/ddpm-cifar10-32).
    keys.update({"num_heads": 1, "num_head_channels": max(widths)} if head_dim is None else
                {"num_head_channels": int(head_dim), "num_heads": None})
    flip, shift = config.get("flip_sin_to_cos", True), config.get("freq_shift", 0)
    if (flip, shift) == (True, 0):
        keys["time_embedding"] = "iddpm"
    elif (flip, shift) == (False, 1):
        keys["time_embedding"] = "ddpm"
    else:
        raise ConversionError(f"{source}: flip_sin_to_cos={flip}, freq_shift={shift} is neither the IDDPM "
                              "embedding (true, 0) nor the DDPM one (false, 1)")
    if config.get("downsample_padding", 1) not in (0, 1):
        raise ConversionError(f"{source}: downsample_padding={config['downsample_padding']} is not 0 or 1")
    return keys


def scheduler_config(diffusion) -> dict:
    """A DDPMScheduler config equal to params.yaml's `diffusion:` section (ConversionError if none is)."""
    if getattr(diffusion, "rescale_timesteps", False):
        raise ConversionError("diffusion.rescale_timesteps: diffusers feeds the network integer timesteps, so a "
                              "model trained on t x 1000/T cannot be exported to it")
    if diffusion.schedule == "linear":
        scale = 1000 / diffusion.timesteps  # our linear schedule is DDPM's, scaled to T (IDDPM)
        betas = {"beta_schedule": "linear", "beta_start": scale * 1e-4, "beta_end": scale * 0.02}
    else:
        betas = {"beta_schedule": "squaredcos_cap_v2"}
    return {
        "_class_name": "DDPMScheduler", "num_train_timesteps": diffusion.timesteps, **betas,
        "variance_type": diffusion.variance, "clip_sample": True, "clip_sample_range": 1.0,
        "prediction_type": {"eps": "epsilon", "x0": "sample"}[diffusion.prediction],
    }


SCHEDULER_CONFIG_KEYS = {
    "num_train_timesteps": (_INT, False), "beta_schedule": ((str,), False), "beta_start": (_NUMBER, False),
    "beta_end": (_NUMBER, False), "variance_type": ((str,), False), "prediction_type": ((str,), False),
}


def diffusion_keys(config: dict, *, source: str) -> dict:
    """params.yaml `diffusion:` keys from a DDPMScheduler config (ConversionError if not expressible,
    or naming the first malformed key)."""
    check_config(config, SCHEDULER_CONFIG_KEYS, source=source, what="DDPMScheduler")
    t = int(config.get("num_train_timesteps", 1000))
    schedule = config.get("beta_schedule", "linear")
    if schedule == "squaredcos_cap_v2":
        name = "cosine"
    elif schedule == "linear" and math.isclose(config.get("beta_start", 1e-4), 1e-4 * 1000 / t, rel_tol=1e-6) \
            and math.isclose(config.get("beta_end", 0.02), 0.02 * 1000 / t, rel_tol=1e-6):
        name = "linear"
    else:
        raise ConversionError(f"{source}: beta_schedule {schedule!r} with beta_start/beta_end "
                              f"{config.get('beta_start')}/{config.get('beta_end')} is neither DDPM's linear "
                              "schedule scaled to T nor the cosine one")
    variance = config.get("variance_type", "fixed_small")
    if variance not in ("fixed_small", "fixed_large", "learned_range"):
        raise ConversionError(f"{source}: variance_type {variance!r} is not fixed_small, fixed_large or learned_range")
    prediction = {"epsilon": "eps", "sample": "x0"}.get(config.get("prediction_type", "epsilon"))
    if prediction is None:
        raise ConversionError(f"{source}: prediction_type {config['prediction_type']!r} is not epsilon or sample")
    return {"timesteps": t, "schedule": name, "variance": variance, "prediction": prediction}
