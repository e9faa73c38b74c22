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
from ddpmrepro.model_dir import (MAX_FIT_ERROR, add_to_manifest, list_snapshots, reconstruct, snapshot_file,
                                 snapshot_metadata, snapshot_steps)
from ddpmrepro.files import save_weights, sha256
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


def track(thetas: torch.Tensor, sigmas, *, count: int, directory=None, skip=(), dtype="fp32"):
    """Runs a PowerEMA over the weights `thetas` (one step each), snapshots into `directory`."""
    model = Walk(thetas.shape[1])
    ema = PowerEMA(model, sigmas, count=count, steps=len(thetas), dtype=dtype)
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
    add_to_manifest(snapshots, {path.name: sha256(path)})  # a whole snapshot of another run, not a damaged one
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


# --- how the snapshots are stored: precision, one copy, their sums --------------------------------

UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}  # round to nearest: half an ulp, relative


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_rounded_snapshots_reconstruct_within_the_rounding_bound(tmp_path, dtype):
    """`train.posthoc_ema_dtype`: the files hold fp16/bf16, the averages stay fp32 (the same bits as
    with fp32 files: resume is unchanged) and are summed in fp64. The reconstruction from rounded
    snapshots then differs from the fp32 snapshots' by sum_i c_i (round(s_i) - s_i): per element at
    most u sum_i |c_i| |s_i| (u the unit roundoff), plus the fp32 rounding of each result."""
    from safetensors import safe_open

    from ddpmrepro.files import load_weights

    steps, count = 2048, 32
    thetas = walk(steps)
    full, rounded = tmp_path / "fp32", tmp_path / dtype
    ema32 = track(thetas, [0.05, 0.1], count=count, directory=full)
    ema = track(thetas, [0.05, 0.1], count=count, directory=rounded, dtype=dtype)
    for s in (0.05, 0.1):
        assert ema.averages[s]["w"].dtype == torch.float32
        assert torch.equal(ema.averages[s]["w"], ema32.averages[s]["w"])
    with safe_open(str(rounded / snapshot_file(steps, 0.1)), "pt") as f:
        assert f.get_tensor("w").dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    train = train_params(steps, count)
    snaps = list_snapshots(full)
    for length in (0.05, 0.075, 0.15):
        want = reconstruct(full, length, train, run_hash="run")["w"].double()
        got = reconstruct(rounded, length, train, run_hash="run")["w"].double()
        c, _ = phema.solve([(s.updates, s.sigma_rel) for s in snaps], steps, length)
        bound = UNIT_ROUNDOFF[dtype] * sum(abs(float(ci)) * load_weights(s.path)["w"].double().abs()
                                           for ci, s in zip(c, snaps))
        bound += 2.0 ** -24 * (want.abs() + got.abs())
        assert ((got - want).abs() <= bound).all(), length
        assert (got - want).abs().max() > 1e-3 * UNIT_ROUNDOFF[dtype] * want.abs().max()  # rounded indeed


def test_fp16_snapshots_take_half_the_bytes_and_a_tensor_beyond_its_range_stays_fp32(tmp_path):
    from ddpmrepro.files import load_weights

    thetas = walk(4, dim=4096)
    for dtype in ("fp32", "fp16"):
        track(thetas, [0.1], count=1, directory=tmp_path / dtype, dtype=dtype)
    size = {d: (tmp_path / d / snapshot_file(4, 0.1)).stat().st_size for d in ("fp32", "fp16")}
    assert 0.5 * size["fp32"] < size["fp16"] < 0.51 * size["fp32"]
    # fp16 ends at 65504: a weight past it would be stored as inf, so its tensor keeps fp32
    model = torch.nn.Module()
    model.big, model.small = torch.nn.Parameter(torch.full((3,), 1e5)), torch.nn.Parameter(torch.ones(3) / 3)
    ema = PowerEMA(model, [0.1], count=1, steps=1, dtype="fp16")
    ema.update()
    ema.snapshot(1, tmp_path / "range", run_hash="run")
    w = load_weights(tmp_path / "range" / snapshot_file(1, 0.1))
    assert w["big"].dtype == torch.float32 and torch.equal(w["big"], model.big.detach())
    assert w["small"].dtype == torch.float16


def test_a_bad_snapshot_dtype_is_refused_by_check_params(tmp_path):
    import subprocess
    import sys

    import yaml

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {"posthoc_ema_dtype": "float8"}}))
    out = subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "check-params", "--out", "resolved"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 2 and not (tmp_path / "resolved").exists()
    assert out.stderr.strip().splitlines() == [
        "Error: params.yaml: train.posthoc_ema_dtype: 'float8' is not one of fp16 | bf16 | fp32"]


def test_the_snapshot_dtype_enters_the_run_hash_unless_it_is_fp32_or_nothing_is_tracked():
    """Another dtype writes other files into the run directory, so it is another run; fp32, what
    runs wrote before the key existed, and any dtype without post-hoc EMA, leave the hash as it was."""
    from ddpmrepro.training.loop import run_hash

    def h(**train):
        return run_hash(P.from_dict({"train": train}), "data")
    assert len({h(posthoc_ema_dtype=d) for d in ("fp32", "fp16", "bf16")}) == 3
    assert len({h(posthoc_ema=[], posthoc_ema_dtype=d) for d in ("fp32", "fp16", "bf16")}) == 1
    # fp32 hashes what the train section held before the key: the same hash as without it
    import hashlib
    import json

    from ddpmrepro.training.loop import OPERATIONAL_TRAIN_KEYS

    d = P.from_dict({"train": {"posthoc_ema_dtype": "fp32"}}).to_dict()
    train = {k: v for k, v in d["train"].items() if k not in (*OPERATIONAL_TRAIN_KEYS, "compile", "cuda_graphs",
                                                                        "channels_last", "hflip", "posthoc_ema_dtype",
                                                                        "nodes")}  # nodes: hashed as processes
    model = {k: v for k, v in d["model"].items() if k != "grad_checkpoint"}
    blob = json.dumps({"data": "data", "model": model, "diffusion": d["diffusion"], "train": train,
                       "introspect": d["introspect"]}, sort_keys=True)
    assert h(posthoc_ema_dtype="fp32") == hashlib.sha256(blob.encode()).hexdigest()[:16]


def exported(tmp_path, *, steps=4, dtype=None):
    """A model directory exported from a run directory as `train` does (`write_model` with the run's
    snapshots), of a small UNet whose weights move at every step: (model dir, run's snapshot dir)."""
    from ddpmrepro.model.unet import build_unet
    from ddpmrepro.model_dir import data_section, write_model

    train = {"steps": steps, "posthoc_ema_snapshots": steps, "warmup_steps": 0}
    if dtype:
        train["posthoc_ema_dtype"] = dtype
    params = P.from_dict({"model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1,
                                    "attention_resolutions": [4], "num_head_channels": 16}, "train": train})
    torch.manual_seed(0)
    net = build_unet(params.model, image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    ema = PowerEMA(net, params.train.posthoc_ema, count=steps, steps=steps, **({"dtype": dtype} if dtype else {}))
    run = tmp_path / "checkpoints" / "run" / "code" / "phema"
    for step in range(1, steps + 1):
        with torch.no_grad():
            for w in net.parameters():
                w.add_(0.01 * torch.randn_like(w))
        ema.update()
        ema.snapshot(step, run, run_hash="run")
    manifest = {"source": "digits", "num_classes": 10, "image_size": 8, "channels": 1,
                "class_names": list("0123456789")}
    config = {"params": params.to_dict(), "data": data_section(manifest), "data_sha256": {}, "code_version": "code",
              "run_hash": "run", "ema_rates": [0.999], "final": {}, "torch": torch.__version__}
    write_model(tmp_path / "model", config, net.state_dict(), {0.999: net.state_dict()}, snapshots=run)
    return tmp_path / "model", run


def test_the_export_links_the_snapshots_one_copy_on_disk(tmp_path):
    """models/ddpm/phema/ and the run directory hold the same files (hard links): the bytes of one
    copy. A resume that redoes a snapshot step renames a new file over the run directory's name,
    which leaves the exported one as it was (same bits, still its sum); a re-export (a rerun with no
    step left) links the run directory's files again."""
    import json
    import os

    from ddpmrepro.files import load_weights, weights_metadata
    from ddpmrepro.model_dir import read_manifest, write_model

    model, run = exported(tmp_path)
    names = sorted(p.name for p in run.glob("step_*"))
    assert len(names) == 8 and sorted(p.name for p in (model / "phema").glob("step_*")) == names
    assert all(os.stat(model / "phema" / n).st_ino == os.stat(run / n).st_ino for n in names)
    allocated = lambda *dirs: sum(os.stat(p).st_blocks for p in {os.stat(p).st_ino: p for d in dirs
                                                                  for p in d.glob("step_*")}.values())
    assert allocated(model / "phema", run) == allocated(run)  # `du` of both: one copy
    assert read_manifest(model / "phema") == {n: sha256(run / n) for n in names}

    before = (model / "phema" / names[-1]).read_bytes()
    save_weights(load_weights(run / names[-1]), run / names[-1], metadata=weights_metadata(run / names[-1]))
    assert os.stat(model / "phema" / names[-1]).st_ino != os.stat(run / names[-1]).st_ino
    assert (model / "phema" / names[-1]).read_bytes() == before == (run / names[-1]).read_bytes()
    config = json.loads((model / "config.json").read_text())
    train = P.from_dict(config["params"]).train
    reconstruct(model / "phema", 0.1, train, run_hash="run")

    weights = load_weights(model / "model.safetensors")
    write_model(model, config, weights, {0.999: weights}, snapshots=run)
    assert all(os.stat(model / "phema" / n).st_ino == os.stat(run / n).st_ino for n in names)
    reconstruct(model / "phema", 0.1, train, run_hash="run")


def flip_a_bit_in_the_tensor_data(path):
    """One bit in the middle of a safetensors file's data (past its 8-byte length and JSON header)."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    at = 8 + header + (len(data) - 8 - header) // 2
    data[at] ^= 0x10
    with open(path, "r+b") as f:  # in place, as a disk or a stray write would: no new file
        f.write(data)


def test_a_flipped_bit_in_a_snapshot_is_refused_before_sampling(tmp_path, monkeypatch):
    """`ddpmrepro sample` with sample.ema_length reads the snapshots: with one bit of one snapshot's
    tensor data flipped it exits non-zero with one line naming that file, and writes no samples
    (it sampled from the intact directory a moment before)."""
    import yaml
    from click.testing import CliRunner

    from ddpmrepro.cli import main

    model, _ = exported(tmp_path, steps=16)  # 16 snapshots per length make 0.08 (4 would not)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"sample": {"ema_length": 0.08, "per_class": 1,
                                                                     "nfe": 3}}))
    ok = CliRunner().invoke(main, ["sample", "--model", "model", "--out", "intact"])
    assert ok.exit_code == 0 and (tmp_path / "intact" / "samples.npz").exists(), ok.output
    damaged = model / "phema" / snapshot_file(2, 0.1)
    flip_a_bit_in_the_tensor_data(damaged)
    out = CliRunner().invoke(main, ["sample", "--model", "model", "--out", "samples"])
    assert out.exit_code != 0 and not (tmp_path / "samples").exists()
    assert out.output.strip().splitlines() == [
        f"Error: {damaged.relative_to(tmp_path)}: sha256 differs from {model.relative_to(tmp_path)}/phema/SHA256SUMS "
        "(damaged or modified since it was written); its bytes are shared by 2 hard links (DVC's cache, the run's "
        "checkpoint directory), so `dvc checkout` cannot restore them: `dvc pull --force model` from a remote, "
        "or retrain with `ddpmrepro train --restart` (a `dvc repro` would find the damaged run finished)"]


def test_a_flipped_bit_in_the_ema_weights_is_refused_before_sampling(tmp_path, monkeypatch):
    """The same for the fixed-rate EMA that `sample.ema_rate` reads (models/ddpm/SHA256SUMS): one
    line naming the file, nothing written, and the raw weights (another file) still sample."""
    import yaml
    from click.testing import CliRunner

    from ddpmrepro.cli import main

    model, _ = exported(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"sample": {"ema_rate": 0.999, "per_class": 1, "nfe": 3}}))
    damaged = model / "ema_0.999.safetensors"
    flip_a_bit_in_the_tensor_data(damaged)
    out = CliRunner().invoke(main, ["sample", "--model", "model", "--out", "samples"])
    assert out.exit_code != 0 and not (tmp_path / "samples").exists()
    assert out.output.strip().splitlines() == [
        f"Error: {damaged.relative_to(tmp_path)}: sha256 differs from {model.relative_to(tmp_path)}/SHA256SUMS "
        "(damaged or modified since it was written); restore the model directory (`dvc checkout model`) or "
        "retrain"]
    (tmp_path / "raw.yaml").write_text(yaml.safe_dump({"sample": {"ema_rate": 0, "per_class": 1, "nfe": 3}}))
    raw = CliRunner().invoke(main, ["sample", "-p", "raw.yaml", "--model", "model", "--out", "raw"])
    assert raw.exit_code == 0 and (tmp_path / "raw" / "samples.npz").exists(), raw.output


def test_a_damaged_run_directory_snapshot_fails_the_export_and_a_missing_manifest_is_refused(tmp_path):
    """The export checks each snapshot against the sums written with it (a damaged one never gets a
    fresh sum); a model directory without SHA256SUMS (exported before it existed) is refused with
    the way to write one."""
    from ddpmrepro.files import CheckpointError, load_weights
    from ddpmrepro.model_dir import read_config, write_model

    model, run = exported(tmp_path)
    (model / "phema" / "SHA256SUMS").unlink()
    train = P.from_dict(read_config(model)["params"]).train
    with pytest.raises(CheckpointError, match=r"phema/SHA256SUMS: not found, .*, or, if you trust them, write it: "
                                              r"\(cd .*phema && sha256sum step_\*.safetensors > SHA256SUMS\)$"):
        reconstruct(model / "phema", 0.1, train, run_hash="run")
    flip_a_bit_in_the_tensor_data(run / snapshot_file(3, 0.05))  # the model directory's link too
    weights = load_weights(model / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"^{run / snapshot_file(3, 0.05)}: sha256 differs from "
                                              rf"{run / 'SHA256SUMS'} .*; retrain \(`ddpmrepro train --restart`\)$"):
        write_model(tmp_path / "again", read_config(model), weights, {0.999: weights}, snapshots=run)
    assert not (tmp_path / "again").exists()


def test_the_precision_benchmark_measures_each_dtype_against_the_fp32_snapshots(tmp_path):
    """benchmarks/phema_precision.py on a model directory with fp32 snapshots: per length, the rounded
    snapshots' error within u sum |c_i| (relative L2 over the weights is at most the per-element
    bound relative to each weight), and the bytes of each dtype."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model, _ = exported(tmp_path, steps=16, dtype="fp32")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "phema_precision.py"), "--model", str(model),
                          "--lengths", "0.05,0.08,0.1", "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert [row["length"] for row in r["weights"]] == [0.05, 0.08, 0.1]
    for row in r["weights"]:
        for dtype in ("fp16", "bf16"):
            assert 0 < row[dtype]["rel_l2"] <= row[dtype]["bound_u_sum_abs_c"], (row, dtype)
        assert row["bf16"]["rel_l2"] > 4 * row["fp16"]["rel_l2"]
    assert 0.49 < r["snapshot_bytes"]["fp16"] / r["snapshot_bytes"]["fp32"] < 0.52


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
    # One copy on disk: the model directory's snapshots are the run directory's files, also after a
    # rerun with no step left (it exports again from the run directory).
    import os

    (run_dir,) = (tmp_path / "ckpt").glob("*/*/phema")
    for again in (False, True):
        if again:
            assert run("train", "--data", "data", "--out", "model", "--live", "live", "--introspect", "intro",
                       "--checkpoints", "ckpt").exit_code == 0
        names = sorted(p.name for p in run_dir.glob("step_*"))
        assert len(names) == 32 and sorted(p.name for p in (tmp_path / "model" / "phema").glob("step_*")) == names
        assert all(os.stat(run_dir / n).st_ino == os.stat(tmp_path / "model" / "phema" / n).st_ino for n in names)
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
