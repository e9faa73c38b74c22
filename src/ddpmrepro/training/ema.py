"""Exponential moving averages of the model's weights: one frozen fp32 copy per rate.

The loop holds one `EMA` and calls `ema.update()` after every optimizer step that was not skipped
(the weights did not move, so neither does the average, nor its warmup count). `state_dict` goes
into every checkpoint; `export` gives the averaged weights the model directory stores.
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


def check_average(ema: dict, state: dict[str, torch.Tensor]) -> None:
    """An average (one read back from a checkpoint) must hold an fp32 tensor of each weight's shape
    for every tensor of the model and nothing else: otherwise the first update after a resume fails
    inside torch, or a snapshot is written of another network. ValueError names the tensor."""
    if not isinstance(ema, dict) or set(ema) != set(state):
        keys = set(ema) if isinstance(ema, dict) else set()
        odd = sorted(keys ^ set(state))
        raise ValueError(f"the average holds other tensors than the model ({', '.join(odd[:3]) or type(ema).__name__}"
                         f"{', ...' if len(odd) > 3 else ''})")
    for k, v in ema.items():
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32 or v.shape != state[k].shape:
            got = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"the average's {k} is {got}; it must be {tuple(state[k].shape)} torch.float32, "
                             "as the model's weight")


class EmaUpdater:
    """ema <- decay * ema + (1 - decay) * weights, fused over all floating tensors.

    Which live tensor each EMA tensor follows is resolved once: `model.state_dict()` walks every
    module and cost ~1.5% of a small CPU step when called per update. The resolved tensors share
    storage with the parameters (the optimizer and `load_state_dict` update them in place).
    """

    def __init__(self, ema: dict[str, torch.Tensor], model: nn.Module):
        state = model.state_dict()
        check_average(ema, state)
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
    """One EMA update of a single average (the `EMA` object keeps an updater per rate instead)."""
    EmaUpdater(ema, model)(decay)


class EMA:
    """The fixed-rate EMAs of `model` (the raw module, not its DDP wrapper), one per rate.

    All rates share one update count: it drives the warmup and counts the steps that moved the
    weights, so a skipped step leaves every average exactly as it was.
    """

    def __init__(self, model: nn.Module, rates, *, warmup: bool):
        self.model, self.warmup = model, warmup
        self.num_updates = 0
        self._set({float(rate): init_ema(model) for rate in rates})

    def _set(self, averages: dict[float, dict[str, torch.Tensor]]) -> None:
        self.averages = averages
        self._updaters = {rate: EmaUpdater(avg, self.model) for rate, avg in averages.items()}

    def update(self) -> None:
        """One update after an optimizer step that changed the weights."""
        for rate, update in self._updaters.items():
            update(ema_decay(rate, self.num_updates, self.warmup))
        self.num_updates += 1

    def state_dict(self) -> dict:
        return {"averages": {str(rate): avg for rate, avg in self.averages.items()}, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        averages = {float(rate): avg for rate, avg in state["averages"].items()}
        if set(averages) != set(self.averages):
            raise ValueError(f"the checkpoint holds EMA rates {sorted(averages)}, this run tracks {sorted(self.averages)}")
        self._set(averages)
        self.num_updates = int(state["num_updates"])

    def export(self) -> dict[float, dict[str, torch.Tensor]]:
        """rate -> averaged state dict (fp32), what the model directory stores."""
        return dict(self.averages)
