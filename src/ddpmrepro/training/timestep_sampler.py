"""Timestep samplers: uniform, and IDDPM's loss-second-moment importance sampler.

A sampler draws `t` with probabilities `p_t` and returns the weights `1 / (T p_t)` that make
the weighted loss an unbiased estimate of the uniform-t loss: E_p[w_t L_t] = mean_t L_t.
The importance sampler keeps the last `history` losses of every timestep, stays uniform
until every timestep has a full history, then uses p_t ∝ sqrt(E[L_t^2]) mixed with a small
uniform share (Nichol & Dhariwal 2021, Sec. 3.3). Under DDP the losses of all ranks are
all-gathered before `update`, so every rank holds the identical history and draws with the
same weights.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist


class UniformSampler:
    def __init__(self, num_timesteps: int):
        self.num_timesteps = num_timesteps

    def weights(self) -> np.ndarray:
        return np.ones(self.num_timesteps, dtype=np.float64)

    def sample(self, n: int, generator: torch.Generator, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Returns t (n,) int64 and the importance weights (n,) float32."""
        return self.sample_from_uniform(torch.rand(n, generator=generator, dtype=torch.float64), device)

    def sample_from_uniform(self, u: torch.Tensor, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse-CDF draw: t_i = min{t : cdf(t) > u_i} for u_i ~ U[0, 1).

        Lets the caller draw u_i from each example's own generator, so an example's timestep
        does not depend on which process or batch it lands in.
        """
        w = self.weights()
        p = torch.from_numpy(w / w.sum())
        cdf = torch.cumsum(p, 0)
        t = torch.searchsorted(cdf, u.double().contiguous(), right=True).clamp(max=len(p) - 1)
        weights = 1.0 / (len(p) * p[t])
        return t.to(device), weights.float().to(device)

    def update(self, t: torch.Tensor, losses: torch.Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class LossSecondMomentSampler(UniformSampler):
    def __init__(self, num_timesteps: int, history: int = 10, uniform_prob: float = 0.001):
        super().__init__(num_timesteps)
        self.history = history
        self.uniform_prob = uniform_prob
        self.loss_history = np.zeros((num_timesteps, history), dtype=np.float64)
        self.loss_counts = np.zeros(num_timesteps, dtype=np.int64)

    def warmed_up(self) -> bool:
        return bool((self.loss_counts == self.history).all())

    def weights(self) -> np.ndarray:
        if not self.warmed_up():
            return np.ones(self.num_timesteps, dtype=np.float64)
        w = np.sqrt(np.mean(self.loss_history**2, axis=-1))
        w /= w.sum()
        w *= 1 - self.uniform_prob
        w += self.uniform_prob / len(w)
        return w

    def update(self, t: torch.Tensor, losses: torch.Tensor) -> None:
        """Records per-example losses (unweighted) in the ring buffer of each timestep.

        Call with the losses of *all* ranks (see `gather_for_sampler`), in the same order on
        every rank, so the histories stay identical. A non-finite loss (a step that
        `train.on_nonfinite: skip` or the fp16 scaler skips) is left out: it would make every
        weight NaN.
        """
        for ti, loss in zip(t.tolist(), losses.tolist()):
            if not math.isfinite(loss):
                continue
            if self.loss_counts[ti] == self.history:
                # drop the oldest (a shift keeps the order, so state is deterministic)
                self.loss_history[ti, :-1] = self.loss_history[ti, 1:]
                self.loss_history[ti, -1] = loss
            else:
                self.loss_history[ti, self.loss_counts[ti]] = loss
                self.loss_counts[ti] += 1

    def state_dict(self) -> dict:
        # tensors, not numpy arrays: checkpoints load with weights_only=True
        return {"loss_history": torch.from_numpy(self.loss_history.copy()),
                "loss_counts": torch.from_numpy(self.loss_counts.copy())}

    def load_state_dict(self, state: dict) -> None:
        hist = state["loss_history"].numpy()
        if hist.shape != self.loss_history.shape:
            raise ValueError(f"sampler history has shape {tuple(hist.shape)}, expected {self.loss_history.shape}")
        self.loss_history = hist.astype(np.float64).copy()
        self.loss_counts = state["loss_counts"].numpy().astype(np.int64).copy()


def gather_for_sampler(t: torch.Tensor, losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gathers (t, loss) from every rank, in global-batch order, on their device; identity
    without a group.

    Rank r holds the examples r, r + W, r + 2W, ... of the global batch (DistributedSampler),
    so interleaving the gathered rows restores the order one process with the whole batch
    would see, and the sampler's history is the same whatever the world size.
    """
    t, losses = t.detach(), losses.detach().float()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t, losses
    ts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    ls = [torch.empty_like(losses) for _ in range(dist.get_world_size())]
    dist.all_gather(ts, t)
    dist.all_gather(ls, losses)
    return torch.stack(ts, 1).reshape(-1), torch.stack(ls, 1).reshape(-1)


class PendingUpdate:
    """One microbatch's (t, loss), gathered over ranks, on their way to the host.

    `update` runs on the host; calling `.cpu()` right after the forward pass would stall the host
    until the GPU got there, once per step. Instead the copy is queued (pinned memory, non-blocking)
    and `apply_to` runs just before the next draw, when the GPU has long finished it. The sampler
    sees exactly the same updates in the same order, so results do not change.
    """

    def __init__(self, t: torch.Tensor, losses: torch.Tensor):
        t, losses = gather_for_sampler(t, losses)
        self.event = None
        if t.device.type == "cuda":
            self.t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            self.losses = torch.empty(losses.shape, dtype=losses.dtype, pin_memory=True).copy_(losses, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.t, self.losses = t.cpu(), losses.cpu()

    def apply_to(self, sampler: UniformSampler) -> None:
        if self.event is not None:
            self.event.synchronize()
        sampler.update(self.t, self.losses)


class DeferredUpdates:
    """The sampler updates still on their way to the host, applied in order by `flush` (just before
    the next draw, and before the sampler's state is saved). The uniform sampler learns nothing:
    nothing is gathered or queued for it."""

    def __init__(self, sampler: UniformSampler):
        self.sampler, self.pending = sampler, []
        self.learns = type(sampler) is not UniformSampler

    def add(self, t: torch.Tensor, losses: torch.Tensor) -> None:
        if self.learns:
            self.pending.append(PendingUpdate(t, losses))

    def flush(self) -> None:
        while self.pending:
            self.pending.pop(0).apply_to(self.sampler)


def create_sampler(name: str, num_timesteps: int) -> UniformSampler:
    if name == "uniform":
        return UniformSampler(num_timesteps)
    if name == "loss-second-moment":
        return LossSecondMomentSampler(num_timesteps)
    raise ValueError(f"unknown timestep sampler {name!r}")
