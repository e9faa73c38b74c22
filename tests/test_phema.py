"""Post-hoc EMA (EDM2): the tracking against its closed form, the reconstruction against independent
computations (quadrature of the profiles, ema-pytorch's solve, a directly tracked third length),
and the snapshots the model directory refuses.

Convention: ddpmrepro follows EDM2, beta_n = (1 - 1/n)^(gamma + 1) at the n-th update (n = 1, 2, ...),
not ema-pytorch's (1 - 1/(n + 1))^(gamma + 1): after t updates the average is then exactly
sum_i w_i theta_i with w_i = (i^(g+1) - (i-1)^(g+1)) / t^(g+1), which the tests compute directly.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ddpmrepro import params as P
from ddpmrepro.model import phema
from ddpmrepro.model_dir import (MAX_FIT_ERROR, list_snapshots, reconstruct, snapshot_file, snapshot_metadata,
                                 snapshot_steps)
from ddpmrepro.files import save_weights
from ddpmrepro.training.phema import PowerEMA


def test_sigma_and_gamma_are_inverse_and_match_the_cubic():
    for sigma in (0.01, 0.05, 0.075, 0.1, 0.2, 0.28):
        g = phema.gamma_of(sigma)
        # EDM2's equation: gamma is the largest real root of g^3 + 7g^2 + (16 - s^-2)g + (12 - s^-2)
        root = np.roots([1, 7, 16 - sigma**-2, 12 - sigma**-2]).real.max()
        assert g == pytest.approx(root, rel=1e-12)
        assert phema.sigma_rel(g) == pytest.approx(sigma, rel=1e-14)
    assert phema.gamma_of(phema.MAX_SIGMA_REL) == pytest.approx(0.0, abs=1e-12)
    assert P._MAX_LENGTH <= phema.MAX_SIGMA_REL < P._MAX_LENGTH + 1e-3  # params' bound, written out
    with pytest.raises(ValueError):
        phema.gamma_of(0.3)


def test_profile_moments_by_numerical_integration():
    """The profile (g+1) tau^g / t^(g+1) integrates to 1 and has relative std sigma_rel(g)."""
    from scipy.integrate import quad

    for g in (0.5, 6.9, 17.0):
        p = lambda tau: (g + 1) * tau**g  # t = 1
        mean = quad(lambda x: x * p(x), 0, 1)[0]
        var = quad(lambda x: (x - mean) ** 2 * p(x), 0, 1)[0]
        assert quad(p, 0, 1)[0] == pytest.approx(1.0, rel=1e-10)
        assert math.sqrt(var) == pytest.approx(phema.sigma_rel(g), rel=1e-8)


class Walk(torch.nn.Module):
    """A 'model' whose weights the test sets to theta_1, theta_2, ... (a random walk), one per update."""

    def __init__(self, dim=64):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim))


def walk(steps: int, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, dim, generator=g, dtype=torch.float64).cumsum(0)  # (steps, dim)


def track(thetas: torch.Tensor, sigmas, *, count: int, directory=None, skip=()):
    """Runs a PowerEMA over the weights `thetas` (one step each), snapshots into `directory`."""
    model = Walk(thetas.shape[1])
    ema = PowerEMA(model, sigmas, count=count, steps=len(thetas))
    for step, theta in enumerate(thetas, start=1):
        if step not in skip:
            with torch.no_grad():
                model.w.copy_(theta.float())
            ema.update()
        if directory is not None:
            ema.snapshot(step, directory, run_hash="run")
    return ema


def test_tracking_is_edm2s_closed_form_and_skipped_steps_are_no_update():
    thetas = walk(300)
    ema = track(thetas, [0.05, 0.1], count=4, skip={7, 8, 200})
    kept = torch.stack([t for i, t in enumerate(thetas, start=1) if i not in {7, 8, 200}])  # the weights that existed
    n = len(kept)
    assert ema.num_updates == n
    for sigma in (0.05, 0.1):
        w = torch.tensor(phema.discrete_weights(phema.gamma_of(sigma), n), dtype=torch.float64)
        expected = w @ kept.float().double()
        assert torch.allclose(ema.averages[sigma]["w"].double(), expected, rtol=0, atol=2e-4), sigma
    # ...and not ema-pytorch's (1 - 1/(n+1))^(g+1): its first update keeps part of the initial zeros.
    g = phema.gamma_of(0.05)
    other = torch.zeros(thetas.shape[1], dtype=torch.float64)
    for i, theta in enumerate(kept, start=1):
        beta = (1 - 1 / (i + 1)) ** (g + 1)
        other = beta * other + (1 - beta) * theta
    assert (other - ema.averages[0.05]["w"].double()).abs().max() > 1e-3


def test_state_dict_round_trip_continues_bitwise():
    thetas = walk(60)
    straight = track(thetas, [0.05, 0.1], count=3)
    half = track(thetas[:30], [0.05, 0.1], count=3)
    resumed = PowerEMA(Walk(thetas.shape[1]), [0.05, 0.1], count=3, steps=60)
    resumed.load_state_dict(half.state_dict())
    for theta in thetas[30:]:
        with torch.no_grad():
            resumed.model.w.copy_(theta.float())
        resumed.update()
    for s in (0.05, 0.1):
        assert torch.equal(resumed.averages[s]["w"], straight.averages[s]["w"])
    with pytest.raises(ValueError, match="lengths"):
        PowerEMA(Walk(), [0.07], count=3, steps=60).load_state_dict(half.state_dict())


def test_snapshot_steps_are_even_and_end_at_the_last_step():
    assert snapshot_steps(2048, 32) == list(range(64, 2049, 64))
    assert snapshot_steps(1500, 32)[-1] == 1500 and len(snapshot_steps(1500, 32)) == 32
    assert snapshot_steps(5, 32) == [1, 2, 3, 4, 5]


def train_params(steps, count, sigmas=(0.05, 0.1)):
    return P.from_dict({"train": {"steps": steps, "posthoc_ema": list(sigmas), "posthoc_ema_snapshots": count,
                                  "warmup_steps": 0}}).train


def profile(c, snaps, t):
    """sum_i c_i w^(i): the discrete weights over updates 1..t that a combination of snapshots gives."""
    out = np.zeros(t)
    for ci, (ti, si) in zip(c, snaps):
        out[:ti] += ci * np.array(phema.discrete_weights(phema.gamma_of(si), ti))
    return out


def test_a_tracked_length_reconstructs_to_its_own_snapshot(tmp_path):
    """At the last step the snapshot of a tracked length is one of the combination's terms: the
    solve gives it coefficient 1 (to ~cond(A) x 1e-16), so the weights agree to fp32 rounding: 1e-5
    relative to the weights' size."""
    thetas = walk(512)
    track(thetas, [0.05, 0.1], count=16, directory=tmp_path)
    for sigma in (0.05, 0.1):
        got = reconstruct(tmp_path, sigma, train_params(512, 16), run_hash="run")["w"]
        tracked = [s for s in list_snapshots(tmp_path) if s.step == 512 and s.sigma_rel == sigma][0]
        from ddpmrepro.files import load_weights

        want = load_weights(tracked.path)["w"]
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_length_between_equals_its_direct_tracking_within_the_derived_bound(tmp_path):
    """0.075, between the tracked 0.05 and 0.10, against a third EMA tracking it directly. Derived
    bound: both averages are sum_i w_i theta_i with weights summing to 1, so their difference is
    sum_i (w_rec,i - w_i)(theta_i - m) for any m, at most ||w_rec - w||_1 max_i |theta_i - m| (m the
    midrange per coordinate), plus fp32 rounding of the snapshots (1e-6 of the largest weight
    times sum |c_i|, about 1.5)."""
    steps, count = 2048, 32
    thetas = walk(steps)
    track(thetas, [0.05, 0.1], count=count, directory=tmp_path)
    direct = track(thetas, [0.075], count=count).averages[0.075]["w"].double()
    got = reconstruct(tmp_path, 0.075, train_params(steps, count), run_hash="run")["w"].double()

    snaps = [(s.updates, s.sigma_rel) for s in list_snapshots(tmp_path)]
    c, err = phema.solve(snaps, steps, 0.075)
    w_rec = profile(c, snaps, steps)
    w = np.array(phema.discrete_weights(phema.gamma_of(0.075), steps))
    half_range = (thetas.max(0).values - thetas.min(0).values) / 2
    bound = float(np.abs(w_rec - w).sum()) * half_range + 1e-6 * thetas.abs().max() * np.abs(c).sum()
    assert ((got - direct).abs() <= bound).all()
    assert float(np.abs(w_rec - w).sum()) < 1e-3 and err < 1e-3  # and the bound is tight enough to mean something
    assert (got - direct).abs().max() < 1e-3 * direct.abs().max()


def test_the_average_as_of_an_earlier_step_is_made_from_the_snapshots_up_to_it(tmp_path):
    """`sample.ema_step`: at a snapshot step s mid-run, a tracked length gives its own snapshot of
    step s, and a length between gives what a third EMA tracking it over the first s updates holds
    (bound as in the test above: the discrete profiles' L1 distance times the half range, plus fp32
    rounding). A reconstruction that kept the later snapshots, or targeted the last step, fails
    both: the walk moves far between s and the end."""
    from ddpmrepro.files import load_weights

    steps, count, at = 2048, 32, 1024
    thetas = walk(steps)
    track(thetas, [0.05, 0.1], count=count, directory=tmp_path)
    train = train_params(steps, count)
    own = reconstruct(tmp_path, 0.1, train, run_hash="run", at_step=at)["w"]
    want = load_weights(tmp_path / snapshot_file(at, 0.1))["w"]
    assert (own - want).abs().max() <= 1e-5 * want.abs().max()

    direct = track(thetas[:at], [0.075], count=count).averages[0.075]["w"].double()
    got = reconstruct(tmp_path, 0.075, train, run_hash="run", at_step=at)["w"].double()
    snaps = [(s.updates, s.sigma_rel) for s in list_snapshots(tmp_path) if s.step <= at]
    c, err = phema.solve(snaps, at, 0.075)
    w_rec = profile(c, snaps, at)
    w = np.array(phema.discrete_weights(phema.gamma_of(0.075), at))
    half_range = (thetas[:at].max(0).values - thetas[:at].min(0).values) / 2
    bound = float(np.abs(w_rec - w).sum()) * half_range + 1e-6 * thetas.abs().max() * np.abs(c).sum()
    # 16 snapshots per length up to there, not 32: a looser fit than at the end, within the limit
    assert ((got - direct).abs() <= bound).all() and 1e-3 < err < MAX_FIT_ERROR
    at_end = reconstruct(tmp_path, 0.075, train, run_hash="run")["w"].double()
    assert (at_end - direct).abs().max() > 100 * (got - direct).abs().max()


def test_an_ema_step_without_snapshots_there_is_refused_in_params_and_in_the_model_directory(tmp_path):
    track(walk(64), [0.05, 0.1], count=8, directory=tmp_path)  # snapshots after steps 8, 16, ..., 64
    with pytest.raises(P.ParamsError, match=r"sample.ema_step: 20 is not a step with post-hoc EMA snapshots "
                                            r"\(train.steps 64, train.posthoc_ema_snapshots 8: 8, 16, 24, ...\); "
                                            r"the nearest: 16 or 24, or 0 for the last"):
        reconstruct(tmp_path, 0.1, train_params(64, 8), run_hash="run", at_step=20)
    with pytest.raises(P.ParamsError, match="the nearest: 64, or 0"):
        reconstruct(tmp_path, 0.1, train_params(64, 8), run_hash="run", at_step=65)
    # params.yaml is refused before any stage runs: the same rule, and ema_step without ema_length
    raw = {"train": {"steps": 64, "posthoc_ema_snapshots": 8}, "sample": {"ema_length": 0.1, "ema_step": 20}}
    with pytest.raises(P.ParamsError, match="sample.ema_step: 20 is not a step with post-hoc EMA snapshots"):
        P.from_dict(raw)
    with pytest.raises(P.ParamsError, match=r"sample.ema_step: 16 needs sample.ema_length > 0"):
        P.from_dict({**raw, "sample": {"ema_step": 16}})
    assert P.from_dict({**raw, "sample": {"ema_length": 0.1, "ema_step": 16}}).sample.ema_step == 16


def test_the_solve_against_inner_products_by_numerical_integration():
    """EDM2's closed-form inner products replaced by quadrature of the profiles, solved and
    normalised in the test: the two combinations' profiles agree (profiles, not coefficients: with
    EDM2's layout A's condition number nears 5e7, and coefficients may differ where profiles do not)."""
    from scipy.integrate import quad

    steps = 1024
    snaps = [(t, s) for t in snapshot_steps(steps, 8) for s in (0.05, 0.1)]
    prof = lambda t, s: (lambda tau: (phema.gamma_of(s) + 1) * tau ** phema.gamma_of(s) / t ** (phema.gamma_of(s) + 1)
                         if tau <= t else 0.0)

    def ip(a, b):
        lim = min(a[0], b[0])
        return quad(lambda x: prof(*a)(x) * prof(*b)(x), 0, lim, epsabs=0, epsrel=1e-13, limit=200)[0]
    A = np.array([[ip(a, b) for b in snaps] for a in snaps])
    for target in (0.04, 0.075, 0.15):
        b = np.array([ip(a, (steps, target)) for a in snaps])
        c_ref = np.linalg.lstsq(A, b, rcond=None)[0]
        c_ref /= c_ref.sum()
        c, _ = phema.solve(snaps, steps, target)
        assert np.abs(profile(c, snaps, steps) - profile(c_ref, snaps, steps)).sum() < 1e-6, target


def test_the_reconstructed_weights_equal_ema_pytorchs_solve_on_the_same_snapshots(tmp_path):
    """ema-pytorch's `solve_weights` (its own sigma -> gamma and inner products, torch.linalg.solve,
    normalised here as EDM2 does) applied to our snapshot files: the same weights to fp32 rounding.
    Only its solve: its tracking follows the other convention (module docstring)."""
    post_hoc = pytest.importorskip("ema_pytorch.post_hoc_ema")
    from ddpmrepro.files import load_weights

    steps, count = 2048, 32
    track(walk(steps), [0.05, 0.1], count=count, directory=tmp_path)
    snaps = list_snapshots(tmp_path)
    t_i = torch.tensor([float(s.updates) for s in snaps])
    gamma_i = torch.tensor([post_hoc.sigma_rel_to_gamma(s.sigma_rel) for s in snaps])
    for target in (0.04, 0.075, 0.15):
        c = post_hoc.solve_weights(t_i, gamma_i, torch.tensor([float(steps)]),
                                   torch.tensor([post_hoc.sigma_rel_to_gamma(target)]))[:, 0]
        c = c / c.sum()
        theirs = sum(float(ci) * load_weights(s.path)["w"].double() for ci, s in zip(c, snaps))
        ours = reconstruct(tmp_path, target, train_params(steps, count), run_hash="run")["w"].double()
        assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max(), target


def test_the_error_falls_with_the_number_of_snapshots():
    """The measurement behind the default (train.posthoc_ema_snapshots: 32): a random walk of 2,048
    updates, 0.075 made from 0.05 and 0.10; the error of the reconstructed average relative to the
    exact one (docs/POSTHOC_EMA.md has the table)."""
    steps = 2048
    thetas = walk(steps, dim=256).numpy()
    w = np.array(phema.discrete_weights(phema.gamma_of(0.075), steps))
    errors = {}
    for count in (4, 16, 32, 64):
        snaps = [(t, s) for t in snapshot_steps(steps, count) for s in (0.05, 0.1)]
        c, _ = phema.solve(snaps, steps, 0.075)
        exact = w @ thetas
        errors[count] = np.linalg.norm(profile(c, snaps, steps) @ thetas - exact) / np.linalg.norm(exact)
    assert errors[4] > errors[16] > errors[32] > errors[64]
    assert errors[4] > 1e-3 and errors[32] < 3e-5 and errors[64] < 3e-6


# --- what the model directory refuses -----------------------------------------------------------


@pytest.fixture
def snapshots(tmp_path):
    track(walk(64), [0.05, 0.1], count=8, directory=tmp_path)
    return tmp_path


def test_missing_snapshots_are_refused(snapshots, tmp_path):
    (snapshots / snapshot_file(16, 0.1)).unlink()
    with pytest.raises(P.ParamsError, match=r"step_000000016-sigma_0.1.safetensors is missing \(1 of 16"):
        reconstruct(snapshots, 0.07, train_params(64, 8), run_hash="run")
    with pytest.raises(P.ParamsError, match="holds no post-hoc EMA snapshots"):
        reconstruct(tmp_path / "none", 0.07, train_params(64, 8), run_hash="run")


def test_snapshots_of_another_run_are_refused(snapshots):
    path = snapshots / snapshot_file(8, 0.05)
    from ddpmrepro.files import load_weights

    save_weights(load_weights(path), path, metadata=snapshot_metadata(sigma_rel=0.05, step=8, updates=8,
                                                                      run_hash="other"))
    with pytest.raises(P.ParamsError, match="is a snapshot of run other, not of this model's run run"):
        reconstruct(snapshots, 0.07, train_params(64, 8), run_hash="run")
    # and snapshots at other steps (or of other lengths) than this run's params say
    path.unlink()
    with pytest.raises(P.ParamsError, match="step_000000008-sigma_0.1.safetensors is not one of this run's"):
        reconstruct(snapshots, 0.07, train_params(64, 4), run_hash="run")


def test_a_length_the_snapshots_cannot_make_is_refused(snapshots):
    with pytest.raises(P.ParamsError, match=r"sample.ema_length=0.01: .* profile error of .* \(at most 0.01\)"):
        reconstruct(snapshots, 0.01, train_params(64, 8), run_hash="run")
    assert MAX_FIT_ERROR == 1e-2


# --- through the stages ---------------------------------------------------------------------------


@pytest.mark.slow
def test_sample_and_export_read_the_reconstructed_average(tmp_path, monkeypatch):
    """A real training run: `load_model(ema_length=tracked length)` gives that length's last snapshot,
    `ddpmrepro sample` samples from it, `ddpmrepro export` writes it to diffusers."""
    import yaml
    from click.testing import CliRunner

    from ddpmrepro.cli import main
    from ddpmrepro.data import prepare
    from ddpmrepro.files import load_weights
    from ddpmrepro.model_dir import load_model

    monkeypatch.chdir(tmp_path)
    prepare(P.DataParams(), tmp_path / "data")
    raw = {"model": {"channels": 32, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
                     "num_head_channels": 32},  # widths of 32: diffusers' GroupNorm has 32 groups
           "diffusion": {"timesteps": 10},
           "train": {"steps": 16, "batch_per_proc": 16, "warmup_steps": 0, "log_every": 4,
                     "posthoc_ema_snapshots": 16},
           "introspect": {"every": 0, "steps": []},
           "sample": {"respacing": "", "per_class": 1, "ema_length": 0.1}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    run = lambda *a: CliRunner().invoke(main, list(a))
    out = run("train", "--data", "data", "--out", "model", "--live", "live", "--introspect", "intro",
              "--checkpoints", "ckpt")
    assert out.exit_code == 0, out.output
    for at in (0, 8):  # the last step, and sample.ema_step: 8
        model, _, _ = load_model(tmp_path / "model", 0.999, ema_length=0.1, ema_step=at)
        snap = load_weights(tmp_path / "model" / "phema" / snapshot_file(at or 16, 0.1))
        for k, v in model.state_dict().items():
            assert (v - snap[k]).abs().max() <= 1e-5 * max(snap[k].abs().max(), 1e-3), (at, k)
    assert run("sample", "--model", "model", "--out", "samples").exit_code == 0
    out = run("export", "--format", "diffusers", "--model", "model", "--out", "hf")
    assert out.exit_code == 0, out.output
    import json

    assert json.loads((tmp_path / "hf" / "ddpmrepro.json").read_text())["ema_length"] == 0.1
