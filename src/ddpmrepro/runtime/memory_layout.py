"""`train.channels_last` and `sample.channels_last`: the network's weights, and so its activations,
in NHWC (`torch.channels_last`), the layout NVIDIA's tensor-core convolutions work in.

A layout is strides, not values: the same numbers, the convolutions computed by kernels that round
differently (docs/TRAINING.md, Memory layout). A convolution with NHWC weights lays out its output
in NHWC and the elementwise layers after it keep that (GroupNorm on a card does not: the same
section); training also hands the network and the loss its images in the layout (`Microbatch.to`). Module.to converts the
4-d tensors in place, keeping their identity: call it before anything holds copies of the weights
(the optimizer's state, the EMAs) or loads into them, and those take the layout too.
"""
from __future__ import annotations

import torch


def memory_layout(model: torch.nn.Module, channels_last: bool) -> torch.memory_format:
    """Puts `model`'s weights in NHWC if asked (untouched otherwise: a default run is what it always
    was); returns the layout its inputs should have."""
    if not channels_last:
        return torch.contiguous_format
    model.to(memory_format=torch.channels_last)
    return torch.channels_last
