"""`sample.cuda_graphs`: the network's forward pass replayed from CUDA graphs while sampling.

A sampler calls the same network with the same shapes 20 to 1,000 times per batch, and at small
images each call is hundreds of small kernels launched from Python: the easiest place for a graph.
`GraphedNetwork` wraps the network (`net(x, t, y, **cond)`, the wrapper has its signature and
attributes): one graph per set of input shapes and dtypes, captured at its first call after two
warm-up passes on a side stream, replayed after the inputs are copied into its static buffers.
Only the network is captured; the solver's arithmetic (DDIM, DPM-Solver++, UniPC, Heun), the
guidance's combination and the seeded noise stay eager, so every sampler works unchanged.

The output is copied out of the graph's static buffer at every call (one copy of the images,
nothing beside a network call): a caller may keep an output while calling again, as a multistep
solver keeping raw network outputs would, and the next replay would overwrite it otherwise.

On a CPU nothing is captured: the same static buffers and calls run eagerly, so the samples are
eager's to the bit (tests/test_sample.py); a `gpu` test compares captured samples with eager
ones on a card. Inference only: call it under `torch.no_grad()`, with the network in eval mode.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

WARMUP_PASSES = 2


class _Entry:
    """One captured shape: its static inputs (positional, keyword), its graph and static output."""

    def __init__(self, args: list, kwargs: dict):
        self.args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def fill(self, args: tuple, kwargs: dict) -> None:
        for static, value in zip(self.args, args):
            if isinstance(static, torch.Tensor):
                static.copy_(value, non_blocking=True)
        for k, static in self.kwargs.items():
            if isinstance(static, torch.Tensor):
                static.copy_(kwargs[k], non_blocking=True)


class GraphedNetwork:
    """`net` called through CUDA graphs (one per input signature); other attributes are `net`'s."""

    def __init__(self, net: torch.nn.Module, device: torch.device):
        self.net, self.device = net, torch.device(device)
        self.entries: dict[tuple, _Entry] = {}
        if self.device.type != "cuda":
            log.info("sample.cuda_graphs: no CUDA device, so nothing is captured; the network runs eagerly "
                     "on the graphs' static buffers")

    def __getattr__(self, name: str):  # label_embed, num_classes, ...: the network's own
        return getattr(self.net, name)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        key = _signature(args, kwargs)
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._capture(args, kwargs)
        entry.fill(args, kwargs)
        if entry.graph is not None:
            entry.graph.replay()
        else:  # a CPU: the network on the static buffers, its output into the static one as a replay's
            out = self.net(*entry.args, **entry.kwargs)
            entry.out = out.clone() if entry.out is None else entry.out.copy_(out)
        return entry.out.clone()

    def _capture(self, args: tuple, kwargs: dict) -> _Entry:
        entry = _Entry(list(args), kwargs)
        if self.device.type != "cuda":
            return entry
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):  # lazy initialisations (cuDNN, cuBLAS, Inductor) outside the capture
                self.net(*entry.args, **entry.kwargs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, capture_error_mode="thread_local"):
            entry.out = self.net(*entry.args, **entry.kwargs)
        return entry


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a graph is specific to: each tensor's shape, dtype and device, any other value as it is."""
    def one(v):
        return ("tensor", tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else ("value", v)
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))
