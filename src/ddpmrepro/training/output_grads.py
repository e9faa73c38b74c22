"""Per-example gradient norms of the network's last layer, from two hooks, on every step.

The full gradient of each example is out of reach on a training step (that is one backward pass
per example), but the gradient of a layer's weights is an outer product of what enters the layer
and the gradient at its output, both of which the ordinary backward pass already has per example.
For the UNet's last convolution (`model.out[-1]`, a 3x3 conv to the output channels):

    ∂L_i/∂W[o, c, u, v] = sum_{y,x} δ_i[o, y, x] a_i[c, y + u, x + v]   (a zero-padded),
    ∂L_i/∂b[o]          = sum_{y,x} δ_i[o, y, x],

with a_i the layer's input and δ_i the gradient at its output. Computed as one small contraction
per kernel offset (B x C_out x C_in each), never the unfolded input (B x C_in k² x HW, 600 MB
for CIFAR-10's model at batch 128). The last layer's norm stands in for the whole network's, as
in Katharopoulos & Fleuret 2018 ("Not all samples are created equal"), where it bounds it up to a
factor; `output-grad-norm` (timestep_sampler.py) draws t by it. How well it stands in is measured,
not assumed: benchmarks/sampler_variance.py compares it with exact per-example full gradients.

The hooks keep the last backward's gradient: a recorded step's extra passes
(introspection.measure) go first, the step's own backward last, and that is the one read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def output_layer(model: nn.Module) -> nn.Conv2d:
    """The UNet's (and the upsampler's) last convolution."""
    layer = getattr(model, "out", None)
    layer = layer[-1] if isinstance(layer, nn.Sequential) else layer
    if not isinstance(layer, nn.Conv2d):
        raise TypeError(f"{type(model).__name__} has no output convolution `out[-1]` to take per-example "
                        "gradient norms from")
    return layer


def per_example_squared_norms(conv: nn.Conv2d, inputs: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """(B,) float32: ‖∂L_i/∂W‖² + ‖∂L_i/∂b‖² of each example, from the conv's input and the gradient
    at its output (stride 1, no dilation or groups, zero padding: the UNet's output layer)."""
    (kh, kw), (ph, pw) = conv.kernel_size, conv.padding
    a = F.pad(inputs.float(), (pw, pw, ph, ph))
    d = grad_out.float()
    H, W = d.shape[-2:]
    sq = d.sum((2, 3)).square().sum(1) if conv.bias is not None else d.new_zeros(len(d))
    for u in range(kh):
        for v in range(kw):
            sq = sq + torch.einsum("bohw,bchw->boc", d, a[:, :, u:u + H, v:v + W]).square().sum((1, 2))
    return sq


class OutputGradNorms:
    """Hooks on the output layer: `norms()` after a backward pass gives each example's gradient norm
    of that layer's parameters, for the loss that was backpropagated."""

    def __init__(self, model: nn.Module):
        self.conv = output_layer(model)
        c = self.conv
        if c.stride != (1, 1) or c.dilation != (1, 1) or c.groups != 1 or c.padding_mode != "zeros" \
                or isinstance(c.padding, str):
            raise ValueError("per-example output gradients need a stride-1, ungrouped, zero-padded convolution")
        self.inputs = self.grad_out = None
        self.handle = c.register_forward_hook(self._forward)

    def _forward(self, module, args, output):
        if output.requires_grad:
            # autograd keeps the conv's input for its own backward anyway: holding it costs nothing
            self.inputs, self.grad_out = args[0].detach(), None
            output.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.grad_out = grad.detach()

    def norms(self) -> torch.Tensor:
        """(B,) each example's ‖∇ of the output layer‖ in the last backward (on the device, no sync)."""
        if self.grad_out is None:
            raise RuntimeError("no backward pass reached the output layer since its last forward")
        return per_example_squared_norms(self.conv, self.inputs, self.grad_out).sqrt()

    def close(self) -> None:
        self.handle.remove()
        self.inputs = self.grad_out = None
