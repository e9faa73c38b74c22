"""The fast samplers (model/samplers.py) against independent truth: exact reductions to our own
DDIM/DDPM steps, the measured order of convergence on a Gaussian mixture whose noise prediction is
known in closed form (reference: scipy's DOP853 on the probability-flow ODE), and step-for-step
parity with diffusers' schedulers (a peer implementation)."""
import math

import numpy as np
import pytest
import torch

from ddpmrepro.model import samplers as S
from ddpmrepro.model.diffusion import GaussianDiffusion, from_params, get_beta_schedule
from ddpmrepro.model.unet import build_unet
from ddpmrepro.params import DiffusionParams, ModelParams

pytestmark = pytest.mark.usefixtures("one_thread")


def table(schedule: str, T: int = 1000) -> S.LambdaSchedule:
    return S.LambdaSchedule.from_betas(get_beta_schedule(schedule, T))


# --- the continuous view ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule,T", [("cosine", 1000), ("linear", 1000), ("cosine", 4000)])
def test_lambda_view_is_exact_at_the_indices_and_its_inverse_round_trips(schedule, T):
    ac = np.cumprod(1 - get_beta_schedule(schedule, T))
    sched = S.LambdaSchedule(ac)
    n = np.arange(T, dtype=np.float64)
    alpha, sigma, lam = sched.alpha_sigma_lambda(n)
    np.testing.assert_allclose(alpha ** 2, ac, rtol=1e-12)
    np.testing.assert_allclose(sigma ** 2, 1 - ac, rtol=1e-10)
    u = np.linspace(0, T - 1, 777)
    np.testing.assert_allclose(sched.index(sched.lam(u)), u, atol=1e-7 * T)
    assert (np.diff(sched.lam(u)) < 0).all()  # lambda decreases along the index, between indices too


def test_the_cosine_tail_is_clipped_at_lambda_min_and_the_linear_table_is_not():
    cos, lin = table("cosine"), table("linear")
    assert cos.lam(999.0) == pytest.approx(-9.918, abs=1e-3)  # the tail (notes: -9.918)
    u = S.start_index(cos, -5.1)
    assert 994 < u < 996 and cos.lam(u) == pytest.approx(-5.1)
    assert S.start_index(lin, -5.1) == 999.0  # linear ends at -5.06: nothing to clip


@pytest.mark.parametrize("spacing", ["logsnr", "time_uniform", "karras"])
def test_spacings_run_from_the_start_down_to_index_0_in_the_promised_variable(spacing):
    sched = table("cosine")
    u = S.sample_times(sched, spacing, 12)
    assert len(u) == 12 and u[-1] == 0.0 and u[0] == S.start_index(sched, -5.1) and (np.diff(u) < 0).all()
    lam = sched.lam(u)
    measure = {"logsnr": lam, "time_uniform": u, "karras": np.exp(-lam / 7)}[spacing]
    np.testing.assert_allclose(np.diff(measure), np.diff(measure)[0], rtol=1e-6)


@pytest.mark.parametrize("spacing", ["logsnr", "time_uniform", "karras"])
def test_a_start_at_or_above_the_least_noisy_step_is_refused_not_sampled_into_zeros(spacing):
    """lambda_min 10 on a table whose largest lambda is about 5: every point at index 0, a NaN step
    and images of zeros, exit 0 (found from outside). Just below it, the points still decrease."""
    sched = table("cosine")
    top = float(sched.lam(0.0))
    for bad in (10.0, top):
        with pytest.raises(ValueError, match=r"lambda_min .* is not below the table's largest half log-SNR"):
            S.sample_times(sched, spacing, 12, lambda_min=bad)
    u = S.sample_times(sched, spacing, 12, lambda_min=top - 0.5)
    assert u[0] > 0 and (np.diff(u) < 0).all()


def test_respacing_spacing_keeps_the_respacers_steps():
    u = S.sample_times(table("cosine"), "respacing", 0, respacing="ddim50")
    assert list(u) == list(range(980, -1, -20))


def test_the_unet_embeds_fractional_times_continuously_and_integers_as_before():
    torch.manual_seed(0)
    net = randomised_unet(learn_sigma=False)
    x, y = torch.randn(2, 1, 8, 8), torch.tensor([1, 2])
    with torch.no_grad():
        ints = net(x, torch.tensor([500, 500]), y)
        same = net(x, torch.tensor([500.0, 500.0]), y)
        near = net(x, torch.tensor([500.25, 500.25]), y)
    assert torch.equal(ints, same)
    assert 0 < (near - ints).abs().max() < 0.05 * ints.abs().max()


# --- exact reductions to DDIM and DDPM ----------------------------------------------------------------


def randomised_unet(learn_sigma: bool):
    """The tiny UNet with its zero-initialised layers randomised (a fresh model outputs 0)."""
    net = build_unet(ModelParams(), image_size=8, in_channels=1, num_classes=10, learn_sigma=learn_sigma)
    with torch.no_grad():
        for p in net.parameters():
            if not p.any():
                p.copy_(torch.randn_like(p) * 0.05)
    return net.eval()


class Float64Diffusion(GaussianDiffusion):
    """Our DDIM/DDPM steps unchanged, with the float64 tables gathered as float64 (not float32), so
    that a comparison at 1e-6 tests the algebra rather than float32 rounding of 1 - abar near t=0."""

    def _gather(self, table, t, ndim):
        return table[t.cpu()].to(t.device).view(-1, *([1] * (ndim - 1)))


@pytest.mark.parametrize("schedule,respacing", [("cosine", "ddim10"), ("cosine", "25"), ("linear", "ddim10")])
def test_ddim_is_dpm_solver_pp_of_order_1_and_ddpm_its_sde_variant(schedule, respacing):
    torch.manual_seed(0)
    net, y = randomised_unet(learn_sigma=False), torch.arange(4)
    model_fn = lambda x, t: net(x.float(), t, y).double()  # noqa: E731  (float64 steps around the float32 net)
    spaced = from_params(DiffusionParams(schedule=schedule), respacing)
    diffusion = Float64Diffusion(spaced.betas.numpy(), timestep_map=spaced.timestep_map.tolist())
    sched = table(schedule)
    times = S.sample_times(sched, "respacing", 0, respacing=respacing)
    x_T = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def gens():
        return [torch.Generator().manual_seed(k) for k in range(4)]

    ddim = diffusion.ddim_sample(model_fn, None, x_T=x_T)  # eta 0, clip_denoised: static thresholding
    ours = S.sample(model_fn, sched, None, times, "dpmpp_2m", order=1, x_T=x_T)
    assert (ddim - ours).abs().max() < 1e-6
    ddpm = diffusion.ddpm_sample(model_fn, None, x_T=x_T, generators=gens())
    sde = S.sample(model_fn, sched, None, times, "dpmpp_2m_sde", order=1, x_T=x_T, generators=gens())
    assert (ddpm - sde).abs().max() < 1e-6
    assert (ddim - ddpm).abs().max() > 0.1  # the two really differ: the test can fail


# --- convergence order on a Gaussian mixture ---------------------------------------------------------


class Mixture:
    """sum_k w_k N(mu_k, s_k^2 I): at (alpha, sigma) the marginal is sum_k w_k N(alpha mu_k,
    (alpha^2 s_k^2 + sigma^2) I), so eps* = -sigma grad log p is exact."""

    def __init__(self, mus, s, w):
        self.mus, self.s, self.w = (torch.as_tensor(v, dtype=torch.float64) for v in (mus, s, w))

    def eps(self, x, alpha: float, sigma: float):
        var = alpha ** 2 * self.s ** 2 + sigma ** 2  # (K,)
        diff = x[:, None, :] - alpha * self.mus[None]  # (B, K, d)
        logp = torch.log(self.w) - 0.5 * (diff ** 2).sum(-1) / var - 0.5 * x.shape[1] * torch.log(var)
        r = torch.softmax(logp, dim=1)
        return sigma * (r[..., None] * diff / var[None, :, None]).sum(1)


def guided_mixture_eps(sched: S.LambdaSchedule, w: float):
    """CFG on the toy: 'conditional' = one component, 'unconditional' = the mixture."""
    g = torch.Generator().manual_seed(0)
    mus = torch.randn(4, 2, generator=g, dtype=torch.float64) * 0.8
    uncond, cond = Mixture(mus, [0.15, 0.1, 0.2, 0.12], [0.25] * 4), Mixture(mus[:1], [0.15], [1.0])

    def model_fn(x, t):
        alpha, sigma, _ = sched.alpha_sigma_lambda(float(t[0]))
        e = cond.eps(x, float(alpha), float(sigma))
        return e if w == 0 else (1 + w) * e - w * uncond.eps(x, float(alpha), float(sigma))

    return model_fn


def ode_reference(model_fn, sched, x_T, u_start):
    """x at index 0 by DOP853 (rtol = atol = 1e-11) on dx/dlambda = sigma^2 x - sigma eps(x, lambda)."""
    from scipy.integrate import solve_ivp

    def rhs(lam, flat):
        u = float(sched.index(lam))
        _, sigma, _ = sched.alpha_sigma_lambda(u)
        x = torch.as_tensor(flat.reshape(x_T.shape))
        return sigma ** 2 * flat - sigma * model_fn(x, torch.full((len(x),), u, dtype=torch.float64)).numpy().reshape(-1)

    sol = solve_ivp(rhs, (float(sched.lam(u_start)), float(sched.lam(0.0))), x_T.numpy().reshape(-1),
                    method="DOP853", rtol=1e-11, atol=1e-11)
    return torch.as_tensor(sol.y[:, -1].reshape(x_T.shape))


@pytest.fixture(scope="module", params=[("cosine", 0.0), ("linear", 3.0)], ids=["cosine-w0", "linear-w3"])
def toy(request):
    schedule, w = request.param
    sched = table(schedule)
    model_fn = guided_mixture_eps(sched, w)
    x_T = torch.randn(300, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    exact = S.denoiser(model_fn, sched, "eps", "none")(ode_reference(model_fn, sched, x_T, S.start_index(sched, -5.1)),
                                                        0.0)
    return sched, model_fn, x_T, exact.clamp(-1, 1), w  # clamped as the samplers' output is


def final_error(toy, sampler, nfe, spacing="logsnr", order=None):
    sched, model_fn, x_T, exact, _ = toy
    times = S.sample_times(sched, spacing, S.evaluation_points(sampler, nfe))
    x = S.sample(model_fn, sched, None, times, sampler, thresholding="none", x_T=x_T, order=order)
    return float(((x - exact) ** 2).mean().sqrt())


def slope(toy, sampler, nfes, **kw):
    e = [final_error(toy, sampler, n, **kw) for n in nfes]
    return -math.log(e[-1] / e[0]) / math.log(nfes[-1] / nfes[0])


# (sampler, spacing, order, NFE range, accepted slopes): the bars; "ddim" is DPM-Solver++
# of order 1, which the test above shows is our DDIM step for step.
ORDERS = [
    ("ddim", "dpmpp_2m", "logsnr", 1, (320, 1280), (0.9, 1.1)),
    ("dpmpp_2m", "dpmpp_2m", "logsnr", 2, (80, 320), (1.85, 2.15)),
    ("unipc", "unipc", "logsnr", None, (40, 160), (2.6, 4.5)),
    ("heun", "heun", "karras", None, (21, 81), (1.8, 3.0)),
]


@pytest.mark.parametrize("name,sampler,spacing,order,nfes,bounds", ORDERS, ids=[o[0] for o in ORDERS])
def test_convergence_order_on_a_gaussian_mixture(toy, name, sampler, spacing, order, nfes, bounds):
    s = slope(toy, sampler, nfes, spacing=spacing, order=order)
    assert bounds[0] <= s <= bounds[1], f"{name}: slope {s:.3f}"


def test_two_m_and_unipc_reach_ddim_50_accuracy_with_at_most_half_the_calls(toy):
    # with guidance the ODE is stiffer: 2M needs 25 calls at w = 3 (the notes measured 30 on theirs)
    ddim50, w = final_error(toy, "dpmpp_2m", 50, order=1), toy[-1]
    assert final_error(toy, "dpmpp_2m", 20 if w == 0 else 25) < ddim50
    assert final_error(toy, "unipc", 20) < ddim50


@pytest.mark.parametrize("sampler", S.SAMPLERS)
def test_every_solver_stays_finite_at_5_calls_with_guidance_8(sampler):
    sched = table("cosine")
    model_fn = guided_mixture_eps(sched, 8.0)
    x_T = torch.randn(300, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gens = [torch.Generator().manual_seed(k) for k in range(300)]
    times = S.sample_times(sched, "logsnr", S.evaluation_points(sampler, 5))
    assert S.network_calls(sampler, len(times)) == 5
    x = S.sample(model_fn, sched, None, times, sampler, thresholding="none", x_T=x_T, generators=gens, churn=1.0
                 if sampler == "heun" else 0.0)
    assert torch.isfinite(x).all() and x.abs().max() > 0.1


# --- diffusers parity ---------------------------------------------------------------------------------


def run_diffusers(scheduler, model_fn, x_T, noises=None):
    x = x_T
    for i, t in enumerate(scheduler.timesteps):
        out = model_fn(x, torch.full((len(x),), float(t)))
        kw = {"variance_noise": noises[i]} if noises is not None else {}
        x = scheduler.step(out, t, x, **kw).prev_sample
    return x


@pytest.mark.parametrize("kind", ["dpmsolver++", "sde-dpmsolver++", "unipc"])
@pytest.mark.parametrize("steps", [5, 12])
def test_parity_with_diffusers_multistep_schedulers(kind, steps):
    """diffusers where it is right: eps model, linear table (no cosine tail, where its float32 sigmas
    lose ~1e-4), its default integer timesteps, final sigma 0, lower_order_final."""
    from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler

    betas = get_beta_schedule("linear", 1000)
    sched = S.LambdaSchedule.from_betas(betas)
    mix = Mixture([[0.5, -0.3], [-0.6, 0.2]], [0.2, 0.3], [0.4, 0.6])

    def model_fn(x, t):
        alpha, sigma, _ = sched.alpha_sigma_lambda(float(t[0]))
        return mix.eps(x.double(), float(alpha), float(sigma)).to(x.dtype)

    common = dict(num_train_timesteps=1000, trained_betas=betas.tolist(), solver_order=2, prediction_type="epsilon",
                  lower_order_final=True, final_sigmas_type="zero")
    if kind == "unipc":
        theirs = UniPCMultistepScheduler(predict_x0=True, solver_type="bh2", **common)
    else:
        theirs = DPMSolverMultistepScheduler(algorithm_type=kind, solver_type="midpoint", **common)
    theirs.set_timesteps(steps)
    times = theirs.timesteps.numpy().astype(np.float64)
    x_T = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))
    gens = [torch.Generator().manual_seed(100 + k) for k in range(16)]
    sde = kind == "sde-dpmsolver++"
    # our per-image noise, drawn in our order, handed to diffusers as its variance_noise
    noises = [GaussianDiffusion._randn(x_T, gens) for _ in times] if sde else None
    expected = run_diffusers(theirs, model_fn, x_T, noises)
    sampler = {"dpmsolver++": "dpmpp_2m", "sde-dpmsolver++": "dpmpp_2m_sde", "unipc": "unipc"}[kind]
    gens = [torch.Generator().manual_seed(100 + k) for k in range(16)]
    ours = S.sample(model_fn, sched, None, times, sampler, thresholding="none", x_T=x_T, generators=gens)
    assert (ours - expected.clamp(-1, 1)).abs().max() <= 1e-4
    assert (x_T.clamp(-1, 1) - ours).abs().max() > 0.1


# --- models and randomness -------------------------------------------------------------------------------


def test_learned_variance_channels_are_ignored_and_x0_models_plug_in():
    torch.manual_seed(0)
    net2c, y = randomised_unet(learn_sigma=True), torch.arange(3)
    sched = table("cosine")
    times = S.sample_times(sched, "logsnr", 6)
    x_T = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = S.sample(lambda x, t: net2c(x, t, y), sched, None, times, "unipc", x_T=x_T)
        b = S.sample(lambda x, t: net2c(x, t, y)[:, :1], sched, None, times, "unipc", x_T=x_T)
        assert torch.equal(a, b)
        # an x0-model that returns the eps-model's x0 gives the eps-model's samples
        D = S.denoiser(lambda x, t: net2c(x, t, y), sched, "eps", "none")
        x0_fn = lambda x, t: D(x, float(t[0]))  # noqa: E731
        c = S.sample(x0_fn, sched, None, times, "dpmpp_2m", prediction="x0", x_T=x_T)
        d = S.sample(lambda x, t: net2c(x, t, y), sched, None, times, "dpmpp_2m", x_T=x_T)
    assert (c - d).abs().max() < 1e-5


def test_dynamic_thresholding_scales_only_images_beyond_the_range():
    x0 = torch.stack([torch.linspace(-0.5, 0.5, 1000), torch.linspace(-3, 3, 1000)]).view(2, 1, 10, 100)
    out = S.threshold(x0, "dynamic")
    assert torch.equal(out[0], x0[0])  # quantile below 1: unchanged
    s = torch.quantile(x0[1].abs().flatten(), 0.995)
    assert torch.allclose(out[1], x0[1].clamp(-s, s) / s) and out[1].abs().max() == 1.0
    assert torch.equal(S.threshold(x0, "static"), x0.clamp(-1, 1))


@pytest.mark.parametrize("sampler", ["dpmpp_2m_sde", "heun"])
def test_stochastic_solvers_draw_their_noise_per_image(sampler):
    sched = table("cosine")
    model_fn = guided_mixture_eps(sched, 0.0)
    times = S.sample_times(sched, "karras", S.evaluation_points(sampler, 9))

    def run(ks):
        gens = [torch.Generator().manual_seed(k) for k in ks]
        return S.sample(lambda x, t: model_fn(x.double(), t).float(), sched, (len(ks), 2), times, sampler,
                        generators=gens, churn=5.0)

    whole = run(range(6))
    assert torch.allclose(torch.cat([run(range(2)), run(range(2, 6))]), whole, atol=1e-6)
    assert not torch.allclose(run([0, 1]), run([1, 0]))
