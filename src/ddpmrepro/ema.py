"""Exponential moving averages of model weights (one frozen copy per rate).

The loop calls `update_ema` after every optimizer step that was not skipped. EMA copies
are plain state dicts of fp32 tensors, so they are saved with the checkpoint and exported
to safetensors without touching the live model.
"""
from __future__ import annotations

import torch
from torch import nn


def ema_decay(rate: float, num_updates: int, warmup: bool) -> float:
    """Decay for the `num_updates`-th update.

    With warmup the decay is min(rate, (1 + n) / (10 + n)) (as in TF's ExponentialMovingAverage
    with num_updates): early averages follow the fast-moving weights instead of the random init.
    """
    if not warmup:
        return rate
    return min(rate, (1.0 + num_updates) / (10.0 + num_updates))


def init_ema(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of the trainable parameters and buffers."""
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


@torch.no_grad()
def update_ema(ema: dict[str, torch.Tensor], model: nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * weights, fused over all floating tensors."""
    state = model.state_dict()
    floats = [k for k, v in ema.items() if v.is_floating_point()]
    targets = [ema[k] for k in floats]
    sources = [state[k].detach().float() for k in floats]
    torch._foreach_lerp_(targets, sources, 1.0 - decay)
    for k, v in ema.items():  # integer buffers (none in our UNet) are copied
        if not v.is_floating_point():
            v.copy_(state[k])
