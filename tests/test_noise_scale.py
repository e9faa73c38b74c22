"""The gradient noise scale and the gradients by noise level, against brute force.

- The two-batch estimator is unbiased: over many draws its means approach |G|² and tr(Σ) of a known
  distribution, and the uncorrected |g_B|² (what a naive B_simple divides by) is visibly biased.
- What the instruments measure is exact: the hooks' microbatch norms, the all-reduced norm and
  every bucket's gradient equal per-example gradients computed one example at a time.
- On a tiny diffusion model, over many batches drawn from a finite set of examples (whose mean
  gradient and covariance are known exactly), both instruments' estimates agree with the truth in
  expectation, within 4 standard errors.
- Under 2 processes (real torchrun, gloo) the numbers equal those of 1 process with the whole batch.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpmrepro.model.diffusion import GaussianDiffusion, get_beta_schedule
from ddpmrepro.params import ModelParams, ParamsError
from ddpmrepro.model.unet import build_unet
from ddpmrepro.training.noise_buckets import bucket_table
from ddpmrepro.training.noise_levels import NoiseLevelGradients
from ddpmrepro.training.noise_scale import NoiseScale, SmoothedRatio, two_batch_estimates
from ddpmrepro.training.stats import RunningStats

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_two_batch_estimates_are_unbiased_and_the_naive_one_is_not():
    """Per-example 'gradients' ~ N(mu, diag(s²)): |G|² = |mu|², tr(Σ) = sum s². A batch of 64 as
    4 microbatches of 16 (the grad_accum path) and as two halves of 32 (the recorded-step path)."""
    g = torch.Generator().manual_seed(0)
    dim, reps = 20, 4000
    mu = torch.linspace(-0.3, 0.3, dim, dtype=torch.float64)
    s = torch.linspace(0.5, 2.0, dim, dtype=torch.float64)
    true_g2, true_tr = float(mu @ mu), float((s * s).sum())
    est_micro, est_halves, naive = [], [], []
    for _ in range(reps):
        x = mu + s * torch.randn(64, dim, generator=g, dtype=torch.float64)
        big = float(x.mean(0).square().sum())
        micro = [(float(m.mean(0).square().sum()), 16) for m in x.split(16)]
        halves = [(float(x[h::2].mean(0).square().sum()), 32) for h in range(2)]
        est_micro.append(two_batch_estimates(big, 64, [(sum(v for v, _ in micro) / 4, 16)]))
        est_halves.append(two_batch_estimates(big, 64, halves))
        naive.append(big)
    for est in (np.array(est_micro), np.array(est_halves)):
        mean, se = est.mean(0), est.std(0) / math.sqrt(reps)
        assert abs(mean[0] - true_g2) < 4 * se[0], (mean, true_g2, se)
        assert abs(mean[1] - true_tr) < 4 * se[1], (mean, true_tr, se)
    # The test has the power to see a wrong estimator: |g_B|² is off by tr(Σ)/B, many standard errors.
    naive = np.array(naive)
    assert abs(naive.mean() - true_g2) > 10 * naive.std() / math.sqrt(reps)
    # unequal halves (an odd batch) are unbiased too
    est = np.array([two_batch_estimates(float(x.mean(0).square().sum()), 63,
                                        [(float(x[:21].mean(0).square().sum()), 21),
                                         (float(x[21:].mean(0).square().sum()), 42)])
                    for x in (mu + s * torch.randn(63, dim, generator=g, dtype=torch.float64) for _ in range(reps))])
    assert abs(est[:, 1].mean() - true_tr) < 4 * est[:, 1].std() / math.sqrt(reps)
    assert math.isnan(two_batch_estimates(1.0, 8, [(2.0, 8)])[0])  # no smaller batch: nothing to say


def test_the_smoothed_ratio_divides_averages_not_ratios_and_resumes():
    r = SmoothedRatio(halflife_steps=10)
    assert math.isnan(r.value())
    r.update(1.0, 4.0, step=10)
    r.update(-0.2, 2.0, step=20)  # a negative |G|² estimate is averaged in, not dropped
    d = 0.5
    g2 = ((1 - d) * d * 1.0 + (1 - d) * -0.2) / (1 - d * d)
    tr = ((1 - d) * d * 4.0 + (1 - d) * 2.0) / (1 - d * d)
    assert r.averages() == pytest.approx((g2, tr))
    assert r.value() == pytest.approx(tr / g2)
    s = SmoothedRatio(10)
    s.load_state_dict(r.state_dict())
    assert s.update(2.0, 1.0, 25) == r.update(2.0, 1.0, 25)


def test_the_smoothed_ratios_half_life_is_in_steps_however_sparse_the_measurements():
    """Measured on recorded steps only (1 process, no accumulation: every 250 steps by default), the
    average must forget at the rate the half-life says, whatever the log windows between the
    measurements: each weight is 0.5^(age in steps / half-life), as a direct weighted mean computes."""
    halflife, steps = 500.0, [1, 250, 500, 750, 1000, 1250, 1500]
    rng = torch.Generator().manual_seed(0)
    g2 = [float(v) for v in torch.rand(len(steps), generator=rng, dtype=torch.float64)]
    trace = [float(v) for v in torch.rand(len(steps), generator=rng, dtype=torch.float64) * 10]
    r = SmoothedRatio(halflife)
    for s, a, b in zip(steps, g2, trace):
        r.update(a, b, step=s)
    # direct: an exponential average's weight for the measurement at s_k is (1 - d_k) prod_{j>k} d_j,
    # d_j = 0.5^((s_j - s_{j-1}) / halflife), and the first measurement's (weight 0 before) counts from step 0
    prev = [0] + steps[:-1]
    decays = [0.5 ** ((s - p) / halflife) for s, p in zip(steps, prev)]
    weights = [(1 - decays[k]) * math.prod(decays[k + 1:]) for k in range(len(steps))]
    assert weights[-2] / weights[-1] == pytest.approx((1 - decays[-2]) / (1 - decays[-1]) * decays[-1])
    want_g2 = sum(w * v for w, v in zip(weights, g2)) / sum(weights)
    want_tr = sum(w * v for w, v in zip(weights, trace)) / sum(weights)
    assert r.averages() == pytest.approx((want_g2, want_tr), rel=1e-12)
    # the first measurement's weight after 1499 steps, relative to the last's, as 0.5^(age/halflife) says
    # (each weight being the share of its own interval: (1 - d_k) over its span)
    assert weights[0] / weights[-1] == pytest.approx((1 - decays[0]) / (1 - decays[-1]) * 0.5 ** (1499 / halflife))


# --- a tiny diffusion model, per-example gradients one example at a time ---------------------

T = 20


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = build_unet(ModelParams(channels=8, channel_mult=[1], num_res_blocks=1, attention_resolutions=[],
                                   dropout=0.0), image_size=4, in_channels=1, num_classes=None, learn_sigma=False)
    with torch.no_grad():  # every weight random: the zero-initialised output conv would give zero gradients elsewhere
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


DIFFUSION = GaussianDiffusion(get_beta_schedule("cosine", T))


def example_set(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 1, 4, 4, generator=g) * 2 - 1, torch.randint(0, T, (n,), generator=g),
            torch.randn(n, 1, 4, 4, generator=g))


def per_example_losses(model, x0, t, noise):
    return DIFFUSION.training_losses(lambda x, tt: model(x, tt), x0, t, noise=noise)["loss"]


def flat_grad(model, loss):
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]).double()


def per_example_grads(model, x0, t, noise):
    return torch.stack([flat_grad(model, per_example_losses(model, x0[i:i + 1], t[i:i + 1], noise[i:i + 1]).sum())
                        for i in range(len(t))])


def bucket_params(**kw):
    base = dict(noise_buckets=4, noise_bucket_edges=[], noise_bucket_space="t")
    return SimpleNamespace(**{**base, **kw})


def test_bucket_gradients_sum_to_the_step_gradient_and_equal_brute_force():
    model = tiny_model()
    x0, t, noise = example_set(24)
    levels = NoiseLevelGradients(model, DIFFUSION.alphas_cumprod, bucket_params(), batch_per_step=24, device="cpu")
    weights = torch.linspace(0.5, 1.5, 24)
    weighted = per_example_losses(model, x0, t, noise) * weights
    levels.measure(weighted, t, grad_multiplier=1.0, loss_scale=1.0, batch=24)
    weighted.mean().backward()  # the training's own backward, after the extra passes (graph retained)
    step_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    parts = levels.total().double()
    assert torch.allclose(parts, step_grad, rtol=1e-5, atol=1e-7 * step_grad.abs().max())  # linearity
    rows, (g2, trace) = levels.finish()

    per_ex = per_example_grads(model, x0, t, noise) * weights.double()[:, None]
    bucket = torch.from_numpy(bucket_table(DIFFUSION.alphas_cumprod.numpy(), count=4, edges=[], space="t")[0])[t]
    half = torch.arange(24) % 2
    G = per_ex.mean(0)
    assert torch.allclose(G, step_grad, rtol=1e-4, atol=1e-6)
    Gb = torch.stack([per_ex[bucket == b].sum(0) / 24 for b in range(4)])
    for b, row in enumerate(rows):
        assert row["examples"] == int((bucket == b).sum())
        assert row["grad_norm"] == pytest.approx(float(Gb[b].norm()), rel=1e-5)
        assert row["share"] == pytest.approx(float(Gb[b] @ G / (G @ G)), rel=1e-4, abs=1e-6)
        for c in range(4):
            cos = float(Gb[b] @ Gb[c] / (Gb[b].norm() * Gb[c].norm()))
            assert row["cos"][c] == pytest.approx(cos, abs=1e-5)
        # the bucket's own two-batch estimates, from brute-force half means
        small = [(float(per_ex[(bucket == b) & (half == h)].mean(0).square().sum()), int(((bucket == b) & (half == h)).sum()))
                 for h in range(2)]
        want = two_batch_estimates(float(per_ex[bucket == b].mean(0).square().sum()), int((bucket == b).sum()),
                                   [s for s in small if s[1]])
        for got, exp in zip((row["g2"], row["trace"]), want):
            assert (math.isnan(got) and math.isnan(exp)) or got == pytest.approx(exp, rel=1e-4, abs=1e-6)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-5)
    halves = [(float(per_ex[half == h].mean(0).square().sum()), 12) for h in range(2)]
    assert (g2, trace) == pytest.approx(two_batch_estimates(float(G @ G), 24, halves), rel=1e-4)


def test_a_loss_of_one_bucket_gives_zero_gradient_in_the_others():
    model = tiny_model()
    x0, t, noise = example_set(24)
    levels = NoiseLevelGradients(model, DIFFUSION.alphas_cumprod, bucket_params(), batch_per_step=24, device="cpu")
    bucket = levels.bucket_of_t[t]
    weighted = per_example_losses(model, x0, t, noise) * (bucket == 2)
    levels.measure(weighted, t, grad_multiplier=1.0, loss_scale=1.0, batch=24)
    acc = levels._acc.view(4, 2, -1)
    assert all(bool((acc[b] == 0).all()) for b in (0, 1, 3)) and bool(acc[2].abs().sum() > 0)
    rows, _ = levels.finish()
    assert [r["share"] for r in rows] == pytest.approx([0.0, 0.0, 1.0, 0.0], abs=1e-6)


def test_the_microbatch_hooks_measure_each_microbatch_and_the_step_estimate_is_exact():
    """The grad_accum path as the loop drives it: loss scale S, 1/grad_accum, 3 microbatches of 8."""
    model = tiny_model()
    x0, t, noise = example_set(24)
    ns = NoiseScale(model, enabled=True, micro_batch=8, grad_accum=3, world=1, halflife_steps=100)
    stats = RunningStats({"gns_small_sq": 1, "gns_big_sq": 1}, torch.device("cpu"))
    S = 1024.0
    for m in range(3):
        sl = slice(8 * m, 8 * m + 8)
        (per_example_losses(model, x0[sl], t[sl], noise[sl]).mean() / 3 * S).backward()
        ns.after_backward(ns.microbatch_sums(), 3 / S)
    for p in model.parameters():
        p.grad /= S  # the scaler's unscale
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
    g2, trace = ns.after_step(stats, total, recorded=True)
    per_ex = per_example_grads(model, x0, t, noise)
    small = [float(per_ex[8 * m:8 * m + 8].mean(0).square().sum()) for m in range(3)]
    big = float(per_ex.mean(0).square().sum())
    assert float(total) ** 2 == pytest.approx(big, rel=1e-5)
    want = two_batch_estimates(big, 24, [(sum(small) / 3, 8)])
    assert (g2, trace) == pytest.approx(want, rel=1e-4)
    means = stats.means()
    assert means["gns_small_sq"] == pytest.approx(sum(small) / 3, rel=1e-5)
    logged = ns.log_values(means, step=1)
    assert (logged["gns_g2"], logged["gns_trace"]) == pytest.approx(want, rel=1e-4)
    with ns:  # as the loop holds it: the hooks are gone after the run, the model is not
        pass
    caught = len(ns._grads)
    per_example_losses(model, x0, t, noise).mean().backward()
    assert len(ns._grads) == caught and all(not p._backward_hooks for p in model.parameters())


@pytest.mark.slow
def test_both_instruments_agree_with_the_exact_noise_of_a_finite_population_in_expectation():
    """Batches of 16 drawn with replacement from 64 fixed examples: i.i.d. with the population's mean
    gradient G and covariance Σ, known exactly from the 64 per-example gradients."""
    model = tiny_model()
    x0, t, noise = example_set(64)
    per_ex = per_example_grads(model, x0, t, noise)
    G = per_ex.mean(0)
    true_g2, true_tr = float(G @ G), float((per_ex - G).square().sum(1).mean())
    g = torch.Generator().manual_seed(5)
    levels = NoiseLevelGradients(model, DIFFUSION.alphas_cumprod, bucket_params(noise_buckets=2), batch_per_step=16,
                                 device="cpu")
    ns = NoiseScale(model, enabled=True, micro_batch=8, grad_accum=2, world=1, halflife_steps=100)
    est_levels, est_micro = [], []
    for _ in range(300):
        idx = torch.randint(0, 64, (16,), generator=g)
        losses = per_example_losses(model, x0[idx], t[idx], noise[idx])
        with ns.paused():
            levels.measure(losses, t[idx], grad_multiplier=1.0, loss_scale=1.0, batch=16)
        est_levels.append(levels.finish()[1])
        model.zero_grad(set_to_none=True)
        for m in range(2):
            (losses[8 * m:8 * m + 8].mean() / 2).backward(retain_graph=m == 0)
            ns.after_backward(ns.microbatch_sums(), 2.0)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        est_micro.append(ns.after_step(RunningStats({"gns_small_sq": 1, "gns_big_sq": 1}, torch.device("cpu")),
                                       total, recorded=True))
    for est in (np.array(est_levels), np.array(est_micro)):
        mean, se = est.mean(0), est.std(0) / math.sqrt(len(est))
        assert abs(mean[0] - true_g2) < 4 * se[0], (mean, (true_g2, true_tr), se)
        assert abs(mean[1] - true_tr) < 4 * se[1], (mean, (true_g2, true_tr), se)
    ns.close()


def test_bucket_tables_in_t_and_log_snr_number_buckets_from_the_least_noisy():
    ac = DIFFUSION.alphas_cumprod.numpy()
    which, spans = bucket_table(ac, count=4, edges=[], space="t")
    assert which.tolist() == [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5 and spans[0] == (0.0, 5.0)
    which, spans = bucket_table(ac, count=2, edges=[], space="logsnr")
    logsnr = np.log(ac / (1 - ac))
    mid = (logsnr.min() + logsnr.max()) / 2
    assert which.tolist() == [0 if v >= mid else 1 for v in logsnr]
    assert spans[0][0] == pytest.approx(mid) and spans[1][1] == pytest.approx(mid)


@pytest.mark.parametrize("kw, fragment", [
    (dict(noise_buckets=64), "introspect.noise_buckets: bucket 0 "),
    (dict(noise_bucket_edges=[-3.0, 50.0], noise_bucket_space="logsnr"), "log-SNR edges must lie inside"),
    (dict(noise_bucket_edges=[0.2, 0.3], noise_bucket_space="logsnr"), "introspect.noise_bucket_edges: bucket"),
])
def test_buckets_that_cannot_hold_examples_are_refused_naming_the_key(kw, fragment):
    with pytest.raises(ParamsError, match=fragment.replace("(", r"\(")):
        NoiseLevelGradients(tiny_model(), DIFFUSION.alphas_cumprod, bucket_params(**kw), batch_per_step=16,
                            device="cpu")


WORKER = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import test_noise_scale as tn
from ddpmrepro.training.noise_scale import NoiseScale
from ddpmrepro.training.noise_levels import NoiseLevelGradients
from ddpmrepro.training.stats import RunningStats
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
model = tn.tiny_model()
ddp = torch.nn.parallel.DistributedDataParallel(model)
x0, t, noise = tn.example_set(32)
mine = slice(r, 32, w)  # rank r: positions r, r + W, ... of the batch, as training deals them (batches.py)
ns = NoiseScale(model, enabled=True, micro_batch=16, grad_accum=1, world=w, halflife_steps=100)
levels = NoiseLevelGradients(model, tn.DIFFUSION.alphas_cumprod, tn.bucket_params(), batch_per_step=32, device="cpu")
losses = tn.DIFFUSION.training_losses(lambda x, tt: ddp(x, tt), x0[mine], t[mine], noise=noise[mine])["loss"]
with ns.paused():
    levels.measure(losses, t[mine], grad_multiplier=1.0, loss_scale=1.0, batch=16)
losses.mean().backward()
ns.after_backward(ns.microbatch_sums(), 1.0)
total = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
step = ns.after_step(RunningStats({"gns_small_sq": 1, "gns_big_sq": 1}, torch.device("cpu")), total, recorded=True)
rows, halves = levels.finish()
if r == 0:
    json.dump({"step": step, "rows": rows, "halves": halves, "total": float(total)}, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def test_two_processes_measure_what_one_process_with_the_whole_batch_measures(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(script), str(out), str(Path(__file__).parent)], check=True, env=env, capture_output=True,
                   timeout=300)
    got = json.loads(out.read_text())
    model = tiny_model()
    x0, t, noise = example_set(32)
    per_ex = per_example_grads(model, x0, t, noise)
    # the DDP path: each rank's local gradient is a small batch of 16, the all-reduced one the big batch of 32
    small = [float(per_ex[r::2].mean(0).square().sum()) for r in range(2)]
    big = float(per_ex.mean(0).square().sum())
    assert got["total"] ** 2 == pytest.approx(big, rel=1e-5)
    assert got["step"] == pytest.approx(two_batch_estimates(big, 32, [(sum(small) / 2, 16)]), rel=1e-4)
    # the buckets: those of one process given the whole batch in its order (the halves by global position)
    levels = NoiseLevelGradients(model, DIFFUSION.alphas_cumprod, bucket_params(), batch_per_step=32, device="cpu")
    levels.measure(per_example_losses(model, x0, t, noise), t, grad_multiplier=1.0, loss_scale=1.0, batch=32)
    rows, halves = levels.finish()
    assert got["halves"] == pytest.approx(list(halves), rel=1e-4)
    for a, b in zip(got["rows"], rows):
        for key in ("examples", "grad_norm", "share", "g2", "trace"):
            assert (isinstance(b[key], float) and math.isnan(b[key]) and math.isnan(a[key])) or \
                a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
        assert a["cos"] == pytest.approx(b["cos"], abs=1e-5)


@pytest.mark.parametrize("introspect, fragment", [
    ({"noise_bucket_edges": [600.0, 300.0]}, "introspect.noise_bucket_edges: [600.0, 300.0] must be strictly ascending"),
    ({"noise_bucket_edges": [300.0, 1000.0]}, "introspect.noise_bucket_edges: 1000.0 is outside (0, 1000)"),
    ({"noise_bucket_edges": [10.0]}, "introspect.noise_bucket_edges: bucket 0 holds 10 of 1000 timesteps"),
    ({"noise_buckets": 64}, "introspect.noise_buckets: bucket 0 holds 16 of 1000 timesteps"),
])
def test_bad_bucket_edges_exit_2_with_one_line_before_anything_is_written(tmp_path, introspect, fragment):
    """Checked with the params (check-params, the first DVC stage), so no stage removes its outputs first."""
    import yaml
    from click.testing import CliRunner

    from ddpmrepro.cli import main

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"introspect": introspect, "train": {"batch_per_proc": 64}}))
    result = CliRunner().invoke(main, ["check-params", "--params", str(tmp_path / "params.yaml"),
                                       "--out", str(tmp_path / "resolved")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "resolved").exists()


@pytest.mark.parametrize("batch, T, space, want", [(128, 1000, "t", 4), (4, 1000, "t", 2), (8, 50, "t", 3),
                                                   (1, 1000, "t", 1), (16, 20, "logsnr", None)])
def test_the_default_bucket_count_fits_the_batch_and_params_never_refuse_it(batch, T, space, want):
    """noise_buckets: null (the default) is 4 buckets, or fewer where a small batch cannot fill 4: a run
    that never mentions the instrument is never refused for it (set explicitly, it is checked)."""
    from ddpmrepro import params as P
    from ddpmrepro.training.noise_buckets import default_bucket_count

    ac = GaussianDiffusion(get_beta_schedule("cosine", T)).alphas_cumprod.numpy()
    count = default_bucket_count(ac, space, batch)
    which, _ = bucket_table(ac, count=count, edges=[], space=space)
    assert min(np.bincount(which, minlength=count)) * batch / T >= 2 or count == 1
    if want is not None:
        assert count == want
    if count < 4:  # one more bucket would not fit
        which, _ = bucket_table(ac, count=count + 1, edges=[], space=space)
        assert min(np.bincount(which, minlength=count + 1)) * batch / T < 2
    P.from_dict({"train": {"batch_per_proc": batch}, "diffusion": {"timesteps": T}, "sample": {"respacing": ""},
                 "introspect": {"noise_bucket_space": space}})


def introspection_of(model, ip, *, last: int, batch: int, noise_scale_on: bool = True):
    """(the log's running stats, the noise scale, the Introspection) of one process and one microbatch a
    step, as the loop builds them."""
    from ddpmrepro.training.recording import Introspection

    stats = RunningStats({"gns_small_sq": 1, "gns_big_sq": 1, "gns_g2": 1, "gns_trace": 1}, torch.device("cpu"))
    ns = NoiseScale(model, enabled=noise_scale_on, micro_batch=batch, grad_accum=1, world=1, halflife_steps=100)
    intro = Introspection(model, ip, last_step=last, alphas_cumprod=DIFFUSION.alphas_cumprod, batch_per_step=batch,
                          noise_scale=ns, stats=stats, device=torch.device("cpu"))
    return stats, ns, intro


def instrumented_step(model, stats, ns, intro, done: int, x0, t, noise) -> bool:
    """One training step's instrument calls, in the loop's order (no optimizer step); whether it was recorded."""
    recording = intro.begin(done, 1.0)
    losses = per_example_losses(model, x0, t, noise)
    intro.measure(losses, t, grad_multiplier=1.0, loss_scale=1.0)
    losses.mean().backward()
    ns.after_backward(ns.microbatch_sums(), 1.0)
    intro.capture(done)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
    intro.end(done, ns.after_step(stats, total, recorded=intro.recording), total_norm=total, clip_threshold=1.0,
              skipped=False, loss_scale=1.0, lr=1e-3)
    return recording


def recorded_step(tmp_path, model, ip, *, noise_scale_on: bool, batch: int = 16, done: int = 1, last: int = 1):
    """One recorded step as the loop drives the instruments (1 process, no accumulation): the log's
    gns_* values and the steps table."""
    from ddpmrepro.training.introspect import read_table

    x0, t, noise = example_set(batch)
    stats, ns, intro = introspection_of(model, ip, last=last, batch=batch, noise_scale_on=noise_scale_on)
    intro.open_tables(tmp_path, 0)
    with intro, ns:
        instrumented_step(model, stats, ns, intro, done, x0, t, noise)
    intro.close()
    model.zero_grad(set_to_none=True)
    return ns.log_values(stats.means(), step=done), read_table(tmp_path, "steps"), \
        read_table(tmp_path, "noise_levels")


def test_noise_scale_off_means_no_gns_values_even_where_the_buckets_halves_could_give_them(tmp_path):
    """`introspect.noise_scale: false` with one batch per step: the buckets still measure (their own
    g2/trace columns), but neither the log nor the steps table gets gns_* from their halves."""
    from ddpmrepro.params import IntrospectParams

    model = tiny_model()
    ip = {"every": 1, "steps": [], "noise_buckets": 2, "modules": ["out"]}
    on, on_steps, on_levels = recorded_step(tmp_path / "on", model, IntrospectParams(**ip), noise_scale_on=True)
    assert set(on) == {"gns_g2", "gns_trace", "gns_b_simple"} and on_steps["gns_trace"].notna().all()
    off, off_steps, off_levels = recorded_step(tmp_path / "off", model, IntrospectParams(**ip, noise_scale=False),
                                               noise_scale_on=False)
    assert off == {}
    assert off_steps["gns_g2"].isna().all() and off_steps["gns_trace"].isna().all()
    assert len(off_levels) == 2 and off_levels["trace"].tolist() == on_levels["trace"].tolist()


def test_the_logged_b_simple_weighs_each_measurement_by_the_steps_since_the_previous_one(tmp_path):
    """One batch a step: measured on the buckets' steps (1, 5 and 8), logged every 4 steps.
    Truth: the documented rule applied to the steps table's own rows (avg <- d avg + (1 - d) x,
    d = 0.5^(steps since the previous measurement / half-life)). Found from outside: the averages
    were updated at the end of each log window, so step 1 weighed as 4 steps here (25 at the
    defaults) and the window holding steps 5 and 8 as one measurement."""
    from ddpmrepro.params import IntrospectParams
    from ddpmrepro.training.introspect import read_table

    model, batch = tiny_model(), 16
    ip = IntrospectParams(every=0, steps=[1, 5, 8], noise_buckets=2, modules=["out"])
    stats, ns, intro = introspection_of(model, ip, last=8, batch=batch)
    intro.open_tables(tmp_path, 0)
    logged = {}
    with intro, ns:
        for done in range(1, 9):
            instrumented_step(model, stats, ns, intro, done, *example_set(batch, seed=done))
            model.zero_grad(set_to_none=True)
            if done % 4 == 0:
                logged[done] = ns.log_values(stats.means(), step=done)
    intro.close()
    rows = read_table(tmp_path, "steps").dropna(subset=["gns_g2"])
    assert rows["step"].tolist() == [1, 5, 8]
    want, by_rule = {}, SmoothedRatio(100)
    for step, g2, trace in rows[["step", "gns_g2", "gns_trace"]].itertuples(index=False):
        by_rule.update(g2, trace, step=step)
        want[step] = by_rule.value()
    assert logged[4]["gns_b_simple"] == pytest.approx(want[1], rel=1e-12)
    assert logged[8]["gns_b_simple"] == pytest.approx(want[8], rel=1e-12)
    assert logged[8]["gns_g2"] == pytest.approx(rows["gns_g2"].iloc[1:].mean(), rel=1e-12)  # the window's mean
    at_log_steps = SmoothedRatio(100)  # what was logged before: the windows' means at the windows' ends
    at_log_steps.update(rows["gns_g2"].iloc[0], rows["gns_trace"].iloc[0], step=4)
    at_log_steps.update(rows["gns_g2"].iloc[1:].mean(), rows["gns_trace"].iloc[1:].mean(), step=8)
    assert at_log_steps.value() != pytest.approx(want[8], rel=1e-3)  # the data tell the two apart


def test_the_buckets_measure_on_their_own_cadence_and_nothing_on_the_other_recorded_steps(tmp_path, monkeypatch):
    """Every step recorded; the buckets' extra passes only on multiples of noise_levels_every, on
    `steps` and on the last step; their rows are those steps'."""
    from ddpmrepro.params import IntrospectParams
    from ddpmrepro.training.introspect import read_table

    model = tiny_model()
    x0, t, noise = example_set(16)
    ip = IntrospectParams(every=1, steps=[2], noise_buckets=2, noise_levels_every=3, modules=["out"])
    stats, ns, intro = introspection_of(model, ip, last=7, batch=16)
    passes = []
    measure = intro.levels.measure
    monkeypatch.setattr(intro.levels, "measure", lambda *a, **kw: (passes.append(done), measure(*a, **kw)))
    intro.open_tables(tmp_path, 0)
    with intro, ns:
        for done in range(1, 8):
            assert instrumented_step(model, stats, ns, intro, done, x0, t, noise)
            model.zero_grad(set_to_none=True)
    intro.close()
    assert passes == [2, 3, 6, 7]
    assert sorted(read_table(tmp_path, "steps")["step"]) == list(range(1, 8))
    assert sorted(read_table(tmp_path, "noise_levels")["step"].unique()) == [2, 3, 6, 7]
