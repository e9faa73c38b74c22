"""Fast samplers for our discrete-time models: DPM-Solver++(2M) and its SDE variant, UniPC and
EDM's Heun, on the continuous log-SNR view of the float64 alpha-bar table.

- Lu et al. 2022, "DPM-Solver++" (multistep data-prediction solver, its SDE variant, section 4-5);
- Zhao et al. 2023, "UniPC" (UniP-p predictor + UniC corrector, B(h) = e^h - 1 "bh2");
- Karras et al. 2022, "EDM" (Algorithm 2: Heun on sigma~ with the rho = 7 steps, optional churn).
The formulas are re-derived here from the papers; step-by-step parity with diffusers 0.42.1's
DPMSolverMultistepScheduler / UniPCMultistepScheduler is a test (tests/test_samplers.py).

The continuous view. Our model was trained at integer indices n = 0..T-1 with alpha_n = sqrt(abar_n),
sigma_n = sqrt(1 - abar_n), half log-SNR lambda_n = log alpha_n - log sigma_n. Between indices we
interpolate log alpha linearly in the index (as dpm-solver does for discrete models, with the index in
place of its `t = (n+1)/N`), so lambda(u) is defined for a fractional index u in [0, T-1] and is
exactly invertible. The network is called with that fractional ORIGINAL index (the UNet's sinusoidal
time embedding takes float t), never with dpm-solver's or diffusers' `1000 * t`, which is wrong for
T != 1000.

Every solver evaluates the model at M points u_0 > ... > u_{M-1} = 0 and then takes the step from
u = 0 to sigma = 0, which for every solver here is x = x0_hat(x, 0) (DDIM's last step, diffusers'
`final_sigmas_type="zero"`). Only x_T is random for the ODE solvers; the SDE variant and Heun's
churn draw one normal per image and step from that image's generator, so images do not depend on
batch size or process count.

The module knows nothing of labels, DDP or logging: `model_fn(x, t) -> output` is a closure (see
`diffusion.guided_model_fn`, which applies classifier-free guidance as one doubled batch).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .diffusion import GaussianDiffusion, get_beta_schedule
from ..respace import space_timesteps

SAMPLERS = ("dpmpp_2m", "dpmpp_2m_sde", "unipc", "heun")  # besides diffusion.py's "ddpm" and "ddim"
SPACINGS = ("logsnr", "time_uniform", "karras", "respacing")
THRESHOLDING = ("static", "dynamic", "none")
KARRAS_RHO = 7.0


# --- the continuous view of the table ---------------------------------------------------------------


class LambdaSchedule:
    """alpha, sigma and lambda at fractional indices u in [0, T-1] of a discrete alpha-bar table."""

    def __init__(self, alphas_cumprod):
        """:param alphas_cumprod: (T,) abar_n, strictly decreasing, in (0, 1) (float64 is kept)."""
        ac = np.asarray(alphas_cumprod, dtype=np.float64)
        if ac.ndim != 1 or len(ac) < 2 or not (np.diff(ac) < 0).all() or not ((ac > 0) & (ac < 1)).all():
            raise ValueError("alphas_cumprod must be a strictly decreasing 1-D array of values in (0, 1)")
        self.num_timesteps = len(ac)
        self._index = np.arange(len(ac), dtype=np.float64)
        self._log_alpha = 0.5 * np.log(ac)  # decreasing in n

    def log_alpha(self, u) -> np.ndarray:
        return np.interp(u, self._index, self._log_alpha)

    def alpha_sigma_lambda(self, u) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(alpha, sigma, lambda) at index u (scalars or arrays, float64)."""
        la = self.log_alpha(u)
        log_sigma = 0.5 * np.log(-np.expm1(2 * la))  # sigma^2 = 1 - alpha^2, accurate near alpha = 1
        return np.exp(la), np.exp(log_sigma), la - log_sigma

    def lam(self, u) -> np.ndarray:
        return self.alpha_sigma_lambda(u)[2]

    def index(self, lam) -> np.ndarray:
        """The fractional index u with lambda(u) = lam (lam clamped to the table's range):
        log alpha = -log(1 + e^(-2 lam)) / 2 is exact, and log alpha is linear in u between indices."""
        la = -0.5 * np.logaddexp(0.0, -2.0 * np.asarray(lam, dtype=np.float64))
        return np.interp(la, self._log_alpha[::-1], self._index[::-1])

    @classmethod
    def from_betas(cls, betas) -> "LambdaSchedule":
        return cls(np.cumprod(1.0 - np.asarray(betas, dtype=np.float64)))


def start_index(schedule: LambdaSchedule, lambda_min: float) -> float:
    """Where sampling starts: index T-1, or earlier where the table's lambda falls below lambda_min.

    Cosine tables end in a long tail (T=1000: lambda -5.08, -5.37, -5.77, -6.46, -9.92 over the last
    five indices; T=4000 reaches -11.3) where alpha < 0.006 and the model sees pure noise: a
    logSNR-uniform grid would spend a third of its steps there. dpm-solver and diffusers clip at
    -5.1, just below the linear schedule's end (-5.06 at T=1000, so linear tables are not cut).
    """
    last = float(schedule.num_timesteps - 1)
    if schedule.lam(last) >= lambda_min:
        return last
    return float(schedule.index(lambda_min))


def sample_times(schedule: LambdaSchedule, spacing: str, points: int, lambda_min: float = -5.1,
                 respacing: str = "") -> np.ndarray:
    """The M fractional indices the model is evaluated at, from the start down to exactly 0.

    - logsnr: lambda uniform between the start and index 0 (DPM-Solver's default, good for low resolution);
    - time_uniform: u uniform between the start and 0;
    - karras: sigma~ = e^-lambda spaced as EDM's (sigma~_max^(1/rho) + i/(M-1) (sigma~_min^(1/rho) -
      sigma~_max^(1/rho)))^rho, rho = 7, between the start and index 0;
    - respacing: the integer steps `respace.space_timesteps(T, respacing)` keeps (ddpm/ddim's steps;
      `points` and `lambda_min` are not used).

    :return: (M,) float64, strictly decreasing, last entry 0.
    """
    if spacing == "respacing":
        return np.array(sorted(space_timesteps(schedule.num_timesteps, respacing), reverse=True), dtype=np.float64)
    if points < 2:
        raise ValueError(f"need at least 2 evaluation points, got {points}")
    u_start = start_index(schedule, lambda_min)
    lam_lo, lam_hi = float(schedule.lam(u_start)), float(schedule.lam(0.0))
    if not lambda_min < lam_hi:  # every point at index 0: a NaN step size, and images of zeros
        raise ValueError(f"lambda_min {lambda_min:g} is not below the table's largest half log-SNR ({lam_hi:.3g}, "
                         f"at index 0), so sampling would start at the clean end; lower it (-5.1 is "
                         "dpm-solver's)")
    if spacing == "time_uniform":
        u = np.linspace(u_start, 0.0, points)
    elif spacing == "logsnr":
        u = schedule.index(np.linspace(lam_lo, lam_hi, points))
    elif spacing == "karras":
        ramp = np.linspace(0.0, 1.0, points)
        hi, lo = math.exp(-lam_lo) ** (1 / KARRAS_RHO), math.exp(-lam_hi) ** (1 / KARRAS_RHO)
        u = schedule.index(-KARRAS_RHO * np.log(hi + ramp * (lo - hi)))
    else:
        raise ValueError(f"unknown spacing {spacing!r}; choose one of {', '.join(SPACINGS)}")
    u[0], u[-1] = u_start, 0.0  # exact ends (interpolation round-off)
    if not (np.diff(u) < 0).all():
        raise ValueError(f"{points} evaluation points between index {u_start:.3g} and 0 are not all distinct; "
                         "lower lambda_min or the number of points")
    return u


def evaluation_points(sampler: str, nfe: int) -> int:
    """M for a budget of `nfe` network calls: M for the multistep solvers (one call per point),
    (nfe + 1) // 2 for Heun (two calls per step, one for the final step to sigma = 0: 2M - 1)."""
    return (nfe + 1) // 2 if sampler == "heun" else nfe


def network_calls(sampler: str, points: int) -> int:
    """Network calls (guided: doubled batches) of one run over `points` evaluation points."""
    return 2 * points - 1 if sampler == "heun" else points


# --- the denoiser ----------------------------------------------------------------------------------


def threshold(x0: torch.Tensor, kind: str, quantile: float = 0.995) -> torch.Tensor:
    """static: clamp to [-1, 1] (ddpm/ddim's clip_denoised). dynamic (Imagen, Saharia et al. 2022):
    per image s = max(1, quantile of |x0|), then clamp to [-s, s] and divide by s. none: as is."""
    if kind == "static":
        return x0.clamp(-1, 1)
    if kind == "dynamic":
        s = torch.quantile(x0.abs().reshape(len(x0), -1).float(), quantile, dim=1).clamp(min=1.0)
        s = s.to(x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
        return torch.maximum(torch.minimum(x0, s), -s) / s
    if kind == "none":
        return x0
    raise ValueError(f"unknown thresholding {kind!r}; choose one of {', '.join(THRESHOLDING)}")


def denoiser(model_fn: Callable, schedule: LambdaSchedule, prediction: str = "eps",
             thresholding: str = "static") -> Callable[[torch.Tensor, float], torch.Tensor]:
    """D(x, u): the model's x0 estimate at fractional index u.

    The first C channels of the output are the eps (or x0) prediction; a learned variance's extra
    channels are ignored, as every ODE solver does (the probability-flow ODE needs only eps).
    Guidance (in model_fn) acts on eps before this conversion; x0 is affine in eps, so it is the
    same as guiding x0.
    """
    def D(x: torch.Tensor, u: float) -> torch.Tensor:
        # float64, so a model_fn that can resolve time (a closed-form one) sees exactly this u; the
        # UNet's embedding rounds it to float32 itself
        t = torch.full((x.shape[0],), u, dtype=torch.float64, device=x.device)
        out = model_fn(x, t)[:, : x.shape[1]]
        if prediction == "x0":
            x0 = out
        else:
            alpha, sigma, _ = schedule.alpha_sigma_lambda(u)
            x0 = (x - float(sigma) * out) / float(alpha)
        return threshold(x0, thresholding)

    return D


# --- the solvers ------------------------------------------------------------------------------------
# All take D (the denoiser), x at times[0], the M evaluation points, and return x at sigma = 0.
# Coefficients are float64 Python scalars; the tensors stay in the model's dtype.


def dpm_solver_pp(D, x: torch.Tensor, times: np.ndarray, schedule: LambdaSchedule, order: int = 2,
                  noise: Callable[[torch.Tensor], torch.Tensor] | None = None, progress=None) -> torch.Tensor:
    """Multistep DPM-Solver++ (order 1 or 2) in data prediction; with `noise`, its SDE variant.

    Step s -> t, h = lambda_t - lambda_s, D_s = x0_hat(x_s):
      ODE: x_t = (sigma_t / sigma_s) x_s - alpha_t (e^-h - 1) D       (order 1 = DDIM's step)
      SDE: x_t = (sigma_t / sigma_s) e^-h x_s + alpha_t (1 - e^-2h) D + sigma_t sqrt(1 - e^-2h) z
           (order 1 = DDPM's ancestral step with the posterior variance)
    Order 2 ("midpoint", DPM-Solver++ Alg. 2) uses D = D_s + (D_s - D_prev) / (2r) in the ODE and
    adds alpha_t (1 - e^-2h) (D_s - D_prev) / (2r) in the SDE, r = h_prev / h. The first step (no
    history) and the last step (to sigma = 0, where h is infinite and every update is x = D_s) are
    first order, as in diffusers. `noise(x)` is drawn once per step, the last included (unused
    there), as ddpm_sample does, so the SDE variant of order 1 reproduces it draw for draw.
    """
    if order not in (1, 2):
        raise ValueError(f"DPM-Solver++ order must be 1 or 2, got {order}")
    alpha, sigma, lam = schedule.alpha_sigma_lambda(times)
    prev = None  # (lambda, D) of the previous point
    m = len(times)
    for i in range(m):
        z = noise(x) if noise is not None else None
        d = D(x, float(times[i]))
        if i == m - 1:
            x = d
        else:
            h = float(lam[i + 1] - lam[i])
            a_t, s_t, s_s = float(alpha[i + 1]), float(sigma[i + 1]), float(sigma[i])
            corr = None
            if order == 2 and prev is not None:
                r = (lam[i] - prev[0]) / h
                corr = (d - prev[1]) * float(0.5 / r)
            if z is None:
                dd = d if corr is None else d + corr
                x = (s_t / s_s) * x - (a_t * math.expm1(-h)) * dd
            else:
                c = -math.expm1(-2 * h)  # 1 - e^-2h
                x = (s_t / s_s * math.exp(-h)) * x + (a_t * c) * d + (s_t * math.sqrt(c)) * z
                if corr is not None:
                    x = x + (a_t * c) * corr
            prev = (lam[i], d)
        if progress is not None:
            progress(i + 1, m)
    return x


def _unipc_coefficients(hh: float, rks: Sequence[float], variant: str):
    """(B(h), R, b) of UniPC (Zhao et al. 2023, Alg. 3 / diffusers' `multistep_uni_*_bh_update`), in
    the signed variable hh = -h of data prediction: R[k] = rks^k, b[k] = phi_{k+1}(hh) k! / B(h)."""
    h_phi_1 = math.expm1(hh)
    b_h = hh if variant == "bh1" else h_phi_1
    h_phi_k, factorial = h_phi_1 / hh - 1.0, 1.0
    rks = np.asarray(rks, dtype=np.float64)
    R, b = [], []
    for k in range(1, len(rks) + 1):
        R.append(rks ** (k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1.0 / factorial
    return h_phi_1, b_h, np.stack(R), np.array(b)


def _unipc_update(x, hist, d_new, lam_t, a_t, s_t, order: int, variant: str):
    """One UniPC update from the last point in `hist` (a list of (lambda, sigma, D), newest last) to
    lambda_t: the predictor UniP-order when d_new is None, else the corrector UniC-order with the
    model value d_new at the new point (which costs no network call: the next step reuses it)."""
    lam_s, s_s, m0 = hist[-1]
    h = lam_t - lam_s
    rks, d1s = [], []
    for k in range(1, order):
        lam_k, _, m_k = hist[-1 - k]
        rk = (lam_k - lam_s) / h
        rks.append(rk)
        d1s.append((m_k - m0) / float(rk))
    rks.append(1.0)
    h_phi_1, b_h, R, b = _unipc_coefficients(-h, rks, variant)
    x_lin = (s_t / s_s) * x - (a_t * h_phi_1) * m0
    if d_new is None:
        if not d1s:
            return x_lin
        rhos = [0.5] if order == 2 else np.linalg.solve(R[:-1, :-1], b[:-1])
        res = sum(float(rho) * d1 for rho, d1 in zip(rhos, d1s))
        return x_lin - (a_t * b_h) * res
    rhos = [0.5] if order == 1 else np.linalg.solve(R, b)
    res = sum(float(rho) * d1 for rho, d1 in zip(rhos[:-1], d1s)) + float(rhos[-1]) * (d_new - m0)
    return x_lin - (a_t * b_h) * res


def unipc(D, x: torch.Tensor, times: np.ndarray, schedule: LambdaSchedule, order: int = 2, variant: str = "bh2",
          progress=None) -> torch.Tensor:
    """UniPC: the UniP-p predictor, then the UniC corrector once the model has been evaluated at the
    predicted point (the corrected x keeps that model value, so the corrector is free). Order
    min(order, points so far, points left) as diffusers' `lower_order_final`; no corrector after the
    last step (to sigma = 0, x = D). Predictor of order p + corrector gives order p + 1."""
    alpha, sigma, lam = schedule.alpha_sigma_lambda(times)
    hist, m = [], len(times)
    x_prev, prev_order = None, 0
    for i in range(m):
        d = D(x, float(times[i]))
        if x_prev is not None:  # correct the step just taken with the model value at its end
            x = _unipc_update(x_prev, hist, d, float(lam[i]), float(alpha[i]), float(sigma[i]), prev_order, variant)
        hist = (hist + [(float(lam[i]), float(sigma[i]), d)])[-order:]
        if i == m - 1:
            x = d
        else:
            prev_order = min(order, i + 1, m - i)
            x_prev = x
            x = _unipc_update(x, hist, None, float(lam[i + 1]), float(alpha[i + 1]), float(sigma[i + 1]),
                              prev_order, variant)
        if progress is not None:
            progress(i + 1, m)
    return x


def heun(D, x: torch.Tensor, times: np.ndarray, schedule: LambdaSchedule, churn: float = 0.0,
         noise: Callable[[torch.Tensor], torch.Tensor] | None = None, progress=None) -> torch.Tensor:
    """EDM's Algorithm 2 in the variance-exploding coordinates x~ = x / alpha, sigma~ = sigma / alpha:
    dx~/dsigma~ = (x~ - D) / sigma~; Euler to the next sigma~, then the trapezoid with the slope
    there. The last step, to sigma~ = 0, is Euler only (x~ = D), so M points cost 2M - 1 calls.
    Churn (EDM's S_churn, with S_min = 0, S_max = inf, S_noise = 1, its generate.py defaults): each step
    first raises sigma~ by gamma = min(churn / M, sqrt(2) - 1) with fresh noise, capped at the table's
    largest sigma~ (the model was never trained above it)."""
    _, _, lam = schedule.alpha_sigma_lambda(times)
    sig = np.exp(-lam)
    sig_cap = math.exp(-float(schedule.lam(schedule.num_timesteps - 1)))

    def slope(xt, s):  # (x~ - D) / sigma~ at sigma~ = s
        u = float(schedule.index(-math.log(s)))
        return (xt - D(xt / math.sqrt(1 + s * s), u)) / s

    m = len(times)
    xt = x * math.sqrt(1 + sig[0] ** 2)  # x~ = x / alpha
    gamma = min(churn / m, math.sqrt(2) - 1) if churn > 0 else 0.0
    for i in range(m):
        s = float(sig[i])
        if gamma > 0:
            s_hat = min(s * (1 + gamma), sig_cap)
            z = noise(xt)
            xt = xt + math.sqrt(max(s_hat ** 2 - s ** 2, 0.0)) * z
            s = s_hat
        d = slope(xt, s)
        if i == m - 1:
            xt = xt - s * d  # = D
        else:
            s_next = float(sig[i + 1])
            x_euler = xt + (s_next - s) * d
            xt = xt + (s_next - s) * 0.5 * (d + slope(x_euler, s_next))
        if progress is not None:
            progress(i + 1, m)
    return xt  # alpha = 1 at sigma = 0


# --- one entry point ------------------------------------------------------------------------------------


@torch.no_grad()
def sample(model_fn: Callable, schedule: LambdaSchedule, shape, times: np.ndarray, sampler: str = "dpmpp_2m",
           prediction: str = "eps", thresholding: str = "static", generators=None, x_T=None, order: int | None = None,
           churn: float = 0.0, variant: str = "bh2", progress=None, device=None) -> torch.Tensor:
    """Samples with one of SAMPLERS, evaluating the model at `times` (see `sample_times`).

    :param model_fn: model_fn(x, t) with t a (B,) float tensor of ORIGINAL fractional indices.
    :param shape: (B, C, ...).
    :param generators: one torch.Generator per image (x_T, and the per-step noise of dpmpp_2m_sde and
        of heun with churn), or None for the global RNG.
    :param order: solver order (default 2; dpmpp 1 or 2, unipc's predictor 1..3).
    :return: (B, C, ...) samples clamped to [-1, 1].
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if device is None:
        device = x_T.device if x_T is not None else getattr(model_fn, "device", torch.device("cpu"))
    x = x_T.to(device) if x_T is not None else GaussianDiffusion._randn(shape, generators, device)
    D = denoiser(model_fn, schedule, prediction, thresholding)

    def noise(like):  # drawn as float32 like ddpm_sample's, computed with in x's dtype
        return GaussianDiffusion._randn(like, generators).to(like.dtype)

    if sampler in ("dpmpp_2m", "dpmpp_2m_sde"):
        x = dpm_solver_pp(D, x, times, schedule, order=order or 2,
                          noise=noise if sampler == "dpmpp_2m_sde" else None, progress=progress)
    elif sampler == "unipc":
        x = unipc(D, x, times, schedule, order=order or 2, variant=variant, progress=progress)
    else:
        x = heun(D, x, times, schedule, churn=churn, noise=noise, progress=progress)
    return x.clamp(-1, 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A fast sampler bound to a model's table and its evaluation points (built by `from_params`)."""

    sampler: str
    schedule: LambdaSchedule
    times: np.ndarray  # (M,) fractional original indices, decreasing to 0
    prediction: str = "eps"
    thresholding: str = "static"
    churn: float = 0.0

    @property
    def nfe(self) -> int:
        return network_calls(self.sampler, len(self.times))

    def sample(self, model_fn, shape, generators=None, x_T=None, progress=None, device=None) -> torch.Tensor:
        return sample(model_fn, self.schedule, shape, self.times, self.sampler, prediction=self.prediction,
                      thresholding=self.thresholding, generators=generators, x_T=x_T, churn=self.churn,
                      progress=progress, device=device)


def from_params(diffusion_params, sample_params) -> Plan:
    """The Plan of params.yaml's `sample:` section for a model trained with `diffusion_params`
    (the model's own T and schedule; ValueError when `respacing` cannot respace that T)."""
    d, p = diffusion_params, sample_params
    schedule = LambdaSchedule.from_betas(get_beta_schedule(d.schedule, d.timesteps))
    times = sample_times(schedule, p.spacing, evaluation_points(p.sampler, p.nfe), p.lambda_min, p.respacing)
    return Plan(p.sampler, schedule, times, d.prediction, p.thresholding, p.churn)


__all__ = ["LambdaSchedule", "Plan", "from_params", "SAMPLERS", "SPACINGS", "THRESHOLDING", "sample", "sample_times", "start_index",
           "evaluation_points", "network_calls", "denoiser", "threshold", "dpm_solver_pp", "unipc", "heun"]
