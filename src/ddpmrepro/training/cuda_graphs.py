"""`train.cuda_graphs`: each microbatch's forward, loss and backward captured once in a CUDA graph
and replayed, one launch instead of the ~2,400 kernel launches Python makes for it
(docs/BENCHMARKS.md "On a GPU": the eager step is bound by the host, not by the card).

What is captured is the loop's `forward_backward(mb)` and nothing else: the diffusion loss, the
weighting, the importance weights, the scaled backward, and the noise scale's per-microbatch
norms. Everything that decides on the host stays eager and unchanged: the timestep sampler, the
all-reduce, GradScaler's unscale and skip (fp16), clipping, AdamW, the EMAs, the post-hoc EMA,
logging and checkpoints. So fp16, gradient accumulation, DDP and exact resume work as they do
without graphs.

What a graph needs, and where it comes from here:
- **Static addresses.** Inputs are copied into buffers the graph reads (`MicrobatchGraph`), and
  the outputs it writes are the same tensors at every replay: a consumer must read them (or queue
  a copy) before the next replay, which stream order gives for device work. The gradients are views
  into one flat buffer (`FlatGradients`), zeroed in place, never set to None.
- **No DDP inside.** DDP all-reduces from hooks during the backward. With graphs there is no DDP:
  the flat buffer is averaged over ranks by one all-reduce after the last microbatch, as DDP's
  buckets would be (divided by the world size, then summed). It does not overlap the backward.
- **Warm-up, then capture.** Three uncounted passes on a side stream (CUDA's lazy initialisations,
  cuDNN's and autocast's, and Inductor's compilation under `train.compile`), their gradients zeroed
  and the RNG state put back, so the run's numbers are those of an eager run. Capture happens at
  the first microbatch of a step, when the gradients are zero. Dropout inside the graph draws from
  the CUDA generator at each replay's offset, as eager does (PyTorch's graph-safe Philox).
- **Recorded steps run eagerly** (their hooks and extra backward passes belong to the host): the
  same function, on the same buffers' values, so they update the weights exactly as a replay would.

On a CPU nothing is captured: `MicrobatchGraph` runs the same code on its static buffers, with the
same warm-up and the same output aliasing, so the CPU tests check everything but the capture itself
(tests/test_cuda_graphs.py; the `gpu` tests check the capture on a card).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import fields, replace
from typing import Callable

import torch

from ..runtime import distributed as D
from .batches import Microbatch

log = logging.getLogger(__name__)

WARMUP_PASSES = 3


class FlatGradients:
    """The model's gradients as views into one flat buffer, made from the gradients of its first
    backward pass (`adopt`): the parameters without one then (unused) keep None, as in eager mode.
    One all-reduce averages all of them over ranks (`all_reduce`)."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat: torch.Tensor | None = None

    def adopt(self) -> None:
        """After a backward pass: the first time, moves the gradients into the flat buffer (values kept)."""
        if self.flat is not None:
            return
        used = [p for p in self.params if p.grad is not None]
        kinds = {(p.dtype, p.device) for p in used}
        if len(kinds) != 1:
            raise RuntimeError(f"train.cuda_graphs: one flat gradient buffer needs parameters of one dtype and "
                               f"device; this model has {sorted(map(str, kinds))}")
        self.flat = torch.empty(sum(p.numel() for p in used), dtype=used[0].dtype, device=used[0].device)
        offset = 0
        for p in used:
            # Strided as the parameter is (train.channels_last: NHWC), as autograd lays out a new gradient.
            view = self.flat.as_strided(p.shape, p.stride(), offset)
            view.copy_(p.grad)
            p.grad = view
            offset += p.numel()

    @torch.no_grad()
    def all_reduce(self) -> None:
        """The mean over ranks, as DDP computes it (each rank's gradient / world, summed)."""
        world = D.world_size()
        if world > 1 and self.flat is not None:
            self.flat.div_(world)
            D.all_reduce_sum_(self.flat)


class MicrobatchGraph:
    """Runs `forward_backward(mb) -> {name: tensor}` on a microbatch: eagerly when asked (recorded
    steps) or when disabled; otherwise on static copies of its inputs, captured in a CUDA graph on
    its first such call (a CPU runs the same code without capture). The returned tensors are
    detached; on the graphed path they are overwritten by the next call. `zero_grads` after each
    optimizer step: in place while a graph writes to the gradients, set to None otherwise."""

    def __init__(self, forward_backward: Callable[[Microbatch], dict], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, enabled: bool, device: torch.device):
        self.forward_backward, self.optimizer, self.enabled, self.device = forward_backward, optimizer, enabled, device
        self.grads = FlatGradients(model) if enabled else None
        self.static_in: Microbatch | None = None
        self.static_out: dict[str, torch.Tensor] = {}
        self.graph = None
        if enabled and device.type != "cuda":
            log.info("train.cuda_graphs: no CUDA device, so nothing is captured; the step runs its graph's code "
                     "eagerly (static buffers and warm-up included)")

    def __call__(self, mb: Microbatch, *, eager: bool) -> dict[str, torch.Tensor]:
        if not self.enabled:
            return self.forward_backward(mb)
        if eager:
            out = self.forward_backward(mb)
            self.grads.adopt()
            return {k: v.detach() for k, v in out.items()}
        if self.static_in is None:
            self._capture(mb)
        values = _tensors(mb)
        for name, buffer in _tensors(self.static_in).items():
            buffer.copy_(values[name], non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:  # a CPU: the same code on the same buffers, its outputs into static ones as a replay's are
            for name, value in self.forward_backward(self.static_in).items():
                self.static_out[name].copy_(value.detach())
        return self.static_out

    def zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=not self.enabled)

    def all_reduce_grads(self) -> None:
        """After the last microbatch: the gradients averaged over ranks (DDP's job without graphs)."""
        if self.enabled:
            self.grads.all_reduce()

    def _capture(self, mb: Microbatch) -> None:
        """Warm-up passes on the first graphed microbatch's values, then the capture (on a GPU).
        Called at a step's first microbatch: the gradients are zero before and after."""
        self.static_in = _clone(mb)
        cuda = self.device.type == "cuda"
        rng = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
        side = torch.cuda.Stream(self.device) if cuda else None
        if cuda:  # warm up on a side stream, as PyTorch asks before a capture
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            for _ in range(WARMUP_PASSES):
                out = self.forward_backward(self.static_in)
                self.grads.adopt()
            self.zero_grads()
        if not cuda:  # nothing to capture: the outputs' static buffers, and the RNG as it was
            torch.set_rng_state(rng)
            self.static_out = {k: v.detach().clone() for k, v in out.items()}
            return
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        torch.cuda.set_rng_state(rng, self.device)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the read-ahead thread keeps pinning host memory while the main thread captures.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            out = self.forward_backward(self.static_in)
        self.static_out = {k: v.detach() for k, v in out.items()}


def _tensors(mb: Microbatch) -> dict[str, torch.Tensor]:
    """What forward_backward reads of a microbatch (x0, not the uint8 rows it was made from)."""
    named = {f.name: getattr(mb, f.name) for f in fields(mb) if f.name not in ("rows", "flip", "cond")}
    return {**{k: v for k, v in named.items() if v is not None}, **{f"cond.{k}": v for k, v in mb.cond.items()}}


def _clone(mb: Microbatch) -> Microbatch:
    return replace(mb, rows=None, flip=None, cond={k: v.clone() for k, v in mb.cond.items()},
                   **{f.name: getattr(mb, f.name).clone() for f in fields(mb)
                      if f.name not in ("rows", "flip", "cond") and getattr(mb, f.name) is not None})
