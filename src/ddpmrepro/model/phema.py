"""Post-hoc EMA's equations: power-function EMA profiles (Karras et al. 2024, "Analyzing and Improving the Training Dynamics
of Diffusion Models", section 3 and appendix C): the length of an average and its decay per update.

An EMA at time t (in updates) with exponent gamma weighs the weights of time tau in [0, t] by the
profile

    p(tau) = (gamma + 1) tau^gamma / t^(gamma + 1),

whose relative standard deviation (its width over t), sigma_rel, is the "EMA length" users choose:

    sigma_rel^2 = (gamma + 1) / ((gamma + 2)^2 (gamma + 3)).

Tracked with the decay beta_n = (1 - 1/n)^(gamma + 1) at the n-th update (n = 1, 2, ...; EDM2's
convention), the average after t updates is exactly sum_i w_i theta_i with
w_i = (i^(gamma+1) - (i-1)^(gamma+1)) / t^(gamma+1): the profile integrated over update i's unit
interval, theta_i being the weights after update i (`discrete_weights`).

The average of length sigma at t updates is made from snapshots of other lengths and times
(EDM2, section 3.2 and appendix C.3) as the combination sum_i c_i snapshot_i whose profile is
nearest in L2: with A_ij = <p_i, p_j> and b_i = <p_i, p_target> (closed forms), A c = b, and c
normalised to sum to 1 (a combination of averages is then an average: it keeps constant weights as
they are). A is badly conditioned (near 5e7 for EDM2's layout), so c itself means little: the
profile it makes is what the tests compare, and the fit error ||sum_i c_i p_i - p|| / ||p|| is what
refuses a length the snapshots cannot make (`solve`).

The equations only: the training tracks the averages (`training/phema.py`), the model directory
stores the snapshots and sums them (`model_dir.py`). Pure Python but `solve` (numpy).
"""
from __future__ import annotations

import math

# gamma = 0, the plain average of every update, is the longest profile with gamma >= 0: lengths
# above it would need gamma < 0, whose profiles weigh the first updates most.
MAX_SIGMA_REL = math.sqrt(1.0 / 12.0)
# A length whose profile the snapshots make only farther than this (relative L2) is refused: with
# 32 snapshots per length, about 0.031 to 0.21 pass from the default [0.05, 0.10] (docs/POSTHOC_EMA.md).
MAX_FIT_ERROR = 1e-2


def sigma_rel(gamma: float) -> float:
    """The relative standard deviation of the profile with exponent `gamma`."""
    return math.sqrt((gamma + 1.0) / ((gamma + 2.0) ** 2 * (gamma + 3.0)))


def gamma_of(sigma: float) -> float:
    """The exponent gamma >= 0 whose profile has relative standard deviation `sigma`, in
    (0, MAX_SIGMA_REL]: the root of (gamma + 2)^2 (gamma + 3) sigma^2 = gamma + 1 on [0, inf),
    where sigma_rel decreases (one root there). Bisection to the last bit: exact and pure Python."""
    if not 0.0 < sigma <= MAX_SIGMA_REL:
        raise ValueError(f"an EMA length (sigma_rel) must lie in (0, {MAX_SIGMA_REL:.4f}], got {sigma!r}")
    lo, hi = 0.0, 2.0 / sigma + 10.0  # sigma_rel(gamma) < 1/gamma, so sigma_rel(hi) < sigma
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if sigma_rel(mid) > sigma:
            lo = mid
        else:
            hi = mid
    return lo if abs(sigma_rel(lo) - sigma) <= abs(sigma_rel(hi) - sigma) else hi


def decay(gamma: float, n: int) -> float:
    """beta of the n-th update (n >= 1): ema <- beta ema + (1 - beta) weights. The first update
    (beta = 0) copies the weights: a power-function average starts from no initialisation."""
    return (1.0 - 1.0 / n) ** (gamma + 1.0)


def discrete_weights(gamma: float, t: int) -> list[float]:
    """w_1..w_t: what update i's weights count for in the tracked average after t updates (sum 1)."""
    return [(i ** (gamma + 1.0) - (i - 1) ** (gamma + 1.0)) / t ** (gamma + 1.0) for i in range(1, t + 1)]


def inner_product(t_a: float, gamma_a: float, t_b: float, gamma_b: float) -> float:
    """The integral of p_a p_b over tau: both profiles are zero past their own time, so it runs to
    min(t_a, t_b), in closed form. Written with the ratio of the two times so that long runs (t of
    1e6 updates, gamma of 70) stay in range."""
    if t_a > t_b:
        t_a, gamma_a, t_b, gamma_b = t_b, gamma_b, t_a, gamma_a
    return (gamma_a + 1.0) * (gamma_b + 1.0) / (gamma_a + gamma_b + 1.0) * (t_a / t_b) ** gamma_b / t_b


def solve(snapshots: list[tuple[int, float]], t: int, sigma: float):
    """(c, fit error): the coefficients of the snapshots (t_i updates, sigma_i) whose combined profile
    is nearest the profile of length `sigma` at `t` updates, normalised to sum to 1, and the relative
    L2 distance of the two profiles. In float64: the system is badly conditioned."""
    import numpy as np

    ts = [ti for ti, _ in snapshots]
    gs = [gamma_of(si) for _, si in snapshots]
    g = gamma_of(sigma)
    A = np.array([[inner_product(ti, gi, tj, gj) for tj, gj in zip(ts, gs)] for ti, gi in zip(ts, gs)])
    b = np.array([inner_product(ti, gi, t, g) for ti, gi in zip(ts, gs)])
    # lstsq, not solve: two snapshots of one profile (every step between them skipped) make A singular.
    c = np.linalg.lstsq(A, b, rcond=None)[0]
    c = c / c.sum()
    target = inner_product(t, g, t, g)
    err2 = max(float(c @ A @ c - 2 * c @ b + target), 0.0) / target
    return c, err2 ** 0.5


__all__ = ["MAX_SIGMA_REL", "MAX_FIT_ERROR", "sigma_rel", "gamma_of", "decay", "discrete_weights", "inner_product", "solve"]
