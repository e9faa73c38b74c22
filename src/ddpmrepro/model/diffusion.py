"""Gaussian diffusion: schedules, q/p math, losses, respacing, DDPM/DDIM samplers, CFG, bits/dim.

Follows Ho et al. 2020 (DDPM), Nichol & Dhariwal 2021 (IDDPM) and Song et al. 2021 (DDIM); the
formulas are those of openai/improved-diffusion (cited per method below), re-derived here.
Everything is per example; the module knows nothing of labels, DDP, autocast, EMA or logging:
`model_fn(x, t) -> output` is a closure built by the caller (`guided_model_fn` binds labels).

Precision: schedules are computed and kept in float64 and gathered to float32 per timestep (as
IDDPM does), so the tensor math runs in float32. Run it outside autocast.

Randomness: with `generators=None` the samplers draw from torch's global generator in exactly the
order improved-diffusion does (one `randn` of the batch at start, one `randn_like` per step, one
per timestep in bits/dim), so results match it under the same `torch.manual_seed`. With one
`torch.Generator` per image, image k's initial and per-step noise come only from generator k.
"""
from __future__ import annotations

import enum
import math
from typing import Callable, Sequence

import numpy as np
import torch

from ..respace import space_timesteps  # the kept steps (pure Python, shared with params validation)
from .schedules import get_beta_schedule  # numpy only: check_params reads the schedule too

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Prediction(str, enum.Enum):
    EPS = "eps"  # the model predicts the noise epsilon
    X0 = "x0"  # the model predicts the clean image x_0


class Variance(str, enum.Enum):
    FIXED_SMALL = "fixed_small"  # sigma_t^2 = posterior variance beta~_t (log clipped at t=0)
    FIXED_LARGE = "fixed_large"  # sigma_t^2 = beta_t (beta~_1 at t=0)
    LEARNED_RANGE = "learned_range"  # the model's v in [-1, 1] interpolates the two in log space


class Loss(str, enum.Enum):
    MSE = "mse"  # L_simple; with a learned variance, plus the (unscaled) VLB term for it
    HYBRID = "hybrid"  # L_simple + L_vlb * T/1000 with a stop-gradient on the mean (IDDPM)
    KL = "kl"  # the pure variational bound L_vlb


class Weighting(str, enum.Enum):
    NONE = "none"  # L_simple as it is: every timestep's MSE counts once
    MIN_SNR = "min_snr"  # Hang et al. 2023: min(SNR_t, gamma) on the x0 scale
    P2 = "p2"  # Choi et al. 2022: 1 / (k + SNR_t)^gamma on the eps scale


# --- Gaussian helpers ---------------------------------------------------------------------------


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) elementwise, in nats (broadcasting):
    0.5 * (logvar2 - logvar1 + e^(logvar1 - logvar2) + (mean1 - mean2)^2 e^-logvar2 - 1).
    """
    tensor = next(x for x in (mean1, logvar1, mean2, logvar2) if isinstance(x, torch.Tensor))
    logvar1, logvar2 = (x if isinstance(x, torch.Tensor) else torch.tensor(x).to(tensor) for x in (logvar1, logvar2))
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of the standard normal CDF (as in IDDPM and PixelCNN++)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """Log-likelihood (nats) of 8-bit data x in [-1, 1] under a Gaussian discretised into 256 bins.

    Bin k (x = k/127.5 - 1) gets the mass between x - 1/255 and x + 1/255; the first and last
    bins extend to -inf and +inf, so the 256 masses sum to one (IDDPM / Ho et al. decoder).

    :param x: (B, ...) images on the 8-bit grid in [-1, 1].
    :param means: Gaussian means, same shape.
    :param log_scales: log standard deviations, same shape.
    :return: elementwise log-probabilities, same shape.
    """
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over all but the batch dimension: (B, ...) -> (B,)."""
    return x.mean(dim=tuple(range(1, x.ndim)))


# --- loss weighting -------------------------------------------------------------------------------


def mse_weights(alphas_cumprod: np.ndarray, prediction: Prediction, weighting: Weighting,
                min_snr_gamma: float = 5.0, p2_k: float = 1.0, p2_gamma: float = 1.0) -> np.ndarray:
    """The factor w_t that multiplies the per-timestep MSE of L_simple, in float64.

    With SNR_t = alpha_bar_t / (1 - alpha_bar_t) and x_t = sqrt(alpha_bar_t) x_0 +
    sqrt(1 - alpha_bar_t) eps, an x0 prediction implies an eps prediction whose error is
    sqrt(SNR_t) times as large: ||eps - eps^||^2 = SNR_t ||x_0 - x0^||^2. So one objective has a
    weight per parametrisation, w_x0 = SNR_t w_eps, and training either parametrisation with its
    own weight optimises the same function of the implied predictions. Each method is defined on
    one scale; the other follows from this identity:

    - min_snr (Hang et al. 2023, defined on the x0 scale): w_x0 = min(SNR_t, gamma), so
      w_eps = min(SNR_t, gamma) / SNR_t, written gamma / max(SNR_t, gamma), which stays finite where
      SNR_t = 0 (beta = 1). (A v-prediction, which this code has not, would use
      min(SNR_t, gamma) / (SNR_t + 1), since ||v - v^||^2 = (SNR_t + 1) ||x_0 - x0^||^2.)
    - p2 (Choi et al. 2022, defined relative to L_simple, the eps scale):
      w_eps = 1 / (k + SNR_t)^gamma, so w_x0 = SNR_t / (k + SNR_t)^gamma. k > 0 keeps w_eps bounded
      where SNR_t -> 0; with k = gamma = 1, w_x0 = alpha_bar_t.
    - none: 1 everywhere (the caller skips the product, so `none` is bitwise L_simple).

    :param alphas_cumprod: (T,) alpha_bar_t of the process (a respaced one keeps alpha_bar at its
        steps, so its weights are the original process's at the kept steps).
    :return: (T,) float64 weights.
    """
    snr = alphas_cumprod / (1.0 - alphas_cumprod)  # alpha_bar < 1 for every t: betas > 0
    if weighting is Weighting.NONE:
        return np.ones_like(snr)
    if weighting is Weighting.MIN_SNR:
        w_eps = min_snr_gamma / np.maximum(snr, min_snr_gamma)
    else:
        w_eps = (p2_k + snr) ** -p2_gamma
    return w_eps if prediction is Prediction.EPS else snr * w_eps


# --- classifier-free guidance ---------------------------------------------------------------------


def guided_model_fn(model: Callable, y: torch.Tensor, guidance: float, null_class: int) -> ModelFn:
    """Binds labels (and classifier-free guidance) into a `model_fn(x, t)`.

    Convention (Ho & Salimans 2022, eq. 6): eps = (1 + w) eps(x, y) - w eps(x, null), so w = 0
    is the plain conditional model (evaluated alone, one forward pass); w > 0 runs conditional and
    unconditional together as one doubled batch. Only the first C channels (the eps, or x0,
    prediction) are guided; learned-variance channels come from the conditional branch.

    :param model: `model(x, t, y)`, e.g. a UNet.
    :param y: (B,) int64 labels.
    :param guidance: w >= 0.
    :param null_class: the null label (the UNet's `num_classes`).
    :return: model_fn(x, t), with attribute `device` (that of y) which the samplers default to.
    """
    def model_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if guidance == 0:
            return model(x, t, y)
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, null_class)]))
        cond, uncond = out.chunk(2)  # each (B, C or 2C, H, W)
        c = x.shape[1]
        guided = (1 + guidance) * cond[:, :c] - guidance * uncond[:, :c]
        return torch.cat([guided, cond[:, c:]], dim=1)

    model_fn.device = y.device  # the samplers draw their noise where the labels live
    return model_fn


# --- the process ----------------------------------------------------------------------------------


class GaussianDiffusion:
    """The forward process q and the model's reverse process p for a given beta schedule.

    A respaced process (see `from_params`) keeps a `timestep_map` from its own step indices to the
    original ones: the model is always called with ORIGINAL indices, everything else in this
    class works with the process's own indices 0..num_timesteps-1.
    """

    def __init__(self, betas, prediction: str = "eps", variance: str = "fixed_small", loss: str = "mse",
                 timestep_map: Sequence[int] | None = None, rescale_timesteps: bool = False,
                 original_num_steps: int | None = None, loss_weighting: str = "none",
                 min_snr_gamma: float = 5.0, p2_k: float = 1.0, p2_gamma: float = 1.0):
        """
        :param betas: (T,) noise schedule, T >= 2, values in (0, 1].
        :param prediction: "eps" or "x0".
        :param variance: "fixed_small", "fixed_large" or "learned_range".
        :param loss: "mse", "hybrid" or "kl".
        :param timestep_map: original timestep of each step (default: the identity).
        :param rescale_timesteps: call the model with t_orig * 1000 / original_num_steps (a float),
            as improved-diffusion's `rescale_timesteps` does, instead of the integer t_orig.
        :param original_num_steps: T of the unrespaced process (default: len(betas)).
        :param loss_weighting: "none", "min_snr" or "p2": the per-timestep weight of the MSE term
            (`mse_weights`); not with loss "kl", whose per-timestep weights are the bound's own.
        :param min_snr_gamma: min_snr's gamma > 0.
        :param p2_k: p2's k > 0.
        :param p2_gamma: p2's gamma > 0.
        """
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or len(betas) < 2 or not ((betas > 0) & (betas <= 1)).all():
            raise ValueError("betas must be a 1-D array of at least 2 values in (0, 1]")
        self.prediction, self.variance, self.loss = Prediction(prediction), Variance(variance), Loss(loss)
        self.weighting = Weighting(loss_weighting)
        if self.weighting is not Weighting.NONE and self.loss is Loss.KL:
            raise ValueError(f"loss weighting {loss_weighting!r} applies to the MSE term; loss 'kl' has none")
        if min(min_snr_gamma, p2_k, p2_gamma) <= 0:
            raise ValueError("min_snr_gamma, p2_k and p2_gamma must be > 0")
        self.num_timesteps = len(betas)
        self.time_scale = 1000.0 / (original_num_steps or len(betas)) if rescale_timesteps else None
        self.timestep_map = torch.as_tensor(
            list(timestep_map) if timestep_map is not None else range(self.num_timesteps), dtype=torch.int64)

        # All tables in float64 (IDDPM GaussianDiffusion.__init__).
        alphas = 1.0 - betas
        ac = np.cumprod(alphas)
        ac_prev = np.append(1.0, ac[:-1])
        ac_next = np.append(ac[1:], 0.0)
        posterior_variance = betas * (1.0 - ac_prev) / (1.0 - ac)  # beta~_t, eq. 7 of Ho et al.
        tables = dict(
            betas=betas, alphas_cumprod=ac, alphas_cumprod_prev=ac_prev, alphas_cumprod_next=ac_next,
            sqrt_alphas_cumprod=np.sqrt(ac), one_minus_alphas_cumprod=1.0 - ac,
            sqrt_one_minus_alphas_cumprod=np.sqrt(1.0 - ac),
            log_one_minus_alphas_cumprod=np.log(1.0 - ac),
            sqrt_recip_alphas_cumprod=np.sqrt(1.0 / ac), sqrt_recipm1_alphas_cumprod=np.sqrt(1.0 / ac - 1),
            posterior_variance=posterior_variance,
            # beta~_0 = 0: its log is replaced by that of beta~_1 (only used at t=0 where the
            # decoder, not the KL, is scored, and for the learned-range lower end).
            posterior_log_variance_clipped=np.log(np.append(posterior_variance[1], posterior_variance[1:])),
            posterior_mean_coef1=betas * np.sqrt(ac_prev) / (1.0 - ac),
            posterior_mean_coef2=(1.0 - ac_prev) * np.sqrt(alphas) / (1.0 - ac),
            log_betas=np.log(betas),
            # fixed_large: beta_t, but beta~_1 at t=0 so the decoder variance is not huge (IDDPM).
            large_variance=np.append(posterior_variance[1], betas[1:]),
            large_log_variance=np.log(np.append(posterior_variance[1], betas[1:])),
            mse_weights=mse_weights(ac, self.prediction, self.weighting, min_snr_gamma, p2_k, p2_gamma),
        )
        for name, arr in tables.items():
            setattr(self, name, torch.from_numpy(arr))  # (T,) float64, CPU
        self._device_tables: dict = {}  # (id(table), device, dtype) -> (table, its copy there): _on

    @property
    def learns_variance(self) -> bool:
        return self.variance is Variance.LEARNED_RANGE

    def _gather(self, table: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """table[t] as float32 on t's device, shaped (B, 1, ..., 1) to broadcast over ndim dims.

        The index stays on t's device: moving t to the host (or a table to the device) at every
        call made the CPU wait for the GPU five times a training step, so it could never queue a
        step ahead (1.3x the plain loop's step time on an H200, docs/BENCHMARKS.md "On a GPU").
        Rounding the float64 table to float32 before or after the gather gives the same values."""
        return self._on(table, t.device, torch.float32)[t].view(-1, *([1] * (ndim - 1)))

    def _on(self, table: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The table as `dtype` on `device`, converted once per (table, device) and kept."""
        key = (id(table), device, dtype)
        held = self._device_tables.get(key)
        if held is None or held[0] is not table:  # `held[0] is table`: an id is not reused while held
            held = self._device_tables[key] = (table, table.to(device=device, dtype=dtype))
        return held[1]

    def _call(self, model_fn: ModelFn, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Calls the model with the ORIGINAL timestep indices of a (possibly respaced) process
        (rescaled to [0, 1000) as floats under `rescale_timesteps`)."""
        t_orig = self._on(self.timestep_map, t.device, torch.int64)[t]
        return model_fn(x, t_orig if self.time_scale is None else t_orig.float() * self.time_scale)

    # --- q: the forward process ---

    def q_mean_variance(self, x0: torch.Tensor, t: torch.Tensor):
        """q(x_t | x_0) = N(sqrt(alpha_bar_t) x_0, (1 - alpha_bar_t) I) (Ho et al. eq. 4).

        :return: (mean, variance, log_variance), each shaped like x0.
        """
        mean = self._gather(self.sqrt_alphas_cumprod, t, x0.ndim) * x0
        var = self._gather(self.one_minus_alphas_cumprod, t, x0.ndim).expand_as(x0)
        log_var = self._gather(self.log_one_minus_alphas_cumprod, t, x0.ndim).expand_as(x0)
        return mean, var, log_var

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Draws x_t ~ q(x_t | x_0) = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) noise."""
        if noise is None:
            noise = torch.randn_like(x0)
        return (self._gather(self.sqrt_alphas_cumprod, t, x0.ndim) * x0
                + self._gather(self.sqrt_one_minus_alphas_cumprod, t, x0.ndim) * noise)

    def q_posterior_mean_variance(self, x0: torch.Tensor, xt: torch.Tensor, t: torch.Tensor):
        """q(x_{t-1} | x_t, x_0) = N(mu~_t, beta~_t I) (Ho et al. eq. 6-7):
        mu~_t = beta_t sqrt(alpha_bar_{t-1}) / (1 - alpha_bar_t) x_0
              + (1 - alpha_bar_{t-1}) sqrt(alpha_t) / (1 - alpha_bar_t) x_t,
        beta~_t = (1 - alpha_bar_{t-1}) / (1 - alpha_bar_t) beta_t.

        :return: (mean, variance, log_variance_clipped), each shaped like x_t; the log variance at
            t=0 (where beta~_0 = 0) is that of t=1.
        """
        mean = (self._gather(self.posterior_mean_coef1, t, xt.ndim) * x0
                + self._gather(self.posterior_mean_coef2, t, xt.ndim) * xt)
        return (mean, self._gather(self.posterior_variance, t, xt.ndim).expand_as(xt),
                self._gather(self.posterior_log_variance_clipped, t, xt.ndim).expand_as(xt))

    def _eps_from_x0(self, xt, t, x0):
        """eps = (x_t / sqrt(alpha_bar_t) - x_0) / sqrt(1/alpha_bar_t - 1)."""
        return ((self._gather(self.sqrt_recip_alphas_cumprod, t, xt.ndim) * xt - x0)
                / self._gather(self.sqrt_recipm1_alphas_cumprod, t, xt.ndim))

    def _x0_from_eps(self, xt, t, eps):
        """x_0 = x_t / sqrt(alpha_bar_t) - sqrt(1/alpha_bar_t - 1) eps."""
        return (self._gather(self.sqrt_recip_alphas_cumprod, t, xt.ndim) * xt
                - self._gather(self.sqrt_recipm1_alphas_cumprod, t, xt.ndim) * eps)

    # --- p: the reverse process ---

    def p_mean_variance(self, model_fn: ModelFn, xt: torch.Tensor, t: torch.Tensor, clip_denoised: bool = True,
                        model_output: torch.Tensor | None = None) -> dict:
        """p(x_{t-1} | x_t) = N(mean, variance) from the model's output (IDDPM `p_mean_variance`).

        Variance: fixed_small is (beta~_t, clipped log beta~_t); fixed_large is beta_t (beta~_1 at
        t=0); learned_range takes the model's extra channels v in [-1, 1], frac = (v + 1) / 2, and
        log sigma^2 = frac log beta_t + (1 - frac) log beta~_t (clipped) (IDDPM eq. 15).
        Mean: the posterior mean q_posterior_mean_variance(pred_x0, x_t, t), where pred_x0 is the
        model's x0, or x_0 from its eps; clipped to [-1, 1] when clip_denoised.

        :param model_fn: model_fn(x, t) -> (B, C or 2C, ...).
        :param xt: (B, C, ...) noisy input at step t.
        :param t: (B,) int64 step indices of this process.
        :param clip_denoised: clamp pred_x0 to [-1, 1].
        :param model_output: the model's output if already computed (then model_fn is not called).
        :return: dict(mean, variance, log_variance, pred_x0, eps), eps being the noise implied by
            the (clipped) pred_x0, as DDIM uses it.
        """
        out = self._call(model_fn, xt, t) if model_output is None else model_output
        c = xt.shape[1]
        if self.learns_variance:
            if out.shape[1] != 2 * c:
                raise ValueError(f"learned_range variance needs {2 * c} model output channels, got {out.shape[1]}")
            out, v = out[:, :c], out[:, c:]
            min_log = self._gather(self.posterior_log_variance_clipped, t, xt.ndim)
            max_log = self._gather(self.log_betas, t, xt.ndim)
            frac = (v + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
            variance = torch.exp(log_variance)
        else:
            if out.shape[1] != c:
                raise ValueError(f"{self.variance.value} variance needs {c} model output channels, got {out.shape[1]}")
            small = self.variance is Variance.FIXED_SMALL
            variance = self._gather(self.posterior_variance if small else self.large_variance, t, xt.ndim).expand_as(xt)
            log_variance = self._gather(
                self.posterior_log_variance_clipped if small else self.large_log_variance, t, xt.ndim).expand_as(xt)
        pred_x0 = out if self.prediction is Prediction.X0 else self._x0_from_eps(xt, t, out)
        if clip_denoised:
            pred_x0 = pred_x0.clamp(-1, 1)
        mean, _, _ = self.q_posterior_mean_variance(pred_x0, xt, t)
        return dict(mean=mean, variance=variance, log_variance=log_variance, pred_x0=pred_x0,
                    eps=self._eps_from_x0(xt, t, pred_x0))

    # --- losses ---

    def _vb_terms_bpd(self, model_output: torch.Tensor, x0, xt, t, clip_denoised: bool):
        """One term of the VLB in bits per dim (IDDPM `_vb_terms_bpd`): for t > 0,
        L_{t-1} = KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) (with the clipped posterior log
        variance); for t = 0, L_0 = -log p(x_0 | x_1), the discretised Gaussian decoder NLL.

        :return: ((B,) bits, the p_mean_variance dict).
        """
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x0, xt, t)
        out = self.p_mean_variance(None, xt, t, clip_denoised=clip_denoised, model_output=model_output)
        kl = mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])) / math.log(2.0)
        nll = -mean_flat(discretized_gaussian_log_likelihood(
            x0, means=out["mean"], log_scales=0.5 * out["log_variance"])) / math.log(2.0)
        return torch.where(t == 0, nll, kl), out

    def training_losses(self, model_fn: ModelFn, x0: torch.Tensor, t: torch.Tensor,
                        noise: torch.Tensor | None = None) -> dict:
        """Per-example training losses at steps t (IDDPM `training_losses`).

        - mse: mse = mean ||target - prediction||^2, target the noise (eps) or x_0 (x0). With a
          learned variance the VLB term vb is added, unscaled (IDDPM LossType.MSE).
        - hybrid: mse + vb * T/1000 (IDDPM LossType.RESCALED_MSE): L_hybrid = L_simple +
          lambda L_vlb with lambda = 1e-3, L_vlb estimated from one step as T * L_t. vb is
          computed with the predicted mean detached, so it trains only the variance. With a
          fixed variance vb is zero and loss = mse.
        - kl: loss = vb, the VLB term with gradients through mean and variance (IDDPM LossType.KL).
        vb is `_vb_terms_bpd` (bits/dim; the decoder NLL at t=0) with clip_denoised=False.

        A loss weighting (`mse_weights`) multiplies the MSE term only: loss = w_t mse + vb. The
        vb term stays unweighted, as IDDPM leaves it, since it trains only the variance and
        estimates the bound (reweighting it would change what it estimates). "mse" is returned
        unweighted, so its curve compares across weightings. The importance sampler's 1/(T p_t)
        multiplies "loss" outside, and its p_t is fit to this weighted loss (the loop feeds it
        "loss"), which is the variance-minimising choice for the weighted objective.

        :param model_fn: model_fn(x, t).
        :param x0: (B, C, ...) clean images in [-1, 1].
        :param t: (B,) int64 steps.
        :param noise: the noise of q_sample (default: torch.randn_like(x0)).
        :return: {"loss", "mse", "vb"}, each (B,); "mse" is for logging when loss is kl.
        """
        if noise is None:
            noise = torch.randn_like(x0)
        xt = self.q_sample(x0, t, noise)
        out = self._call(model_fn, xt, t)  # (B, C or 2C, ...)
        c = x0.shape[1]
        target = noise if self.prediction is Prediction.EPS else x0
        mse = mean_flat((target - out[:, :c]) ** 2)
        if self.loss is Loss.KL:
            vb, _ = self._vb_terms_bpd(out, x0, xt, t, clip_denoised=False)
            return {"loss": vb, "mse": mse.detach(), "vb": vb}
        # `none` skips the product: its loss is L_simple itself, bitwise, at no cost.
        simple = mse if self.weighting is Weighting.NONE else self._gather(self.mse_weights, t, 1) * mse
        if not self.learns_variance:
            return {"loss": simple, "mse": mse, "vb": torch.zeros_like(mse)}
        # The VLB trains only the variance: the mean it sees is a constant (stop-gradient).
        frozen = torch.cat([out[:, :c].detach(), out[:, c:]], dim=1)
        vb, _ = self._vb_terms_bpd(frozen, x0, xt, t, clip_denoised=False)
        if self.loss is Loss.HYBRID:
            # IDDPM: "divide by 1000 for equivalence with initial implementation"; without it the
            # VB term overwhelms the MSE term.
            vb = vb * (self.num_timesteps / 1000.0)
        return {"loss": simple + vb, "mse": mse, "vb": vb}

    # --- samplers ---

    @staticmethod
    def _randn(like: torch.Tensor | Sequence[int], generators, device=None) -> torch.Tensor:
        """Standard normal noise of like's shape: from the global RNG, or row k from generators[k]."""
        shape = tuple(like.shape) if isinstance(like, torch.Tensor) else tuple(like)
        device = like.device if isinstance(like, torch.Tensor) else device
        if generators is None:
            return torch.randn(*shape, device=device)
        if len(generators) != shape[0]:
            raise ValueError(f"got {len(generators)} generators for a batch of {shape[0]}")
        return torch.stack([torch.randn(shape[1:], generator=g, device=g.device) for g in generators]).to(device)

    def ddpm_step(self, model_fn: ModelFn, xt, t, noise, clip_denoised: bool = True) -> dict:
        """Ancestral step x_{t-1} = mean + sigma_t noise, no noise at t=0 (IDDPM `p_sample`)."""
        out = self.p_mean_variance(model_fn, xt, t, clip_denoised)
        nonzero = (t != 0).float().view(-1, *([1] * (xt.ndim - 1)))
        return {"sample": out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise,
                "pred_x0": out["pred_x0"]}

    def ddim_step(self, model_fn: ModelFn, xt, t, noise, eta: float = 0.0, clip_denoised: bool = True) -> dict:
        """DDIM step (Song et al. eq. 12; IDDPM `ddim_sample`), eps re-derived from the clipped x0:
        sigma = eta sqrt((1 - abar_prev) / (1 - abar)) sqrt(1 - abar / abar_prev),
        x_{t-1} = sqrt(abar_prev) x0 + sqrt(1 - abar_prev - sigma^2) eps + sigma noise (none at t=0).
        """
        out = self.p_mean_variance(model_fn, xt, t, clip_denoised)
        abar = self._gather(self.alphas_cumprod, t, xt.ndim)
        abar_prev = self._gather(self.alphas_cumprod_prev, t, xt.ndim)
        sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
        mean = out["pred_x0"] * torch.sqrt(abar_prev) + torch.sqrt(1 - abar_prev - sigma ** 2) * out["eps"]
        if noise is None:  # eta = 0: sigma is 0 and the step is deterministic
            return {"sample": mean, "pred_x0": out["pred_x0"]}
        nonzero = (t != 0).float().view(-1, *([1] * (xt.ndim - 1)))
        return {"sample": mean + nonzero * sigma * noise, "pred_x0": out["pred_x0"]}

    def ddim_reverse_step(self, model_fn: ModelFn, xt, t, clip_denoised: bool = False) -> dict:
        """Deterministic DDIM step forward in time, x_t -> x_{t+1} (IDDPM `ddim_reverse_sample`):
        x_{t+1} = sqrt(abar_{t+1}) x0 + sqrt(1 - abar_{t+1}) eps."""
        out = self.p_mean_variance(model_fn, xt, t, clip_denoised)
        abar_next = self._gather(self.alphas_cumprod_next, t, xt.ndim)
        return {"sample": out["pred_x0"] * torch.sqrt(abar_next) + torch.sqrt(1 - abar_next) * out["eps"],
                "pred_x0": out["pred_x0"]}

    @torch.no_grad()
    def _sample_loop(self, step, model_fn, shape, generators, x_T, progress, device,
                     step_noise: bool = True) -> torch.Tensor:
        """Runs `step` from t = T-1 down to 0 and returns the final x_0, clamped to [-1, 1].
        Without `step_noise` (deterministic DDIM) no per-step noise is drawn: `step` gets None."""
        if device is None:  # given, else x_T's, else the model_fn's (guided_model_fn sets it), else CPU
            device = x_T.device if x_T is not None else getattr(model_fn, "device", torch.device("cpu"))
        x = x_T.to(device) if x_T is not None else self._randn(shape, generators, device)
        n = self.num_timesteps
        for i, step_t in enumerate(reversed(range(n))):
            t = torch.full((x.shape[0],), step_t, dtype=torch.int64, device=device)
            x = step(model_fn, x, t, self._randn(x, generators) if step_noise else None)["sample"]
            if progress is not None:
                progress(i + 1, n)
        return x.clamp(-1, 1)

    def ddpm_sample(self, model_fn: ModelFn, shape, generators=None, x_T=None, clip_denoised: bool = True,
                    progress=None, device=None) -> torch.Tensor:
        """Ancestral sampling through all steps of this process (IDDPM `p_sample_loop`).

        :param model_fn: model_fn(x, t) (labels bound by the caller, see guided_model_fn).
        :param shape: (B, C, H, W).
        :param generators: one torch.Generator per image (initial and per-step noise), or None for
            the global RNG.
        :param x_T: the initial noise, if given.
        :param clip_denoised: clamp pred_x0 to [-1, 1] at each step.
        :param progress: optional callback progress(steps_done, steps_total).
        :param device: where to sample (default: x_T's device, else `model_fn.device` as set by
            guided_model_fn, else CPU). Noise is drawn on the generators' device and moved here, so
            CPU generators give the same images on any device (up to kernel differences).
        :return: (B, C, H, W) samples in [-1, 1].
        """
        def step(fn, x, t, noise):
            return self.ddpm_step(fn, x, t, noise, clip_denoised)

        return self._sample_loop(step, model_fn, shape, generators, x_T, progress, device)

    def ddim_sample(self, model_fn: ModelFn, shape, generators=None, x_T=None, clip_denoised: bool = True,
                    progress=None, eta: float = 0.0, device=None) -> torch.Tensor:
        """DDIM sampling through all steps of this process (IDDPM `ddim_sample_loop`); eta=0 is
        deterministic given x_T. Arguments as ddpm_sample; eta scales the per-step noise."""
        def step(fn, x, t, noise):
            return self.ddim_step(fn, x, t, noise, eta, clip_denoised)

        # eta = 0 adds no noise: skipping the per-image draws saves a randn per image and step.
        return self._sample_loop(step, model_fn, shape, generators, x_T, progress, device, step_noise=eta > 0)

    @torch.no_grad()
    def ddim_reverse_sample(self, model_fn: ModelFn, x0: torch.Tensor, clip_denoised: bool = False,
                            progress=None) -> torch.Tensor:
        """Encodes x_0 into noise with the deterministic DDIM ODE: ddim_reverse_step for
        t = 0 .. T-2, treating x_0 as the state at step 0 (alpha_bar_0 is ~1). Returns the state at
        step T-1, which is what ddim_sample starts from, so ddim_sample(x_T=this, eta=0) gives x_0
        back up to discretisation error. (A step from T-1 would go to alpha_bar = 0 and keep
        only the predicted eps, losing x_0.) clip_denoised defaults to False because clipping
        breaks invertibility.

        :param model_fn: model_fn(x, t).
        :param x0: (B, C, ...) images in [-1, 1].
        :param clip_denoised: clamp pred_x0 to [-1, 1] at each step.
        :param progress: optional callback progress(steps_done, steps_total).
        :return: the latent x_{T-1}, shaped like x0.
        """
        x, n = x0, self.num_timesteps - 1
        for i in range(n):
            t = torch.full((x.shape[0],), i, dtype=torch.int64, device=x.device)
            x = self.ddim_reverse_step(model_fn, x, t, clip_denoised)["sample"]
            if progress is not None:
                progress(i + 1, n)
        return x

    # --- likelihood ---

    def prior_bpd(self, x0: torch.Tensor) -> torch.Tensor:
        """KL(q(x_T | x_0) || N(0, I)) in bits per dim, (B,) (IDDPM `_prior_bpd`)."""
        t = torch.full((x0.shape[0],), self.num_timesteps - 1, dtype=torch.int64, device=x0.device)
        mean, _, log_var = self.q_mean_variance(x0, t)
        return mean_flat(normal_kl(mean, log_var, 0.0, 0.0)) / math.log(2.0)

    @torch.no_grad()
    def bits_per_dim(self, model_fn: ModelFn, x0: torch.Tensor, clip_denoised: bool = True,
                     generators=None, timesteps_per_call: int = 1) -> dict:
        """The full variational bound in bits per dim (IDDPM `calc_bpd_loop`): for each step
        t = T-1 down to 0 draw x_t ~ q(x_t | x_0) and score L_t (`_vb_terms_bpd`, the discretised
        decoder at t=0); total = sum_t L_t + prior_bpd.

        :param x0: (B, C, ...) images on the 8-bit grid in [-1, 1].
        :param generators: one per image, or None for the global RNG (drawn in IDDPM's order).
        :param timesteps_per_call: score k consecutive timesteps in one model call of k*B rows
            (timestep-major: rows [j*B, (j+1)*B) are the whole batch at the j-th step of the
            chunk), which is much faster for small B. Noise is drawn in the same order as with
            k=1, so the result is the same up to float rounding. A `model_fn` that binds labels
            must therefore accept them repeated: `y.repeat(k)`.
        :return: dict(total_bpd (B,), prior_bpd (B,), vb (B, T), mse (B, T), xstart_mse (B, T)),
            where column t of vb/mse/xstart_mse is timestep t (IDDPM stacks them in loop order,
            i.e. reversed), mse is the eps MSE and xstart_mse the x_0 MSE.
        """
        n, b = self.num_timesteps, x0.shape[0]
        vb, mse, xstart_mse = [None] * n, [None] * n, [None] * n
        order = list(reversed(range(n)))
        for start in range(0, n, timesteps_per_call):
            steps = order[start:start + timesteps_per_call]
            k = len(steps)
            t = torch.cat([torch.full((b,), s, dtype=torch.int64, device=x0.device) for s in steps])
            noise = torch.cat([self._randn(x0, generators) for _ in steps])
            x0k = x0.repeat(k, *([1] * (x0.dim() - 1)))
            xt = self.q_sample(x0k, t, noise)
            if k < timesteps_per_call and timesteps_per_call > 1:
                # the last chunk is short: pad to the size the caller's closure expects
                pad = timesteps_per_call - k
                out_model = self._call(model_fn, torch.cat([xt, xt[:b].repeat(pad, *([1] * (xt.dim() - 1)))]),
                                       torch.cat([t, t[:b].repeat(pad)]))[: k * b]
            else:
                out_model = self._call(model_fn, xt, t)
            terms, out = self._vb_terms_bpd(out_model, x0k, xt, t, clip_denoised)
            x_err = mean_flat((out["pred_x0"] - x0k) ** 2)
            e_err = mean_flat((out["eps"] - noise) ** 2)
            for j, s in enumerate(steps):
                rows = slice(j * b, (j + 1) * b)
                vb[s], xstart_mse[s], mse[s] = terms[rows], x_err[rows], e_err[rows]
        vb = torch.stack(vb, dim=1)
        prior = self.prior_bpd(x0)
        return {"total_bpd": vb.sum(dim=1) + prior, "prior_bpd": prior, "vb": vb,
                "mse": torch.stack(mse, dim=1), "xstart_mse": torch.stack(xstart_mse, dim=1)}


def from_params(diffusion_params, respacing: str = "") -> GaussianDiffusion:
    """The process of params.yaml's `diffusion:` section, optionally respaced.

    Respacing (IDDPM `SpacedDiffusion`): keep the steps of space_timesteps(T, respacing) and
    re-derive betas from the kept alpha_bar values, beta'_i = 1 - abar_{k_i} / abar_{k_{i-1}}, so
    alpha_bar is unchanged at every kept step; `timestep_map` records the original indices the
    model is called with.

    :param diffusion_params: a `ddpmrepro.params.DiffusionParams`.
    :param respacing: "" (all steps), "ddimN" or section counts such as "10,15,20" (see
        `respace.space_timesteps`; ValueError when the string cannot respace this T).
    """
    p = diffusion_params
    betas = get_beta_schedule(p.schedule, p.timesteps)
    kept = list(range(p.timesteps))
    if respacing:
        use = space_timesteps(p.timesteps, respacing)
        alphas_cumprod = np.cumprod(1.0 - betas)
        last, new_betas, kept = 1.0, [], []
        for i, ac in enumerate(alphas_cumprod):
            if i in use:
                new_betas.append(1 - ac / last)
                last = ac
                kept.append(i)
        betas = np.array(new_betas)
    # The keys of the weighting not chosen are null (params.py refuses them set).
    weighting = {k: v for k in ("min_snr_gamma", "p2_k", "p2_gamma") if (v := getattr(p, k)) is not None}
    return GaussianDiffusion(betas, p.prediction, p.variance, p.loss, timestep_map=kept,
                             rescale_timesteps=getattr(p, "rescale_timesteps", False), original_num_steps=p.timesteps,
                             # `learned` is applied by the training loop (training/learned_weighting.py): here w_t = 1.
                             loss_weighting="none" if p.loss_weighting == "learned" else p.loss_weighting, **weighting)


__all__ = [
    "GaussianDiffusion", "from_params", "get_beta_schedule", "space_timesteps", "normal_kl",
    "discretized_gaussian_log_likelihood", "approx_standard_normal_cdf", "guided_model_fn", "mean_flat",
    "Prediction", "Variance", "Loss", "Weighting", "mse_weights",
]
