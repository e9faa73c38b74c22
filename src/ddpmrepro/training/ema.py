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


class EmaUpdater:
    """ema <- decay * ema + (1 - decay) * weights, fused over all floating tensors.

    Which live tensor each EMA tensor follows is resolved once: `model.state_dict()` walks every
    module and cost ~1.5% of a small CPU step when called per update. The resolved tensors share
    storage with the parameters (the optimizer and `load_state_dict` update them in place).
    """

    def __init__(self, ema: dict[str, torch.Tensor], model: nn.Module):
        state = model.state_dict()
        floats = [k for k, v in ema.items() if v.is_floating_point()]
        self.targets = [ema[k] for k in floats]
        self.sources = [state[k].detach() for k in floats]
        self.copies = [(ema[k], state[k]) for k, v in ema.items() if not v.is_floating_point()]
        self.cast = any(s.dtype != t.dtype for s, t in zip(self.sources, self.targets))

    @torch.no_grad()
    def __call__(self, decay: float) -> None:
        sources = [s.float() for s in self.sources] if self.cast else self.sources
        torch._foreach_lerp_(self.targets, sources, 1.0 - decay)
        for target, source in self.copies:  # integer buffers (none in our UNet) are copied
            target.copy_(source)


def update_ema(ema: dict[str, torch.Tensor], model: nn.Module, decay: float) -> None:
    """One EMA update (see EmaUpdater; the loop keeps an updater per rate instead)."""
    EmaUpdater(ema, model)(decay)
