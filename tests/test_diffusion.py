"""Diffusion math against closed forms and invariants (never against the code itself)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from ddpmrepro.model import diffusion as D
from ddpmrepro.params import DiffusionParams


def make(T=100, schedule="linear", **kw) -> D.GaussianDiffusion:
    return D.GaussianDiffusion(D.get_beta_schedule(schedule, T), **kw)


def alpha_bar(betas: np.ndarray) -> np.ndarray:
    """Cumulative product written out, in float64: an independent alpha_bar."""
    out, acc = [], 1.0
    for b in betas:
        acc *= 1.0 - b
        out.append(acc)
    return np.array(out)


def smooth_eps_model(x, t):
    """A fixed stand-in eps model, smooth in x and t."""
    return 0.3 * torch.tanh(x) + 0.01 * torch.cos(t.float())[:, None, None, None]


# --- schedules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("T,lo,hi", [(1000, 1e-4, 0.02), (4000, 2.5e-5, 0.005), (250, 4e-4, 0.08)])
def test_linear_schedule_endpoints_scale_with_T(T, lo, hi):
    b = D.get_beta_schedule("linear", T)
    assert b.dtype == np.float64 and b.shape == (T,)
    assert b[0] == pytest.approx(lo, rel=1e-12) and b[-1] == pytest.approx(hi, rel=1e-12)
    assert np.all(np.diff(b) > 0)


@pytest.mark.parametrize("T", [50, 1000, 4000])
def test_cosine_schedule_is_capped_and_matches_formula(T):
    b = D.get_beta_schedule("cosine", T)
    assert b.dtype == np.float64 and b.max() <= 0.999
    assert b[-1] == 0.999  # the singular last step is capped
    f = lambda u: np.cos((u + 0.008) / 1.008 * np.pi / 2) ** 2  # noqa: E731
    expected = f(np.arange(1, T + 1) / T) / f(0.0)  # Nichol & Dhariwal eq. 17, alpha_bar_t = f(t)/f(0)
    ab = alpha_bar(b)
    np.testing.assert_allclose(ab[:-1], expected[:-1], rtol=1e-9, atol=1e-15)


def test_unknown_schedule_raises():
    with pytest.raises(ValueError, match="schedule"):
        D.get_beta_schedule("quadratic", 10)


# --- q -----------------------------------------------------------------------------------------


def test_q_sample_empirical_moments_match_closed_form():
    torch.manual_seed(0)
    diff = make(T=1000, schedule="cosine")
    ab = alpha_bar(D.get_beta_schedule("cosine", 1000))
    n = 200_000
    x0 = torch.full((n, 1), 0.7)
    for step in [0, 10, 500, 999]:
        xt = diff.q_sample(x0, torch.full((n,), step, dtype=torch.int64))
        mean, var = xt.mean().item(), xt.var().item()
        sd = math.sqrt(1 - ab[step])
        assert mean == pytest.approx(math.sqrt(ab[step]) * 0.7, abs=5 * sd / math.sqrt(n) + 1e-6)
        assert var == pytest.approx(1 - ab[step], rel=0.02, abs=1e-6)
        m, v, lv = diff.q_mean_variance(x0[:2], torch.tensor([step, step]))
        assert m[0, 0].item() == pytest.approx(math.sqrt(ab[step]) * 0.7, rel=1e-6)
        assert v[0, 0].item() == pytest.approx(1 - ab[step], rel=1e-5)
        assert lv[0, 0].item() == pytest.approx(math.log(1 - ab[step]), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("step", [1, 2, 37, 99])
def test_posterior_matches_bayes_rule_on_gaussians(step):
    """q(x_{t-1}|x_t,x_0) ∝ q(x_t|x_{t-1}) q(x_{t-1}|x_0): multiply the two Gaussians in x_{t-1}."""
    betas = D.get_beta_schedule("linear", 100)
    diff = D.GaussianDiffusion(betas)
    ab = alpha_bar(betas)
    beta, ab_prev = betas[step], ab[step - 1]
    # Precision-weighted combination of N(x_t / sqrt(alpha), beta/alpha) and N(sqrt(ab_prev) x0, 1-ab_prev).
    prec = (1 - beta) / beta + 1 / (1 - ab_prev)
    x0, xt = torch.tensor([[0.3, -0.8]]), torch.tensor([[1.1, 0.2]])
    mean_ref = (math.sqrt(1 - beta) / beta * xt.double() + math.sqrt(ab_prev) / (1 - ab_prev) * x0.double()) / prec
    mean, var, log_var = diff.q_posterior_mean_variance(x0, xt, torch.tensor([step]))
    torch.testing.assert_close(mean.double(), mean_ref, rtol=1e-5, atol=1e-6)
    assert var.shape == log_var.shape == xt.shape
    np.testing.assert_allclose(var.double().numpy(), 1 / prec, rtol=1e-5)
    np.testing.assert_allclose(log_var.double().numpy(), math.log(1 / prec), rtol=1e-5)


def test_posterior_at_t0_is_x0_with_clipped_log_variance():
    betas = D.get_beta_schedule("linear", 100)
    diff = D.GaussianDiffusion(betas)
    x0, xt = torch.tensor([[0.3, -0.8]]), torch.tensor([[1.1, 0.2]])
    mean, var, log_var = diff.q_posterior_mean_variance(x0, xt, torch.tensor([0]))
    torch.testing.assert_close(mean, x0)
    assert (var == 0).all()
    ab = alpha_bar(betas)
    assert log_var[0, 0].item() == pytest.approx(math.log(betas[1] * (1 - ab[0]) / (1 - ab[1])), rel=1e-5)


# --- Gaussian helpers ------------------------------------------------------------------------------


def test_normal_kl_zero_for_identical_and_matches_torch_distributions():
    m, lv = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(D.normal_kl(m, lv, m, lv), torch.zeros(5), atol=1e-6, rtol=0)
    m2, lv2 = torch.randn(5), torch.randn(5)
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(m, torch.exp(0.5 * lv)), torch.distributions.Normal(m2, torch.exp(0.5 * lv2)))
    torch.testing.assert_close(D.normal_kl(m, lv, m2, lv2), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mean,log_scale", [(0.0, -3.0), (0.37, -1.0), (-0.99, -5.0), (1.2, 0.5)])
def test_discretized_gaussian_sums_to_one_over_256_bins(mean, log_scale):
    bins = torch.arange(256, dtype=torch.float64) / 127.5 - 1  # the 8-bit grid in [-1, 1]
    logp = D.discretized_gaussian_log_likelihood(
        bins, torch.full_like(bins, mean), torch.full_like(bins, log_scale))
    assert torch.exp(logp).sum().item() == pytest.approx(1.0, abs=1e-6)


def test_discretized_gaussian_interior_bin_is_the_cdf_difference():
    x, mu, sigma = torch.tensor([0.2]), torch.tensor([0.1]), 0.3
    exact = torch.distributions.Normal(mu, sigma)
    ref = exact.cdf(x + 1 / 255) - exact.cdf(x - 1 / 255)
    got = torch.exp(D.discretized_gaussian_log_likelihood(x, mu, torch.tensor([math.log(sigma)])))
    assert got.item() == pytest.approx(ref.item(), rel=2e-3)  # tanh approximation of the CDF


# --- p -----------------------------------------------------------------------------------------


def test_learned_range_endpoints():
    betas = D.get_beta_schedule("cosine", 100)
    diff = D.GaussianDiffusion(betas, variance="learned_range")
    ab = alpha_bar(betas)
    post = betas[1:] * (1 - ab[:-1]) / (1 - ab[1:])  # beta~_t for t >= 1
    clipped_log_post = np.log(np.append(post[0], post))  # log beta~_t, with t=0 taking t=1's value
    x = torch.zeros(4, 1, 2, 2)
    t = torch.tensor([0, 1, 50, 99])
    for v, expected in [(-1.0, clipped_log_post), (1.0, np.log(betas))]:
        out = diff.p_mean_variance(lambda x_, t_: torch.cat([torch.zeros_like(x_), torch.full_like(x_, v)], 1), x, t)
        got = out["log_variance"][:, 0, 0, 0].double().numpy()
        np.testing.assert_allclose(got, expected[t.numpy()], rtol=1e-5)
        torch.testing.assert_close(out["variance"], torch.exp(out["log_variance"]))


def test_fixed_variances():
    betas = D.get_beta_schedule("linear", 100)
    ab = alpha_bar(betas)
    post = betas * (1 - np.append(1.0, ab[:-1])) / (1 - ab)
    x, t = torch.zeros(3, 1, 2, 2), torch.tensor([0, 1, 60])
    zero = lambda x_, t_: torch.zeros_like(x_)  # noqa: E731
    small = D.GaussianDiffusion(betas, variance="fixed_small").p_mean_variance(zero, x, t)
    large = D.GaussianDiffusion(betas, variance="fixed_large").p_mean_variance(zero, x, t)
    np.testing.assert_allclose(small["variance"][:, 0, 0, 0].numpy(), post[[0, 1, 60]], rtol=1e-5)
    np.testing.assert_allclose(large["variance"][:, 0, 0, 0].numpy(), [post[1], betas[1], betas[60]], rtol=1e-5)


def test_x0_prediction_and_eps_prediction_agree():
    """An x0-model and the eps-model that implies the same x0 give the same p."""
    diff_eps, diff_x0 = make(prediction="eps"), make(prediction="x0")
    ab = alpha_bar(D.get_beta_schedule("linear", 100))
    torch.manual_seed(0)
    x0, eps = torch.rand(4, 1, 3, 3) - 0.5, torch.randn(4, 1, 3, 3)
    t = torch.tensor([0, 5, 50, 99])
    a = torch.tensor(ab[t.numpy()], dtype=torch.float32).view(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
    p1 = diff_eps.p_mean_variance(lambda x_, t_: eps, xt, t, clip_denoised=False)
    p2 = diff_x0.p_mean_variance(lambda x_, t_: x0, xt, t, clip_denoised=False)
    torch.testing.assert_close(p1["pred_x0"], x0, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(p2["eps"], eps, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(p1["mean"], p2["mean"], rtol=1e-3, atol=1e-3)


# --- losses ------------------------------------------------------------------------------------


def test_training_losses_zero_for_a_perfect_model():
    torch.manual_seed(0)
    x0, noise, t = torch.rand(4, 1, 4, 4) * 2 - 1, torch.randn(4, 1, 4, 4), torch.tensor([0, 3, 40, 99])
    eps_terms = make(prediction="eps").training_losses(lambda x_, t_: noise, x0, t, noise=noise)
    x0_terms = make(prediction="x0").training_losses(lambda x_, t_: x0, x0, t, noise=noise)
    for terms in (eps_terms, x0_terms):
        assert set(terms) == {"loss", "mse", "vb"} and terms["loss"].shape == (4,)
        torch.testing.assert_close(terms["loss"], torch.zeros(4))
        torch.testing.assert_close(terms["vb"], torch.zeros(4))


def test_hybrid_vb_is_the_kl_term_rescaled_and_trains_only_the_variance():
    T = 200
    hybrid = make(T=T, variance="learned_range", loss="hybrid")
    kl = make(T=T, variance="learned_range", loss="kl")
    torch.manual_seed(0)
    x0 = torch.randint(0, 256, (4, 1, 4, 4)).float() / 127.5 - 1
    noise, t = torch.randn_like(x0), torch.tensor([0, 1, 100, 199])
    out = torch.randn(4, 2, 4, 4).clamp(-0.9, 0.9).requires_grad_()
    h = hybrid.training_losses(lambda x_, t_: out, x0, t, noise=noise)
    k = kl.training_losses(lambda x_, t_: out, x0, t, noise=noise)
    torch.testing.assert_close(h["vb"], k["vb"] * T / 1000)
    torch.testing.assert_close(k["loss"], k["vb"])
    torch.testing.assert_close(h["loss"], h["mse"] + h["vb"])
    (grad,) = torch.autograd.grad(h["vb"].sum(), out)
    assert grad[:, 0].abs().max() == 0  # stop-gradient on the mean
    assert grad[:, 1].abs().max() > 0
    (grad,) = torch.autograd.grad(k["loss"].sum(), out)
    assert grad[:, 0].abs().max() > 0  # the pure VLB trains the mean too


def test_vb_at_t0_is_the_decoder_nll_and_model_sees_original_steps():
    diff = from_params_ddim(10)
    seen = []

    def model_fn(x, t):
        seen.append(t.clone())
        return torch.zeros_like(x)

    x0 = torch.zeros(2, 1, 2, 2)
    out = diff.bits_per_dim(model_fn, x0, generators=[torch.Generator().manual_seed(i) for i in range(2)])
    assert out["vb"].shape == (2, 10) and out["mse"].shape == (2, 10)
    assert torch.stack(seen)[:, 0].tolist() == list(range(900, -1, -100))  # original indices, T-1 first
    torch.testing.assert_close(out["total_bpd"], out["vb"].sum(1) + out["prior_bpd"])
    assert (out["vb"] >= 0).all()


def test_coefficient_gathers_stay_on_the_timesteps_device_and_round_as_before():
    # On a GPU, moving t to the host (or a table to the device) at each gather made the CPU wait
    # for the GPU five times a training step (docs/BENCHMARKS.md "On a GPU"). A `meta` tensor
    # cannot be copied to the host, so the whole loss runs on it only if nothing is.
    diff = D.GaussianDiffusion(D.get_beta_schedule("cosine", 50), "eps", "learned_range", "hybrid",
                               timestep_map=range(0, 100, 2))
    t = torch.tensor([0, 7, 49, 7]).to("meta")
    x0 = torch.zeros(4, 1, 8, 8, device="meta")
    seen = []

    def model_fn(x, t_model):
        seen.append(t_model)
        return torch.zeros(4, 2, 8, 8, device="meta")

    out = diff.training_losses(model_fn, x0, t, noise=torch.zeros_like(x0))
    assert {v.device.type for v in out.values()} == {"meta"} and seen[0].device.type == "meta"
    # The float64 tables are rounded to float32 before the gather now, after it before: the same values.
    t_cpu = torch.tensor([0, 7, 49, 7])
    for name in ("sqrt_alphas_cumprod", "one_minus_alphas_cumprod", "posterior_log_variance_clipped", "mse_weights"):
        table = getattr(diff, name)
        assert torch.equal(diff._gather(table, t_cpu, 4).flatten(), table[t_cpu].float()), name
    assert torch.equal(diff.one_minus_alphas_cumprod, 1.0 - diff.alphas_cumprod)


@pytest.mark.gpu
def test_training_losses_never_wait_for_the_gpu():
    diff = D.GaussianDiffusion(D.get_beta_schedule("linear", 100), "eps", "learned_range", "hybrid")
    x0 = torch.randn(8, 3, 8, 8, device="cuda")
    t = torch.randint(0, 100, (8,), device="cuda")

    def model_fn(x, t):  # eps and the variance's interpolation
        return torch.cat([smooth_eps_model(x, t), torch.zeros_like(x)], dim=1)

    diff.training_losses(model_fn, x0, t)  # the first call moves the tables to the GPU, once
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = diff.training_losses(model_fn, x0, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(losses["loss"]).all()


# --- respacing ------------------------------------------------------------------------------------


def from_params_ddim(n, T=1000, schedule="linear", **kw):
    return D.from_params(DiffusionParams(timesteps=T, schedule=schedule, **kw), respacing=f"ddim{n}")


@pytest.mark.parametrize("respacing,n", [("ddim50", 50), ("ddim25", 25), ("10,15,20", 45), ("", 1000)])
def test_respacing_keeps_alpha_bar_at_kept_steps(respacing, n):
    p = DiffusionParams(timesteps=1000, schedule="cosine")
    spaced = D.from_params(p, respacing)
    ab = alpha_bar(D.get_beta_schedule("cosine", 1000))
    kept = spaced.timestep_map.numpy()
    assert spaced.num_timesteps == n and len(kept) == n
    np.testing.assert_allclose(spaced.alphas_cumprod.numpy(), ab[kept], rtol=1e-10)


# --- samplers -----------------------------------------------------------------------------------


def test_ddim_reverse_then_ddim_is_exact_for_a_constant_eps_model():
    """With eps independent of x and t the DDIM ODE steps are exact, so the round trip returns the
    x_0 that the first reverse step predicts, (x0 - sqrt(1 - abar_0) c) / sqrt(abar_0)."""
    diff = from_params_ddim(50, schedule="cosine")
    torch.manual_seed(0)
    x0, c = (torch.rand(4, 1, 4, 4) - 0.5) * 1.4, torch.randn(1, 1, 4, 4) * 0.5
    model_fn = lambda x, t: c.expand_as(x)  # noqa: E731
    x_T = diff.ddim_reverse_sample(model_fn, x0)
    a = diff.ddim_sample(model_fn, x0.shape, x_T=x_T, clip_denoised=False)
    b = diff.ddim_sample(model_fn, x0.shape, x_T=x_T, clip_denoised=False)
    assert torch.equal(a, b)  # eta = 0: deterministic given x_T
    ab0 = float(diff.alphas_cumprod[0])
    torch.testing.assert_close(a, (x0 - math.sqrt(1 - ab0) * c) / math.sqrt(ab0), rtol=0, atol=1e-4)
    assert (x_T - x0).abs().mean() > 0.3  # it did travel to noise and back


def test_ddim_reverse_then_ddim_converges_for_a_smooth_model():
    """For an x-dependent model the round trip is exact only as the step shrinks (first order)."""
    torch.manual_seed(0)
    x0 = (torch.rand(4, 1, 4, 4) - 0.5) * 1.4
    errors = []
    for n in (100, 1000):
        diff = from_params_ddim(n)
        x_T = diff.ddim_reverse_sample(smooth_eps_model, x0)
        errors.append((diff.ddim_sample(smooth_eps_model, x0.shape, x_T=x_T, clip_denoised=False) - x0).abs().max())
    assert errors[1] < 1.5e-2 and errors[1] < errors[0] / 5


@pytest.mark.parametrize("sampler", ["ddpm", "ddim_eta1"])
def test_per_image_generators_make_images_independent_of_batch(sampler):
    diff = from_params_ddim(20)
    run = (lambda fn, shape, g: diff.ddpm_sample(fn, shape, generators=g)) if sampler == "ddpm" else \
        (lambda fn, shape, g: diff.ddim_sample(fn, shape, generators=g, eta=1.0))
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    big = run(smooth_eps_model, (8, 1, 4, 4), gens(range(8)))
    small = run(smooth_eps_model, (3, 1, 4, 4), gens(range(3)))
    torch.testing.assert_close(big[:3], small, rtol=0, atol=1e-6)
    assert not torch.allclose(big[0], big[1])
    assert big.min() >= -1 and big.max() <= 1


def test_deterministic_ddim_draws_no_step_noise_and_equals_steps_with_zero_noise():
    diff = from_params_ddim(20)
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    fast = diff.ddim_sample(smooth_eps_model, (3, 1, 4, 4), generators=gens, eta=0.0)
    # the initial noise is the only draw: every generator has advanced by exactly one image's randn
    for s, g in enumerate(gens):
        ref = torch.Generator().manual_seed(s)
        torch.randn((1, 4, 4), generator=ref)
        assert torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=ref))
    x = torch.stack([torch.randn((1, 4, 4), generator=torch.Generator().manual_seed(s)) for s in range(3)])
    for i in reversed(range(diff.num_timesteps)):  # the same steps, given explicit zero noise
        x = diff.ddim_step(smooth_eps_model, x, torch.full((3,), i), torch.zeros_like(x), eta=0.0)["sample"]
    torch.testing.assert_close(fast, x.clamp(-1, 1), rtol=0, atol=0)


def test_sampler_progress_callback():
    diff, calls = from_params_ddim(5), []
    diff.ddim_sample(smooth_eps_model, (1, 1, 2, 2), progress=lambda i, n: calls.append((i, n)))
    assert calls == [(i, 5) for i in range(1, 6)]


# --- guidance -------------------------------------------------------------------------------------


class LabelModel(nn.Module):
    """A stand-in conditional model with 2C output channels; counts its forward passes."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, t, y):
        self.calls += 1
        yy = y.float()[:, None, None, None]
        return torch.cat([x * (1 + yy), x + yy], dim=1)


def test_guidance_zero_is_the_conditional_model_and_guides_only_eps():
    model = LabelModel()
    x, t, y = torch.randn(3, 1, 2, 2), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])
    null = 10
    assert torch.equal(D.guided_model_fn(model, y, 0.0, null)(x, t), model(x, t, y))
    model.calls = 0
    w = 2.0
    out = D.guided_model_fn(model, y, w, null)(x, t)
    assert model.calls == 1  # one doubled batch
    cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, null))
    torch.testing.assert_close(out[:, :1], (1 + w) * cond[:, :1] - w * uncond[:, :1])
    torch.testing.assert_close(out[:, 1:], cond[:, 1:])
    assert D.guided_model_fn(model, y, w, null).device == y.device  # where samplers put their noise


# --- bits/dim ------------------------------------------------------------------------------------


def test_prior_bpd_of_zero_image_matches_closed_form():
    betas = D.get_beta_schedule("linear", 1000)
    diff = D.GaussianDiffusion(betas)
    s2 = 1 - alpha_bar(betas)[-1]  # q(x_T | x_0 = 0) = N(0, s2)
    expected = 0.5 * (s2 - 1 - math.log(s2)) / math.log(2)
    got = diff.prior_bpd(torch.zeros(2, 3, 4, 4))
    torch.testing.assert_close(got, torch.full((2,), expected, dtype=torch.float32), rtol=1e-3, atol=1e-9)


# --- learning end to end ------------------------------------------------------------------------------


class PointMLP(nn.Module):
    """A small eps model for 2-D points: MLP on (x, sinusoidal t)."""

    def __init__(self, T: int):
        super().__init__()
        self.T = T
        self.net = nn.Sequential(nn.Linear(2 + 16, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 2))

    def forward(self, x, t):
        freqs = torch.exp(-math.log(1000.0) * torch.arange(8) / 8)
        args = t.float()[:, None] * freqs[None]
        return self.net(torch.cat([x, torch.cos(args), torch.sin(args)], dim=1))


@pytest.fixture
def one_thread():
    """Tiny ops run fastest on one thread (two threads on a busy 2-core box are 4x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_training_on_two_points_lowers_loss_and_samples_land_on_them(one_thread):
    torch.manual_seed(0)
    T = 100
    diff = D.GaussianDiffusion(D.get_beta_schedule("cosine", T))
    points = torch.tensor([[-0.5, -0.5], [0.5, 0.5]])
    model = PointMLP(T)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(1500):
        x0 = points[torch.randint(0, 2, (256,))]
        t = torch.randint(0, T, (256,))
        loss = diff.training_losses(model, x0, t)["loss"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-100:]) < 0.5 * np.mean(losses[:20])
    with torch.no_grad():
        samples = diff.ddpm_sample(model, (400, 2), generators=[torch.Generator().manual_seed(i) for i in range(400)])
    dist = torch.cdist(samples, points)  # (400, 2)
    near = dist.min(dim=1).values < 0.1
    assert near.float().mean() > 0.9
    share = (dist.argmin(dim=1) == 0).float().mean()
    assert 0.25 < share < 0.75


def test_bits_per_dim_batched_over_timesteps_equals_one_step_per_call():
    # Scoring k timesteps per model call is an implementation detail: same noise, same VLB.
    from ddpmrepro.model.diffusion import GaussianDiffusion, get_beta_schedule

    d = GaussianDiffusion(get_beta_schedule("cosine", 20), variance="learned_range", loss="hybrid")
    torch.manual_seed(0)
    w = torch.randn(6, 2, 1, 1)

    def model_fn(x, t):  # a fixed stand-in model: eps and v depend on x and t
        return torch.tanh(torch.einsum("oc,bchw->bohw", w[:, :, 0, 0], x) * (1 + t[:, None, None, None] / 20))[:, :4]

    x0 = (torch.randint(0, 256, (3, 2, 4, 4)) / 127.5 - 1).float()
    ref = d.bits_per_dim(model_fn, x0, generators=[torch.Generator().manual_seed(i) for i in range(3)])
    for k in (3, 7):
        out = d.bits_per_dim(model_fn, x0, generators=[torch.Generator().manual_seed(i) for i in range(3)],
                             timesteps_per_call=k)
        assert torch.allclose(out["total_bpd"], ref["total_bpd"], atol=1e-5)
        assert torch.allclose(out["vb"], ref["vb"], atol=1e-5)
