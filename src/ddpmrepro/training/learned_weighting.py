"""EDM2's learned loss weighting (Karras et al. 2024, sec. 3 and appendix B.2; the uncertainty
weighting of Kendall et al. 2018): `diffusion.loss_weighting: learned`.

A small learned function u(t) of the noise level is trained with the model on

    L = L_t / exp(u_t) + u_t,

where L_t is the example's MSE term at its timestep t. For a fixed model, E[L_t e^{-u} + u] is
smallest at u = log E[L_t] (its derivative -E[L_t] e^{-u} + 1 vanishes there), so u_t tracks the
log of each level's typical loss and every level's term L_t / exp(u_t) has expectation about 1:
no noise level dominates the gradient because its loss happens to be large, without a hand-made
w_t. The weighting changes the objective on purpose; it is not a sampler (the importance
sampler's 1/(T p_t) multiplies the whole of L, u_t included, so u fits the uniform-t objective).

Form: EDM2's, a linear layer on fixed random Fourier features of the noise level (its `logvar`
head: MPFourier of c_noise = ln(sigma)/4, 128 channels), here of the log-SNR
lambda_t = log(alpha_bar_t / (1 - alpha_bar_t)), c = -lambda_t / 8 (= ln(sigma)/4 for
sigma^2 = 1/SNR). Not a per-t table: a T-vector would see on average B/T examples per entry and
step (0.13 for B = 128, T = 1000), so each entry would follow its own few noisy losses, while the
Fourier form pools neighbouring levels (the curve is smooth in lambda) and is defined at any
noise level, not only at the trained grid. The frequencies and phases are drawn once from
`train.seed` (not the global RNG: the model's initial weights stay what they were) and kept as
buffers, so the exported file is the whole function. The layer starts at zero (weight and bias),
so the first steps are exactly the unweighted loss plus 0.

The L_vb term of `hybrid` (or of a learned variance under `mse`) is not divided: it trains only
the variance (its mean is a stop-gradient) and estimates the bound, as the other weightings leave
it (`GaussianDiffusion.training_losses`); u fits the MSE term alone, which is EDM2's loss (EDM2
has no vb term). So L = mse_t / exp(u_t) + u_t + vb_t.

Plumbing (the loop's, not the diffusion math's): an extra parameter group of the model's AdamW
with weight decay 0 (decay would pull u towards 0, i.e. towards a loss of size 1, biasing
u = log E[L_t]); its gradient all-reduced explicitly (`all_reduce_grads`), not by wrapping it in
the model's DDP, so that the model's state dict, EMAs and export stay the network alone; its
state in every checkpoint (`loss_weight`), and `loss_weight.safetensors` in the model directory,
which sampling never reads.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ..runtime import distributed as D
from .noise_buckets import log_snr

FEATURES = 128  # EDM2's logvar_channels


class LearnedLossWeight(nn.Module):
    """u(t): a linear layer on fixed Fourier features of log-SNR (see the module docstring)."""

    def __init__(self, alphas_cumprod, seed: int, features: int = FEATURES):
        """
        :param alphas_cumprod: (T,) alpha_bar of the process trained on (index t).
        :param seed: draws the frequencies and phases (train.seed).
        :param features: number of Fourier features.
        """
        super().__init__()
        g = torch.Generator().manual_seed(int(seed))
        self.register_buffer("logsnr", torch.from_numpy(log_snr(alphas_cumprod)).float())  # (T,), from float64
        self.register_buffer("freqs", torch.randn(features, generator=g))  # (F,)
        self.register_buffer("phases", torch.rand(features, generator=g))  # (F,)
        self.weight = nn.Parameter(torch.zeros(features))
        self.bias = nn.Parameter(torch.zeros(()))

    def features(self, t: torch.Tensor) -> torch.Tensor:
        """(B, F) Fourier features of the levels t (B,) int64: sqrt(2) cos(2 pi (c f + phase))."""
        c = -self.logsnr[t].float() / 8  # (B,) EDM2's c_noise = ln(sigma) / 4
        return math.sqrt(2) * torch.cos(2 * math.pi * (c[:, None] * self.freqs + self.phases))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """u_t, (B,) float32."""
        return self.features(t) @ self.weight / math.sqrt(self.weight.numel()) + self.bias

    def weigh(self, losses: dict, t: torch.Tensor) -> dict:
        """The diffusion's losses {"loss", "mse", "vb"} (B,) weighted: "loss" = mse / exp(u) + vb,
        the part that trains the model (what the timestep sampler fits), and "u" (B,), to be added
        to it for the objective. "mse" and "vb" are returned as they came."""
        u = self(t)
        return {**losses, "loss": losses["mse"] * torch.exp(-u) + losses["vb"], "u": u}

    @staticmethod
    def objective(losses: dict) -> torch.Tensor:
        """Per example, what the backward pass takes (before the importance weights): L_t / exp(u_t) + u_t."""
        return losses["loss"] + losses["u"]

    def checkpoint_entries(self) -> dict:
        """What `CheckpointIO` holds of it: its weights (its AdamW state is the optimizer's)."""
        return {"loss_weight": self}

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Averages the gradients over ranks, as DDP does the model's (a no-op on one process)."""
        world = D.world_size()
        if world == 1:
            return
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            D.all_reduce_sum_(p.grad)
            p.grad.div_(world)

    @torch.no_grad()
    def curve(self) -> torch.Tensor:
        """u_t for every t = 0..T-1, (T,) float32 on the CPU."""
        return self(torch.arange(len(self.logsnr), device=self.logsnr.device)).float().cpu()

    def export(self) -> dict[str, torch.Tensor]:
        """What `loss_weight.safetensors` holds: the state (weight, bias, freqs, phases, logsnr) and
        the curve `u` over t = 0..T-1, on the CPU."""
        return {**{k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, "u": self.curve()}

    def rows(self, step: int, points: int = 64) -> list[dict]:
        """The introspection table's rows (`loss_weight`): u at `points` evenly spaced t (both ends in)."""
        u = self.curve()
        ts = np.unique(np.linspace(0, len(u) - 1, min(points, len(u))).round().astype(int))
        return [{"step": step, "t": int(i), "logsnr": float(self.logsnr[i]), "u": float(u[i])} for i in ts]


class Unweighted:
    """Every `diffusion.loss_weighting` but `learned` (they are the diffusion's own weights): the
    loop's calls are the identity or nothing, so the loop has one path for both."""

    def weigh(self, losses: dict, t: torch.Tensor) -> dict:
        return losses

    @staticmethod
    def objective(losses: dict) -> torch.Tensor:
        return losses["loss"]

    def checkpoint_entries(self) -> dict:
        return {}

    def all_reduce_grads(self) -> None:
        pass

    def rows(self, step: int) -> list[dict]:
        return []

    def export(self) -> None:
        return None


def loss_weighting(name: str, alphas_cumprod, *, seed: int, optimizer: torch.optim.Optimizer, device):
    """The loop's loss weighting for `diffusion.loss_weighting` `name`: `learned` on `device`, its
    parameters an AdamW group of their own without weight decay (decay would pull u towards 0), or
    `Unweighted`."""
    if name != "learned":
        return Unweighted()
    weighting = LearnedLossWeight(alphas_cumprod, seed=seed).to(device)
    optimizer.add_param_group({"params": list(weighting.parameters()), "weight_decay": 0.0})
    return weighting


__all__ = ["LearnedLossWeight", "Unweighted", "loss_weighting", "FEATURES"]
