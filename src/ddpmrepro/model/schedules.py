"""Noise schedules (betas in float64), and the cumulative products every noise-level rule reads.

numpy only: the `check_params` stage checks the noise-level buckets of `introspect:` against the
schedule (so a bucket that would hold no example is refused before `dvc repro` removes anything)
without importing torch, and `diffusion.py` builds its process from the very same betas.
"""
from __future__ import annotations

import math

import numpy as np


def get_beta_schedule(name: str, num_timesteps: int) -> np.ndarray:
    """Betas in float64.

    - "linear": Ho et al., beta from 1e-4 to 0.02 for T=1000, scaled by 1000/T for other T so
      that the total noise stays comparable (IDDPM `get_named_beta_schedule`).
    - "cosine": Nichol & Dhariwal eq. 17, alpha_bar(t) = cos^2(((t/T + s) / (1 + s)) * pi/2) with
      s = 0.008, beta_t = min(1 - alpha_bar(t+1)/alpha_bar(t), 0.999) (the cap avoids a
      singularity at t = T).

    :param name: "linear" or "cosine".
    :param num_timesteps: T.
    :return: (T,) float64 array.
    """
    if name == "linear":
        scale = 1000 / num_timesteps
        return np.linspace(scale * 0.0001, scale * 0.02, num_timesteps, dtype=np.float64)
    if name == "cosine":
        def alpha_bar(u: float) -> float:
            return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

        return np.array(
            [min(1 - alpha_bar((i + 1) / num_timesteps) / alpha_bar(i / num_timesteps), 0.999)
             for i in range(num_timesteps)],
            dtype=np.float64,
        )
    raise ValueError(f"unknown beta schedule {name!r}; choose linear or cosine")


def alphas_cumprod(name: str, num_timesteps: int) -> np.ndarray:
    """alpha_bar_t = prod_{s <= t} (1 - beta_s), t = 0..T-1, float64."""
    return np.cumprod(1.0 - get_beta_schedule(name, num_timesteps))


__all__ = ["get_beta_schedule", "alphas_cumprod"]
