"""IDDPM's loss-second-moment sampler against its definition, and its unbiasedness."""
import subprocess

import numpy as np
import pytest
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


def level_rows(m_t, sampler, *, mean_share=0.3):
    """The rows NoiseLevelGradients.finish would give for buckets whose per-example gradients
    g = w_t ∇L_t have E‖∇L_t‖² = m_t, under the sampler's current weights: E‖g‖² over a bucket's
    examples (t drawn with p_t / P_b) is sum_{t in b} m_t / (P_b T² p_t), split into |E g|² and tr Σ."""
    p = sampler.weights() / sampler.weights().sum()
    T = sampler.num_timesteps
    rows = []
    for b in range(sampler.count):
        inside = sampler.bucket_of_t == b
        second = float(np.sum(np.asarray(m_t)[inside] / (T ** 2 * p[inside])) / p[inside].sum())
        rows.append({"bucket": b, "g2": mean_share * second, "trace": (1 - mean_share) * second})
    return rows


def warm(sampler, losses_per_t):
    """Fills the loss history with constant losses per t (E[L_t²] = L_t²)."""
    for _ in range(sampler.history):
        sampler.update(torch.arange(sampler.num_timesteps), torch.as_tensor(losses_per_t, dtype=torch.float64))


def test_grad_norm_sampler_is_uniform_until_history_and_every_bucket_are_there_and_skips_bad_estimates():
    s = GradNormSampler(np.repeat(np.arange(4), 5), halflife=1e9)
    loss = np.linspace(1.0, 2.0, 20)
    ratio = np.array([4.0, 1.0, 9.0, 16.0])
    m = ratio[s.bucket_of_t] * loss ** 2
    s.update_levels(level_rows(np.ones(20), s))  # no loss history yet: nothing learnt
    assert s.totals.sum() == 0 and np.all(s.weights() == 1)
    warm(s, loss)
    assert not s.warmed_up() and np.all(s.weights() == 1)
    rows = level_rows(m, s)
    s.update_levels(rows[:3] + [{**rows[3], "g2": -2.0, "trace": 1.0}])  # bucket 3: a negative estimate, noise
    assert not s.warmed_up() and np.all(s.weights() == 1)
    s.update_levels(rows[3:])
    assert s.warmed_up()
    assert s.ratios() == pytest.approx(ratio, rel=1e-12)
    # p_t ∝ sqrt(r_b E[L_t²]) = sqrt(r_b) L_t, mixed with 0.1% uniform
    want = np.sqrt(m) / np.sqrt(m).sum() * (1 - 0.001) + 0.001 / 20
    assert s.weights() == pytest.approx(want, rel=1e-12)


def test_grad_norm_sampler_recovers_the_ratios_under_its_own_weights():
    """The buckets measure gradients of the weighted loss, drawn with the sampler's own p, which
    varies inside a bucket; the sampler divides that out, so its estimates do not drift with it."""
    s = GradNormSampler(np.array([0, 0, 1, 1, 1, 2, 2, 2, 2, 2]), halflife=2.0)
    loss = np.array([3.0, 1.0, 0.5, 2.0, 1.0, 0.2, 0.4, 0.1, 0.3, 0.6])
    warm(s, loss)
    ratio = np.array([5.0, 1.0, 20.0])
    m = ratio[s.bucket_of_t] * loss ** 2
    for _ in range(30):
        s.update_levels(level_rows(m, s))  # rows measured with the weights of that moment
        assert s.ratios() == pytest.approx(ratio, rel=1e-9)
        assert s.second_moments() == pytest.approx(m, rel=1e-9)


def test_grad_norm_sampler_minimises_the_estimators_second_moment_and_stays_unbiased():
    """With E‖∇L_t‖² = r_b E[L_t²] known: the estimate w_t ∇L_t has second moment
    sum_t E‖∇L_t‖² / (T² p_t), least at p_t ∝ sqrt(E‖∇L_t‖²), where it is (mean_t sqrt(E‖∇L_t‖²))²;
    IDDPM's p_t ∝ sqrt(E[L_t²]) does worse when the ratio differs between buckets."""
    rng = np.random.default_rng(0)
    s = GradNormSampler(np.arange(16) // 4, halflife=1e9, uniform_prob=0.0)
    loss = rng.uniform(0.1, 3, 16)
    warm(s, loss)
    m = np.array([1.0, 30.0, 5.0, 0.2])[s.bucket_of_t] * loss ** 2
    s.update_levels(level_rows(m, s))
    p = s.weights() / s.weights().sum()
    second = float(np.sum(m / (16 ** 2 * p)))
    assert second == pytest.approx(np.mean(np.sqrt(m)) ** 2, rel=1e-12)
    assert second < float(np.mean(m))  # uniform's, by Cauchy-Schwarz (m not all equal)
    iddpm = LossSecondMomentSampler(16, uniform_prob=0.0)
    warm(iddpm, loss)
    assert second < 0.9 * float(np.sum(m / (16 ** 2 * iddpm.weights())))
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
    warm(s, np.linspace(0.5, 2.0, T))
    s.update_levels(level_rows(grads.square().sum(1).numpy(), s))
    p = torch.from_numpy(s.weights() / s.weights().sum())
    _, w = s.sample_from_uniform(torch.cumsum(p, 0) - p / 2)  # u inside each t's interval: t = 0..T-1 in order
    assert not torch.allclose(p, torch.full_like(p, 1 / T))  # a non-uniform distribution
    # the weights are float32 (as training uses them): equal to their rounding
    assert torch.allclose((p[:, None] * w.double()[:, None] * grads).sum(0), grads.mean(0), rtol=1e-6,
                          atol=1e-6 * float(grads.abs().max()))


def test_grad_norm_sampler_state_round_trips_and_needs_its_buckets():
    s = GradNormSampler(np.repeat(np.arange(3), 4))
    warm(s, np.arange(1.0, 13.0))
    s.update_levels(level_rows(np.arange(1.0, 13.0) ** 2 * np.repeat([1.0, 2.0, 3.0], 4), s))
    t = GradNormSampler(np.repeat(np.arange(3), 4))
    t.load_state_dict(s.state_dict())
    assert np.array_equal(t.weights(), s.weights()) and t.warmed_up()
    assert not np.array_equal(s.weights(), LossSecondMomentSampler(12).weights())
    with pytest.raises(ValueError, match="3 buckets, expected 4"):
        GradNormSampler(np.repeat(np.arange(4), 3)).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="noise-level buckets"):
        create_sampler("grad-norm", 12)
    assert create_sampler("grad-norm", 12, np.arange(12) // 4).learns_from == "losses"
    assert math.isnan(GradNormSampler(np.arange(2)).second_moments()[0])


def test_a_grad_norm_run_that_never_left_uniform_says_so_and_why():
    s = GradNormSampler(np.repeat(np.arange(2), 3))
    assert "drew uniformly all 40 steps: its loss history (10 losses at every t) never filled; train longer" \
        in s.end_note(40)
    warm(s, np.arange(1.0, 7.0))
    s.update_levels(level_rows(np.arange(1.0, 7.0), s)[:1])  # the second bucket never measured
    assert "no noise-level bucket measurement after its loss history filled gave every bucket a positive ratio; " \
        "measure the buckets later" in s.end_note(40)
    s.update_levels(level_rows(np.arange(1.0, 7.0), s))
    assert s.end_note(40) is None  # steered
    # IDDPM's says so too (found from outside: a short run trained as uniform, silently); the boundary
    # is tested below with real draws
    assert "'loss-second-moment' drew uniformly all 40 steps" in LossSecondMomentSampler(6).end_note(40)


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
    # 16 steps: the loss history of the 10 timesteps is full after about 8, then the buckets calibrate it
    over = dict(train={"nproc": 2, "batch_per_proc": 8, "timestep_sampler": "grad-norm", "steps": 16},
                introspect={"every": 2, "noise_levels_every": 1})
    straight = write_params(tmp_path / "p.yaml", **over)
    run_train(tmp_path / "straight", data, straight, 2)
    kill_after_checkpoint(tmp_path / "resumed", data, straight, 2, step=4)
    run_train(tmp_path / "resumed", data, straight, 2)
    a, b = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    assert_same(a, b, exact=True)
    assert bool((a["sampler"]["totals"] > 0).all())  # every bucket measured: out of its uniform phase
    assert len(a["sampler"]["sums"]) == 4 and float(a["sampler"]["sums"].std()) > 0  # 4 buckets, unequal



def test_grad_norm_needs_a_bucket_step_after_its_loss_history_fills():
    """10 losses for each of T = 1000 timesteps at 128 images a step, the defaults' seed: the
    history is full after microbatch 159 (the replay), so step 161's measurement is the first to
    see it (step 160's sees the updates before its own microbatch); accumulation halves the step,
    another seed or batch draws other t. Whether the replay is exact is tested by training
    (below)."""
    from ddpmrepro import params as P
    from ddpmrepro.training.timestep_sampler import check_steers

    def run(**over):
        params = P.from_dict({"train": {"timestep_sampler": "grad-norm", **over.pop("train", {})},
                              "introspect": {"every": 0, **over}})
        check_steers(params, processes=params.train.nproc)
    run(steps=[161])
    with pytest.raises(P.ParamsError, match=r"^train.timestep_sampler: 'grad-norm' would draw uniformly all run: its "
                       r"loss history \(10 losses for each of 1000 t; this run's draws replayed, 128 images a step\) "
                       "can steer from step 161, and no noise-level buckets"):
        run(steps=[1, 79, 160])
    with pytest.raises(P.ParamsError, match=r"256 images a step\) can steer from step 81"):
        run(steps=[80], train={"grad_accum": 2})
    run(steps=[81], train={"grad_accum": 2})
    with pytest.raises(P.ParamsError, match="can steer from step 189,"):  # another seed, other draws
        run(steps=[188], train={"seed": 1})
    with pytest.raises(P.ParamsError, match="is not full before the last step 100; train longer"):
        run(steps=[50], train={"steps": 100})
    with pytest.raises(P.ParamsError, match="before the last step 161"):  # nothing left to steer
        run(steps=[161], train={"steps": 161})
    # train checks on its own world size: two nodes of train.nproc 1 draw 256 t a step, full by step 98
    two_nodes = P.from_dict({"train": {"timestep_sampler": "grad-norm"}, "introspect": {"every": 0, "steps": [98]}})
    with pytest.raises(P.ParamsError, match="can steer from step 161"):
        check_steers(two_nodes, processes=1)
    check_steers(two_nodes, processes=2)


def test_the_replay_draws_the_timestep_uniforms_training_draws():
    """batches.timestep_uniforms (the replay's) against the draws a training microbatch makes with
    its images and noise (`example_draws`), for the examples of one global microbatch."""
    from ddpmrepro.training.batches import example_draws, step_seed, timestep_uniforms
    seeds = [step_seed(3, 7, j, 1) for j in range(12)]
    u, _ = example_draws(seeds, (3, 8, 8))
    assert torch.equal(timestep_uniforms(3, 7, 12), u[:, 2])


@pytest.mark.parametrize("accum", [1, 2])
def test_the_step_check_params_names_is_the_first_whose_measurement_steers_in_training(tmp_path, accum):
    """check-params (`check_steers`) replays the run's draws of t (`steering_step`) to name the first
    step D whose bucket measurement grad-norm can learn from. A real run with bucket steps D - 1 and
    D only: after D - 1's measurement no bucket has a ratio (the history was not full when it came),
    after D's they have; with accumulation the step counts two microbatches. (Checkpoints every
    step give the sampler's state after each.)"""
    from ddpmrepro import params as P
    from ddpmrepro.data import prepare
    from ddpmrepro.training.checkpoint import list_checkpoints, load_checkpoint, checkpoint_step
    from ddpmrepro.training.timestep_sampler import steering_step
    from test_train import run_train, write_params

    first = steering_step(seed=0, timesteps=10, global_batch=8, grad_accum=accum, steps=100)
    assert first == {1: 18, 2: 9}[accum]  # the replay's answer for these draws (pinned: a changed draw shows here)
    data = tmp_path / "data"
    prepare(P.DataParams(), data)
    params = write_params(tmp_path / "p.yaml",
                          train={"batch_per_proc": 8, "grad_accum": accum, "timestep_sampler": "grad-norm",
                                 "steps": first + 1, "checkpoint_every": 1, "keep_checkpoints": 4},
                          introspect={"every": 0, "steps": [first - 1, first], "noise_buckets": 2})
    run_train(tmp_path / "run", data, params, 1)
    (ckpt_dir,) = (tmp_path / "run" / "ckpt").glob("*/*")
    state = {checkpoint_step(c): load_checkpoint(c)["sampler"] for c in list_checkpoints(ckpt_dir)}
    assert sorted(state) == [first - 2, first - 1, first, first + 1]
    assert not (state[first - 1]["totals"] > 0).any(), "a measurement before the named step steered"
    assert (state[first]["totals"] > 0).any(), "the named step's measurement did not steer"
    if accum == 1:  # the history was full one microbatch before D - 1's measurement could see it
        assert not (state[first - 2]["loss_counts"] == 10).all()
        assert (state[first - 1]["loss_counts"] == 10).all()

# --- the sampler from the output layer's per-example gradients (output-grad-norm) -------------------

import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

from ddpmrepro.training.output_grads import OutputGradNorms, per_example_squared_norms  # noqa: E402
from ddpmrepro.training.timestep_sampler import DeferredUpdates, OutputGradNormSampler  # noqa: E402


def _exact_per_example_sq(module, loss_of_output, x, names):
    """‖∂L_i/∂θ‖² over the parameters `names` of `module`, each example alone (torch.func)."""
    params = {n: q.detach() for n, q in module.named_parameters()}

    def one(ps, xi):
        return loss_of_output(functional_call(module, ps, (xi[None],)))

    g = vmap(grad(one), in_dims=(None, 0))(params, x)
    return sum(g[n].double().square().flatten(1).sum(1) for n in names)


@pytest.mark.parametrize("kernel,padding,bias", [(3, 1, True), (1, 0, True), (3, 1, False), (5, 2, True)])
def test_per_example_conv_gradient_norms_equal_each_examples_own_gradient(kernel, padding, bias):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(5, 3, kernel, padding=padding, bias=bias)
    x = torch.randn(6, 5, 7, 9) * torch.linspace(0.3, 2.0, 6)[:, None, None, None]  # examples of other sizes
    target = torch.randn(6, 3, 7, 9)
    out = conv(x)
    # a loss whose per-example parts differ: the gradient at the output is each example's own
    ((out - target) ** 3).sum().backward()
    got = per_example_squared_norms(conv, x, (3 * (out - target) ** 2).detach())
    # each example alone, with its own target, by torch.func
    names = ["weight", "bias"] if bias else ["weight"]
    want = torch.cat([_exact_per_example_sq(conv, lambda o, i=i: ((o - target[i:i + 1]) ** 3).sum(), x[i:i + 1], names)
                      for i in range(len(x))])
    assert float(want.max()) > 2 * float(want.min())
    assert torch.allclose(got.double(), want, rtol=1e-4)
    # the batch gradient is the sum of the per-example ones (the same contraction, summed first)
    per_example_w = torch.stack([torch.func.grad(lambda w, i=i: ((F.conv2d(x[i:i + 1], w, conv.bias, padding=padding)
                                                                   - target[i:i + 1]) ** 3).sum())(conv.weight.detach())
                                 for i in range(len(x))])
    # (float32 sums in other orders: the tolerance is relative to the largest entry)
    assert torch.allclose(per_example_w.sum(0), conv.weight.grad, rtol=1e-4, atol=1e-5 * float(conv.weight.grad.abs().max()))


def _tiny_unet(T_classes=3):
    from ddpmrepro import params as P
    from ddpmrepro.model.unet import build_unet

    torch.manual_seed(0)
    model = build_unet(P.ModelParams(channels=8, channel_mult=[1], num_res_blocks=1, attention_resolutions=[],
                                     num_head_channels=8, dropout=0.0), image_size=8, in_channels=1,
                       num_classes=T_classes, learn_sigma=False)
    for q in model.parameters():  # zero-initialised layers too: every weight random
        q.data.normal_(0, 0.2)
    return model


def test_the_sampler_gets_each_examples_output_layer_gradient_norm_of_its_unweighted_loss():
    """Through the loop's seam (DeferredUpdates): after a backward of sum(w_i L_i) x c with a recorded
    step's extra pass before it, the values queued are ‖∂L_i/∂θ_out‖ of each example's unweighted loss,
    as torch.func computes them example by example, with every weight of the UNet random."""
    from ddpmrepro.model.diffusion import GaussianDiffusion, get_beta_schedule

    model = _tiny_unet()
    diffusion = GaussianDiffusion(get_beta_schedule("cosine", 20))
    B = 5
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.rand(B, 1, 8, 8, generator=g) * 2 - 1, torch.randn(B, 1, 8, 8, generator=g)
    y, t = torch.tensor([0, 1, 2, 1, 0]), torch.tensor([0, 3, 7, 12, 19])
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25])
    sampler = OutputGradNormSampler(20, history=2)
    updates = DeferredUpdates(sampler, model, grad_accum=2)
    losses = diffusion.training_losses(lambda x, tt: model(x, tt, y), x0, t, noise=noise)["loss"]
    (losses[:2].sum() * 7).backward(retain_graph=True)  # an introspection pass first: not the one read
    ((losses * weights).mean() / 2 * 64.0).backward()  # a loss scale of 64, 2 microbatches
    updates.add(t, losses, weights, loss_scale=64.0)
    updates.flush()
    got = torch.from_numpy(sampler.loss_history[t.numpy(), 0])

    names = [n for n, _ in model.named_parameters() if n.startswith("out.2.")]
    params = {n: q.detach() for n, q in model.named_parameters()}

    def loss_of(ps, x, yy, tt, nn):
        fn = lambda xt, ts: functional_call(model, ps, (xt, ts, yy[None]))  # noqa: E731
        return diffusion.training_losses(fn, x[None], tt[None], noise=nn[None])["loss"][0]

    grads = vmap(grad(loss_of), in_dims=(None, 0, 0, 0, 0))(params, x0, y, t, noise)
    want = sum(grads[n].double().square().flatten(1).sum(1) for n in names).sqrt()
    assert float(want.min()) > 0 and float(want.max()) > 2 * float(want.min())  # they differ per example
    assert torch.allclose(got, want, rtol=1e-4)
    assert sampler.loss_counts[t.numpy()].tolist() == [1] * B and sampler.loss_counts.sum() == B
    updates.output_grads.close()


def test_only_output_grad_norm_hooks_the_model_and_the_others_learn_what_they_did():
    model = _tiny_unet()
    for name, learns in (("uniform", None), ("loss-second-moment", "losses"), ("grad-norm", "losses"),
                         ("output-grad-norm", "output_grads")):
        s = create_sampler(name, 12, np.arange(12) // 4)
        u = DeferredUpdates(s, model)
        assert s.learns_from == learns and (u.output_grads is not None) == (learns == "output_grads")
        if u.output_grads is not None:
            u.output_grads.close()
    assert not model.out[-1]._forward_hooks  # closed: nothing left on the model
    lsm = create_sampler("loss-second-moment", 4)
    u = DeferredUpdates(lsm)
    u.add(torch.tensor([1, 2]), torch.tensor([0.5, float("inf")]), torch.ones(2), loss_scale=1.0)
    u.flush()
    assert lsm.loss_counts.tolist() == [0, 1, 0, 0]  # the loss as it was (not weighted), the inf left out
    with pytest.raises(RuntimeError, match="no backward pass"):
        OutputGradNorms(model).norms()


@pytest.mark.slow
def test_output_grad_norm_sampler_two_processes_equal_one_and_resume_bitwise(tmp_path):
    """train.timestep_sampler: output-grad-norm through the CLI: 2 processes with 8 examples each keep
    the history 1 process with 16 keeps (the norms gathered in the global batch's order, each of its
    example's own loss whatever the microbatch), and a 2-process run killed after its checkpoint at step
    4 resumes to the uninterrupted run's bits, the sampler's history included."""
    from ddpmrepro import params as P
    from ddpmrepro.data import prepare
    from test_train import assert_same, final_state, kill_after_checkpoint, run_train, write_params

    data = tmp_path / "data"
    prepare(P.DataParams(), data)
    sampler = {"timestep_sampler": "output-grad-norm"}
    one = write_params(tmp_path / "one.yaml", train={**sampler, "nproc": 1, "batch_per_proc": 16})
    two = write_params(tmp_path / "two.yaml", train={**sampler, "nproc": 2, "batch_per_proc": 8})
    run_train(tmp_path / "one", data, one, 1)
    run_train(tmp_path / "straight", data, two, 2)
    kill_after_checkpoint(tmp_path / "resumed", data, two, 2, step=4)
    run_train(tmp_path / "resumed", data, two, 2)
    a, b = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    assert_same(a, b, exact=True)
    # 8 steps x 16 examples over 10 timesteps: every t seen, the full history of 10 (a ring) reached
    counts, hist = a["sampler"]["loss_counts"], a["sampler"]["loss_history"]
    assert bool((counts > 0).all()) and int(counts.max()) == 10
    filled = torch.arange(10)[None, :] < counts[:, None]
    assert bool((hist[filled] > 0).all()) and bool((hist[~filled] == 0).all())
    c = final_state(tmp_path / "one")
    assert torch.equal(c["sampler"]["loss_counts"], counts)  # the same t drawn: the same history slots
    assert torch.allclose(c["sampler"]["loss_history"], hist, rtol=1e-3)


@pytest.mark.gpu
def test_output_grad_norms_reach_the_sampler_without_waiting_for_the_gpu():
    """On a card: after the backward pass, the per-example norms, their unweighting and the queued
    copy to the host (pinned, non-blocking) make no host sync; the history gets them at `flush`."""
    from ddpmrepro.model.diffusion import GaussianDiffusion, get_beta_schedule

    model = _tiny_unet().cuda()
    diffusion = GaussianDiffusion(get_beta_schedule("cosine", 20))
    sampler = OutputGradNormSampler(20, history=2)
    updates = DeferredUpdates(sampler, model)
    B = 6
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randint(0, 3, (B,), device="cuda", generator=g)
    t = torch.randint(0, 20, (B,), device="cuda", generator=g)
    weights = torch.rand(B, device="cuda", generator=g) + 0.5
    for attempt in range(2):  # the first one warms the kernels up
        x0 = torch.rand(B, 1, 8, 8, device="cuda", generator=g) * 2 - 1
        losses = diffusion.training_losses(lambda x, tt: model(x, tt, y), x0, t)["loss"]
        (losses * weights).mean().backward()
        if attempt:
            torch.cuda.set_sync_debug_mode("error")
        try:
            updates.add(t, losses, weights, loss_scale=1.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    updates.flush()
    seen = np.bincount(t.cpu().numpy(), minlength=20)
    assert sampler.loss_counts.tolist() == np.minimum(2 * seen, 2).tolist()  # both steps' norms, history 2
    assert bool((sampler.loss_history[seen > 0] > 0).all())


# --- IDDPM's warm-up: a run too short to leave it ---------------------------------------------------
def test_iddpms_samplers_that_never_leave_uniform_are_named_before_the_run_and_at_its_end(tmp_path):
    """loss-second-moment and output-grad-norm draw uniformly until their history is full: a run
    that ends before trains exactly as `uniform` does (found from outside: two 60-step runs with
    either sampler gave the same bits, and nothing said so). check-params replays the draws: one step
    short of the first draw after the warm-up, output-grad-norm is refused and loss-second-moment
    (the default, whose warm-up quick runs go through) gets a note; at that step, neither. The truth:
    real runs, whose weights equal uniform's bitwise up to that step and differ at it."""
    from ddpmrepro import params as P
    from ddpmrepro.data import prepare
    from ddpmrepro.params import ParamsError
    from ddpmrepro.training.checkpoint import checkpoint_step, list_checkpoints, load_checkpoint
    from ddpmrepro.training.timestep_sampler import check_history_fills, steering_step
    from test_train import train_cmd, env, write_params

    first = steering_step(seed=0, timesteps=10, global_batch=8, grad_accum=1, steps=100)
    assert first == 18  # the first step that draws after the warm-up (pinned in the test above)

    def settings(sampler, steps):
        return P.from_dict({"diffusion": {"timesteps": 10}, "sample": {"respacing": ""},
                            "train": {"batch_per_proc": 8, "steps": steps, "timestep_sampler": sampler}})
    note = check_history_fills(settings("loss-second-moment", first - 1), processes=1)
    assert note == ("note: train.timestep_sampler: 'loss-second-moment' would draw uniformly all run: its history "
                    f"(10 values for each of 10 t; this run's draws replayed, 8 images a step) is not full before the "
                    f"last step {first - 1} (IDDPM's warm-up); train longer or with a larger batch to sample by importance")
    with pytest.raises(ParamsError, match=r"^train.timestep_sampler: 'output-grad-norm' would draw uniformly all run: "
                                          r".* not full before the last step 17; train longer"):
        check_history_fills(settings("output-grad-norm", first - 1), processes=1)
    for sampler in ("loss-second-moment", "output-grad-norm"):
        assert check_history_fills(settings(sampler, first), processes=1) is None
    assert check_history_fills(settings("output-grad-norm", first - 1), processes=2) is None  # 16 images a step

    data = tmp_path / "data"
    prepare(P.DataParams(), data)
    models, errs = {}, {}
    for sampler in ("uniform", "loss-second-moment"):
        params = write_params(tmp_path / f"{sampler}.yaml", diffusion={"timesteps": 10},
                              train={"batch_per_proc": 8, "timestep_sampler": sampler, "steps": first,
                                     "checkpoint_every": 1, "keep_checkpoints": 2})
        run = tmp_path / sampler
        proc = subprocess.run(train_cmd(run, data, params, 1), env=env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (ckpt_dir,) = (run / "ckpt").glob("*/*")
        models[sampler] = {checkpoint_step(c): load_checkpoint(c)["model"] for c in list_checkpoints(ckpt_dir)}
        errs[sampler] = proc.stderr
    uniform, lsm = models["uniform"], models["loss-second-moment"]
    assert sorted(lsm) == [first - 1, first]
    assert all(torch.equal(uniform[first - 1][k], lsm[first - 1][k]) for k in lsm[first - 1]), "it left uniform early"
    assert not all(torch.equal(uniform[first][k], lsm[first][k]) for k in lsm[first]), "it did not leave uniform"
    assert "drew uniformly" not in errs["loss-second-moment"]  # its last step drew by importance
    # Rerun: it resumes the finished run and draws nothing, and must not say it drew uniformly (found
    # from outside: the flag was not checkpointed)
    params = tmp_path / "loss-second-moment.yaml"
    proc = subprocess.run(train_cmd(tmp_path / "loss-second-moment", data, params, 1), env=env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "drew uniformly" not in proc.stderr, proc.stderr[-3000:]


def test_the_end_note_names_a_run_that_drew_uniformly_all_along():
    """Its history full after the last update only (no draw after it) is still a uniform run."""
    from ddpmrepro.training.batches import timestep_uniforms
    from ddpmrepro.training.timestep_sampler import create_sampler

    for steps, drew in ((17, False), (18, True)):  # 18: steering_step's first step for these draws
        for name in ("loss-second-moment", "output-grad-norm"):
            sampler = create_sampler(name, 10)
            for m in range(steps):
                t, _ = sampler.sample_from_uniform(timestep_uniforms(0, m, 8))
                sampler.update(t, torch.ones(len(t)))
            assert sampler.warmed_up()  # full after step 17's update in both
            note = sampler.end_note(steps)
            assert (note is None) == drew, note
            resumed = create_sampler(name, 10)  # a finished run resumed: no draw left
            resumed.load_state_dict(sampler.state_dict())
            assert resumed.end_note(steps) == note
            if not drew:
                assert note == (f"note: train.timestep_sampler '{name}' drew uniformly all 17 steps: its history "
                                "(10 values at every t) was not full before its last draw; train longer or with a "
                                "larger batch")
