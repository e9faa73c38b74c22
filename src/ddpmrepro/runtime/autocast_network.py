"""The network's forward pass in bf16 or fp16, everything around it in float32: `train.precision`
and `sample.precision`.

A GPU's tensor cores run bf16 and fp16 convolutions and matrix products at about twice TF32's rate
and a multiple of float32's. `AutocastNetwork` runs each call under `torch.autocast` in that dtype
and returns the output as float32, so everything around the network computes as at fp32: the
diffusion's loss (training: the GradScaler and its skips are the loop's), or the guidance's
combination, the solver's arithmetic and the seeded noise (sampling; its images change by the
network's rounding: docs/SAMPLERS.md, Precision, has by how much on the default model).

Autocast's weight-cast cache is off: each call casts each weight once anyway, and under CUDA graphs
(`train.cuda_graphs`, `sample.cuda_graphs`) a cast cached in one call would outlive its capture.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class AutocastNetwork:
    """`net` called under autocast in `dtype`, its output as float32; other attributes are `net`'s."""

    def __init__(self, net: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        self.net, self.dtype, self.device_type = net, dtype, torch.device(device).type

    def __getattr__(self, name: str):  # label_embed, aug_embed, num_classes, ...: the network's own
        return getattr(self.net, name)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False):
            out = self.net(*args, **kwargs)
        return out.float()


def note_slow_here(precision: str, device, key: str) -> None:
    """One line where `precision` has no fast path on `device`: fp16 on a CPU (no tensor cores;
    autocast emulates it) is made for GPUs, and a preset copied to a laptop runs there without a word."""
    if precision == "fp16" and torch.device(device).type == "cpu":
        log.info(f"{key}: fp16 on a CPU, which has no fast path for it (sampling measured 15x fp32's time, "
                 "docs/SAMPLERS.md, Precision): it is for GPUs; on this machine fp32 or bf16 is faster")


def with_precision(net, precision: str, device):
    """`net` itself at fp32 (not wrapped: the images of a default run are what they always were),
    else wrapped in `AutocastNetwork`."""
    return net if precision == "fp32" else AutocastNetwork(net, DTYPES[precision], device)
