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
