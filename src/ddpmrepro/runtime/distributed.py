"""Tiny distributed helpers: one-liners around torch.distributed with a single-process path.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; without them we
run as one process and never touch a process group.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def in_launch() -> bool:
    """True inside torchrun (or any launcher that set the rendezvous variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_CONTROL_GROUP = None  # gloo group for host-side flags when the default group is NCCL


def init(device_type: str) -> None:
    """Joins the process group (NCCL on GPUs, gloo on CPU) when launched by torchrun."""
    global _CONTROL_GROUP
    if in_launch() and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        # Host-side flags (the per-step stop request) go over gloo: an NCCL all-reduce of a CUDA
        # tensor read back with .item() would make the host wait for the GPU at every step.
        _CONTROL_GROUP = dist.new_group(backend="gloo") if backend == "nccl" else None
        # A rank leaves init_process_group once its own gloo connections are up, while a slower peer
        # may still be making its own; if the first then fails at once (a batch too large for the
        # data, say) and exits, the peer's C++ side prints "connectFullMesh failed ... closed by
        # peer" over the one-line error. Nobody goes on until everybody is connected.
        dist.barrier(group=_CONTROL_GROUP)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_max(x: float) -> float:
    """The maximum of a host value over ranks, on the host (gloo), without touching the GPU."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CONTROL_GROUP)
    return float(t.item())


def all_reduce_sum_(x: torch.Tensor) -> None:
    """Sums `x` over ranks in place (a no-op without a group)."""
    if dist.is_initialized():
        dist.all_reduce(x)


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """(world, *x.shape) on the host: row r is rank r's `x` (every rank must call it)."""
    if not dist.is_initialized():
        return x[None].cpu()
    rows = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, x)
    return torch.stack(rows).cpu()


def cleanup() -> None:
    global _CONTROL_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL_GROUP = None
