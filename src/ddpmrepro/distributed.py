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


def init(device_type: str) -> None:
    """Joins the process group (NCCL on GPUs, gloo on CPU) when launched by torchrun."""
    if in_launch() and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)


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


def comm_device() -> torch.device:
    """Where collective tensors must live: CUDA for NCCL, CPU for gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
