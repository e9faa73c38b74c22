"""IDDPM's loss-second-moment sampler against its definition, and its unbiasedness."""
import numpy as np
import torch

from ddpmrepro.training.timestep_sampler import LossSecondMomentSampler, UniformSampler


def fill(sampler, losses_per_t):
    T, H = sampler.num_timesteps, sampler.history
    for _ in range(H):
        t = torch.arange(T)
        sampler.update(t, torch.as_tensor(losses_per_t, dtype=torch.float64))


def test_uniform_until_every_timestep_has_full_history():
    s = LossSecondMomentSampler(5, history=3)
    s.update(torch.tensor([0, 1, 2, 3]), torch.ones(4))
    assert np.allclose(s.weights(), 1.0)
    fill(s, [1.0] * 5)
    assert s.warmed_up()


def test_weights_are_sqrt_second_moment_mixed_with_uniform():
    T = 4
    s = LossSecondMomentSampler(T, history=10, uniform_prob=0.001)
    rng = np.random.default_rng(0)
    hist = rng.uniform(0.1, 2.0, size=(10, T))
    for row in hist:
        s.update(torch.arange(T), torch.as_tensor(row))
    expected = np.sqrt((hist**2).mean(axis=0))
    expected = expected / expected.sum() * 0.999 + 0.001 / T
    assert np.allclose(s.weights(), expected, rtol=0, atol=1e-12)
    assert np.isclose(s.weights().sum(), 1.0)


def test_history_keeps_the_last_ten_losses():
    s = LossSecondMomentSampler(1, history=3)
    for v in [1.0, 2.0, 3.0, 4.0, 5.0]:
        s.update(torch.tensor([0]), torch.tensor([v]))
    assert s.loss_history[0].tolist() == [3.0, 4.0, 5.0]


def test_importance_weighted_loss_is_unbiased():
    # E_p[w_t L_t] must equal the uniform mean of L_t; check exactly via the distribution, with the
    # weight the sampler itself gives each timestep it draws, and by Monte Carlo with its draws.
    T = 6
    s = LossSecondMomentSampler(T, history=2)
    L = torch.tensor([5.0, 1.0, 0.5, 0.2, 0.1, 0.05], dtype=torch.float64)
    fill(s, L.tolist())
    p = torch.from_numpy(s.weights())
    assert p.max() > 10 * p.min()  # far from uniform, where a weight of 1 would pass too
    t, w = s.sample(200_000, torch.Generator().manual_seed(0))
    assert all(torch.unique(w[t == k]).numel() == 1 for k in range(T))  # one weight per timestep
    w_of = torch.stack([w[t == k][0].double() for k in range(T)])
    assert torch.isclose((p * w_of * L).sum(), L.mean(), rtol=1e-6)  # holds only for w_t = 1 / (T p_t)
    est = (w.double() * L[t]).mean()
    assert abs(est - L.mean()) / L.mean() < 0.01
    # and it actually samples high-loss timesteps more often
    counts = torch.bincount(t, minlength=T)
    assert counts[0] > counts[-1] * 10


def test_state_dict_round_trip_and_uniform_has_weights_one():
    s = LossSecondMomentSampler(3, history=2)
    fill(s, [1.0, 2.0, 3.0])
    s2 = LossSecondMomentSampler(3, history=2)
    s2.load_state_dict(s.state_dict())
    assert np.array_equal(s.weights(), s2.weights())
    t, w = UniformSampler(7).sample(10, torch.Generator().manual_seed(0))
    assert torch.allclose(w, torch.ones(10)) and t.max() < 7


# --- the sampler from the gradients (train.timestep_sampler: grad-norm) ------------------------------

import math  # noqa: E402

import pytest  # noqa: E402

from ddpmrepro.training.timestep_sampler import GradNormSampler, create_sampler  # noqa: E402


def level_rows(second_moments, sampler, *, mean_sq=None):
    """The rows NoiseLevelGradients.finish would give for buckets whose per-example gradients g = w ∇L
    have E‖∇L‖² = second_moments under the sampler's current weights (split into |E g|² and tr Σ)."""
    p = sampler.weights() / sampler.weights().sum()
    rows = []
    for b, m in enumerate(second_moments):
        w = 1 / (sampler.num_timesteps * p[sampler.bucket_of_t == b][0])
        g2 = (mean_sq[b] if mean_sq is not None else 0.3 * m) * w ** 2
        rows.append({"bucket": b, "g2": g2, "trace": m * w ** 2 - g2})
    return rows


def test_grad_norm_sampler_is_uniform_until_every_bucket_is_measured_and_skips_bad_estimates():
    s = GradNormSampler(np.repeat(np.arange(4), 5), halflife=1e9)
    assert not s.warmed_up() and np.all(s.weights() == 1)
    rows = level_rows([1.0, 4.0, 9.0, 16.0], s)
    s.update_levels(rows[:3] + [{**rows[3], "g2": -2.0, "trace": 1.0}])  # bucket 3: a negative estimate, noise
    assert not s.warmed_up() and np.all(s.weights() == 1)
    s.update_levels(rows[3:])
    assert s.warmed_up()
    p = s.weights()
    # p_t ∝ sqrt(E‖∇L‖²) per bucket (1 : 2 : 3 : 4), mixed with 0.1% uniform
    want = np.repeat(np.array([1.0, 2.0, 3.0, 4.0]) / 50, 5) * (1 - 0.001) + 0.001 / 20
    assert p == pytest.approx(want, rel=1e-12)


def test_grad_norm_sampler_recovers_the_unweighted_second_moments_under_its_own_weights():
    """The buckets measure gradients of the weighted loss; the sampler divides its own weight out, so
    its estimates do not drift with the weights it draws with."""
    truth = np.array([5.0, 1.0, 0.2])
    s = GradNormSampler(np.array([0, 0, 1, 1, 1, 2, 2, 2, 2, 2]), halflife=2.0)
    for _ in range(30):
        s.update_levels(level_rows(truth, s))  # rows measured with the weights of that moment
        assert s.second_moments() == pytest.approx(truth, rel=1e-9)


def test_grad_norm_sampler_minimises_the_estimators_second_moment_and_stays_unbiased():
    """One bucket per t with known E‖∇L_t‖²: the estimate w_t ∇L_t has second moment
    sum_t E‖∇L_t‖² / (T² p_t), least at p_t ∝ sqrt(E‖∇L_t‖²), where it is (mean_t sqrt(E‖∇L_t‖²))²."""
    rng = np.random.default_rng(0)
    m = rng.uniform(0.01, 10, 16) ** 2
    s = GradNormSampler(np.arange(16), halflife=1e9, uniform_prob=0.0)
    s.update_levels(level_rows(m, s))
    p = s.weights() / s.weights().sum()
    second = float(np.sum(m / (16 ** 2 * p)))
    assert second == pytest.approx(np.mean(np.sqrt(m)) ** 2, rel=1e-12)
    assert second < float(np.mean(m))  # uniform's, by Cauchy-Schwarz (m not all equal)
    for q in rng.dirichlet(np.ones(16), 20):  # and no other distribution does better
        assert second <= float(np.sum(m / (16 ** 2 * q)))


def test_grad_norm_samplers_weighted_gradient_is_the_uniform_one_exactly_by_enumerating_t():
    """On a small UNet with every weight random: sum_t p_t w_t ∇L_t = mean_t ∇L_t, t enumerated."""
    from ddpmrepro import params as P
    from ddpmrepro.model.diffusion import GaussianDiffusion, get_beta_schedule
    from ddpmrepro.model.unet import build_unet

    T = 12
    torch.manual_seed(0)
    model = build_unet(P.ModelParams(channels=8, channel_mult=[1], num_res_blocks=1, attention_resolutions=[],
                                     num_head_channels=8), image_size=8, in_channels=1, num_classes=3,
                       learn_sigma=False)
    for q in model.parameters():  # zero-initialised layers too: every weight random
        q.data.normal_(0, 0.2)
    diffusion = GaussianDiffusion(get_beta_schedule("cosine", T))
    x0, noise, y = torch.rand(1, 1, 8, 8) * 2 - 1, torch.randn(1, 1, 8, 8), \
        torch.tensor([1])
    grads = []
    for t in range(T):
        model.zero_grad()
        diffusion.training_losses(lambda x, tt: model(x, tt, y), x0, torch.tensor([t]), noise=noise)["loss"].sum().backward()
        grads.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).double())
    grads = torch.stack(grads)  # (T, P)
    s = GradNormSampler(np.arange(T) // 3, halflife=1e9)
    s.update_levels(level_rows(grads.square().sum(1).view(4, 3).mean(1).numpy(), s))
    p = torch.from_numpy(s.weights() / s.weights().sum())
    _, w = s.sample_from_uniform(torch.cumsum(p, 0) - p / 2)  # u inside each t's interval: t = 0..T-1 in order
    assert not torch.allclose(p, torch.full_like(p, 1 / T))  # a non-uniform distribution
    # the weights are float32 (as training uses them): equal to their rounding
    assert torch.allclose((p[:, None] * w.double()[:, None] * grads).sum(0), grads.mean(0), rtol=1e-6,
                          atol=1e-6 * float(grads.abs().max()))


def test_grad_norm_sampler_state_round_trips_and_needs_its_buckets():
    s = GradNormSampler(np.repeat(np.arange(3), 4))
    s.update_levels(level_rows([1.0, 2.0, 3.0], s))
    t = GradNormSampler(np.repeat(np.arange(3), 4))
    t.load_state_dict(s.state_dict())
    assert np.array_equal(t.weights(), s.weights()) and t.warmed_up()
    with pytest.raises(ValueError, match="3 buckets, expected 4"):
        GradNormSampler(np.repeat(np.arange(4), 3)).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="noise-level buckets"):
        create_sampler("grad-norm", 12)
    assert not create_sampler("grad-norm", 12, np.arange(12) // 4).learns_from_losses
    assert math.isnan(GradNormSampler(np.arange(2)).second_moments()[0])


@pytest.mark.slow
def test_grad_norm_sampler_learns_from_the_buckets_in_training_and_resumes_bitwise_with_two_processes(tmp_path):
    """train.timestep_sampler: grad-norm through the CLI: it leaves its uniform phase after the first
    measured step, the 2 ranks stay in step (the bucket rows come after the all-reduce), and a run
    killed after its checkpoint at step 4 resumes to the uninterrupted run's bits, sampler state included."""
    from ddpmrepro import params as P
    from ddpmrepro.data import prepare
    from test_train import assert_same, final_state, kill_after_checkpoint, run_train, write_params

    data = tmp_path / "data"
    prepare(P.DataParams(), data)
    over = dict(train={"nproc": 2, "batch_per_proc": 8, "timestep_sampler": "grad-norm"},
                introspect={"every": 2, "noise_levels_every": 1})
    straight = write_params(tmp_path / "p.yaml", **over)
    run_train(tmp_path / "straight", data, straight, 2)
    kill_after_checkpoint(tmp_path / "resumed", data, straight, 2, step=4)
    run_train(tmp_path / "resumed", data, straight, 2)
    a, b = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    assert_same(a, b, exact=True)
    assert bool((a["sampler"]["totals"] > 0).all())  # every bucket measured: out of its uniform phase
    assert len(a["sampler"]["sums"]) == 4 and float(a["sampler"]["sums"].std()) > 0  # 4 buckets, unequal
