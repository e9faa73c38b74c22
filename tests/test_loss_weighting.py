"""Loss weighting (diffusion.loss_weighting) against the papers' closed forms and invariants.

The weights are checked at every t against SNR_t written out from the betas (never against the
code's own tables); the x0 forms against the eps forms through the predictions they imply; the
importance sampler's composition as an exact sum over t; `none` bitwise against L_simple.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from ddpmrepro import params as P
from ddpmrepro.cli import main
from ddpmrepro.data import prepare
from ddpmrepro.model import diffusion as D
from ddpmrepro.training.timestep_sampler import LossSecondMomentSampler

T = 1000


def snr(schedule: str, steps: int = T) -> np.ndarray:
    """SNR_t = alpha_bar_t / (1 - alpha_bar_t), alpha_bar as a product written out, in float64."""
    acc, out = 1.0, []
    for b in D.get_beta_schedule(schedule, steps):
        acc *= 1.0 - b
        out.append(acc / (1.0 - acc))
    return np.array(out)


# The papers' definitions on their own scale, and the other scale through ||eps - eps^||^2 = SNR ||x0 - x0^||^2.
def min_snr_x0(s, gamma):  # Hang et al. 2023: the x0 MSE weighted by min(SNR, gamma)
    return np.minimum(s, gamma)


def p2_eps(s, k, gamma):  # Choi et al. 2022: L_simple (the eps MSE) weighted by 1 / (k + SNR)^gamma
    return 1.0 / (k + s) ** gamma


CLOSED_FORMS = {
    ("min_snr", "x0"): lambda s, kw: min_snr_x0(s, kw["min_snr_gamma"]),
    ("min_snr", "eps"): lambda s, kw: min_snr_x0(s, kw["min_snr_gamma"]) / s,
    ("p2", "eps"): lambda s, kw: p2_eps(s, kw["p2_k"], kw["p2_gamma"]),
    ("p2", "x0"): lambda s, kw: s * p2_eps(s, kw["p2_k"], kw["p2_gamma"]),
}
SETTINGS = {"min_snr": [{"min_snr_gamma": 5.0}, {"min_snr_gamma": 1.0}],
            "p2": [{"p2_k": 1.0, "p2_gamma": 1.0}, {"p2_k": 1.0, "p2_gamma": 0.5}, {"p2_k": 0.3, "p2_gamma": 2.0}]}
CASES = [pytest.param(w, pred, sched, kw, id=f"{w}-{pred}-{sched}-{'-'.join(map(str, kw.values()))}")
         for w in SETTINGS for kw in SETTINGS[w] for pred in ("eps", "x0") for sched in ("linear", "cosine")]


def make(schedule="linear", steps=T, **kw) -> D.GaussianDiffusion:
    return D.GaussianDiffusion(D.get_beta_schedule(schedule, steps), **kw)


def test_the_codebase_predicts_eps_and_x0_only():
    """The weights below cover every prediction the code supports; a new one (v) needs its form."""
    assert {p.value for p in D.Prediction} == {"eps", "x0"}
    assert P.DiffusionParams.__dataclass_fields__["prediction"].metadata["choices"] == ("eps", "x0")


@pytest.mark.parametrize("weighting, prediction, schedule, kw", CASES)
def test_the_loss_is_the_closed_form_weight_times_the_mse_at_every_t(weighting, prediction, schedule, kw):
    diff = make(schedule, prediction=prediction, loss_weighting=weighting, **kw)
    w = CLOSED_FORMS[weighting, prediction](snr(schedule), kw)
    np.testing.assert_allclose(diff.mse_weights.numpy(), w, rtol=1e-12)
    # Through training_losses, one example per timestep.
    torch.manual_seed(0)
    x0, noise = torch.rand(T, 1, 2, 2) * 2 - 1, torch.randn(T, 1, 2, 2)
    t = torch.arange(T)
    out = diff.training_losses(lambda x, t_: 0.5 * torch.tanh(x), x0, t, noise=noise)
    torch.testing.assert_close(out["loss"], torch.tensor(w, dtype=torch.float32) * out["mse"], rtol=1e-6, atol=0)
    assert (out["mse"] > 0).all() and torch.isfinite(out["loss"]).all()


@pytest.mark.parametrize("weighting, kw", [("min_snr", {"min_snr_gamma": 5.0}), ("p2", {"p2_k": 1.0, "p2_gamma": 1.0}),
                                           ("p2", {"p2_k": 0.5, "p2_gamma": 0.5})])
def test_eps_and_x0_forms_weight_the_same_prediction_the_same(weighting, kw):
    """An eps model and the x0 model that implies the same x0 get the same weighted loss: the x0 form
    is the eps form times SNR_t (not divided by it)."""
    eps_diff = make(prediction="eps", loss_weighting=weighting, **kw)
    x0_diff = make(prediction="x0", loss_weighting=weighting, **kw)
    torch.manual_seed(0)
    t = torch.tensor([0, 3, 40, 200, 500, 800, 950])
    x0, noise = (torch.rand(len(t), 1, 3, 3) * 2 - 1).double(), torch.randn(len(t), 1, 3, 3).double()
    ab = torch.tensor(np.cumprod(1 - D.get_beta_schedule("linear", T))[t.numpy()]).view(-1, 1, 1, 1)
    xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    eps_hat = noise + 0.1 * torch.randn_like(noise)
    x0_hat = (xt - (1 - ab).sqrt() * eps_hat) / ab.sqrt()  # the x0 that eps_hat implies, in float64
    a = eps_diff.training_losses(lambda x, t_: eps_hat.float(), x0.float(), t, noise=noise.float())
    b = x0_diff.training_losses(lambda x, t_: x0_hat.float(), x0.float(), t, noise=noise.float())
    torch.testing.assert_close(a["loss"], b["loss"], rtol=2e-3, atol=1e-6)
    assert not torch.allclose(a["mse"], b["mse"], rtol=0.1)  # unweighted, the two scales differ


def test_none_is_bitwise_l_simple_and_the_hybrid_vb_term_too():
    """`none` multiplies by nothing: the loss is torch.equal to the MSE written out here (and, run once,
    to the base commit's losses and gradients: see the commit that adds loss_weighting)."""
    torch.manual_seed(0)
    x0, noise, t = torch.rand(5, 1, 4, 4) * 2 - 1, torch.randn(5, 1, 4, 4), torch.tensor([0, 1, 99, 500, 999])
    out = torch.randn(5, 2, 4, 4).clamp(-0.9, 0.9)
    for prediction in ("eps", "x0"):
        target = noise if prediction == "eps" else x0
        mse = ((target - out[:, :1]) ** 2).mean(dim=(1, 2, 3))
        plain = make(prediction=prediction).training_losses(lambda x, t_: out[:, :1], x0, t, noise=noise)
        assert torch.equal(plain["loss"], mse)
        hybrid = make(prediction=prediction, variance="learned_range", loss="hybrid")
        h = hybrid.training_losses(lambda x, t_: out, x0, t, noise=noise)
        assert torch.equal(h["loss"], mse + h["vb"])


@pytest.mark.parametrize("weighting, kw", [("min_snr", {"min_snr_gamma": 5.0}), ("p2", {"p2_k": 1.0, "p2_gamma": 1.0})])
@pytest.mark.parametrize("loss", ["hybrid", "mse"])
def test_the_vb_term_is_not_weighted_and_trains_the_variance_as_before(weighting, kw, loss):
    """With a learned variance (hybrid, or mse + the unscaled VLB), loss = w_t mse + vb: the vb term and
    the variance channels' gradient are those of `none`; the mean channels' gradient is w_t times theirs."""
    torch.manual_seed(0)
    x0 = torch.randint(0, 256, (4, 1, 4, 4)).float() / 127.5 - 1
    noise, t = torch.randn_like(x0), torch.tensor([0, 1, 100, 999])
    out = torch.randn(4, 2, 4, 4).clamp(-0.9, 0.9).requires_grad_()
    base = make(variance="learned_range", loss=loss).training_losses(lambda x, t_: out, x0, t, noise=noise)
    weighted = make(variance="learned_range", loss=loss, loss_weighting=weighting, **kw)
    terms = weighted.training_losses(lambda x, t_: out, x0, t, noise=noise)
    w = torch.tensor(CLOSED_FORMS[weighting, "eps"](snr("linear"), kw)[t.numpy()], dtype=torch.float32)
    assert torch.equal(terms["vb"], base["vb"]) and torch.equal(terms["mse"], base["mse"])
    torch.testing.assert_close(terms["loss"], w * terms["mse"] + terms["vb"])
    assert not torch.allclose(w, torch.ones_like(w))
    (g_base,) = torch.autograd.grad(base["loss"].sum(), out)
    (g,) = torch.autograd.grad(terms["loss"].sum(), out)
    torch.testing.assert_close(g[:, 1], g_base[:, 1])  # the variance: the VLB alone, unweighted
    torch.testing.assert_close(g[:, 0], w.view(-1, 1, 1) * g_base[:, 0])  # the mean: the MSE, weighted


@pytest.mark.parametrize("weighting, kw", [("min_snr", {"min_snr_gamma": 5.0}), ("p2", {"p2_k": 1.0, "p2_gamma": 1.0})])
def test_importance_sampling_leaves_the_expected_weighted_loss_unchanged(weighting, kw):
    """The loss-second-moment sampler, warmed up on the weighted losses the loop feeds it: summing over
    every t, sum_t p_t (1 / (T p_t)) w_t L_t == (1/T) sum_t w_t L_t, with the importance weight each t
    gets from the sampler's own draw, and p_t fit to the weighted losses (not the unweighted ones)."""
    steps = 50
    diff = make("cosine", steps, loss_weighting=weighting, **kw)
    sampler = LossSecondMomentSampler(steps, history=3)
    torch.manual_seed(0)
    t = torch.arange(steps)
    model = lambda x, t_: 0.5 * torch.tanh(x) + 0.01 * t_.float().view(-1, 1, 1, 1)  # noqa: E731
    for _ in range(3):  # the loop feeds losses["loss"], the weighted one
        x0, noise = torch.rand(steps, 1, 4, 4) * 2 - 1, torch.randn(steps, 1, 4, 4)
        sampler.update(t, diff.training_losses(model, x0, t, noise=noise)["loss"])
    assert sampler.warmed_up()
    p = torch.from_numpy(sampler.weights() / sampler.weights().sum())
    assert not torch.allclose(p, torch.full_like(p, 1 / steps), rtol=0.1)
    rms = torch.from_numpy(np.sqrt((sampler.loss_history ** 2).mean(axis=1)))
    torch.testing.assert_close(p, 0.999 * rms / rms.sum() + 0.001 / steps)
    # One draw inside each t's interval of the cdf: the sampler returns that t and its 1 / (T p_t).
    cdf = torch.cumsum(p, 0)
    drawn_t, importance = sampler.sample_from_uniform(cdf - p / 2)
    assert torch.equal(drawn_t, t)
    weighted = diff.training_losses(model, x0, t, noise=noise)["loss"].double()
    torch.testing.assert_close((p * importance.double() * weighted).sum(), weighted.mean(), rtol=1e-6, atol=0)


def test_a_weighting_with_the_pure_vlb_is_refused():
    with pytest.raises(ValueError, match="kl"):
        make(loss="kl", variance="learned_range", loss_weighting="min_snr")
    with pytest.raises(ValueError, match="> 0"):
        make(loss_weighting="p2", p2_k=0.0)


# --- params --------------------------------------------------------------------------------------------


def test_null_keys_take_the_papers_values_and_round_trip():
    d = P.from_dict({"diffusion": {"loss_weighting": "min_snr"}}).diffusion
    assert (d.min_snr_gamma, d.p2_k, d.p2_gamma) == (5.0, None, None)
    d = P.from_dict({"diffusion": {"loss_weighting": "p2", "p2_gamma": 0.5}}).diffusion
    assert (d.min_snr_gamma, d.p2_k, d.p2_gamma) == (None, 1.0, 0.5)
    assert P.from_dict({"diffusion": dict(vars(d))}).diffusion == d  # config.json reads back the same
    none = P.from_dict({}).diffusion
    assert (none.loss_weighting, none.min_snr_gamma, none.p2_k, none.p2_gamma) == ("none", None, None, None)
    assert D.from_params(d).mse_weights.numpy() == pytest.approx(p2_eps(snr("cosine"), 1.0, 0.5), rel=1e-12)


def test_the_weighting_keys_reach_the_run_hash_and_dvc():
    """The train stage's DVC params and the checkpoint directory's run hash take the diffusion section whole."""
    from ddpmrepro.training.loop import run_hash

    runs = [{}, {"loss_weighting": "min_snr"}, {"loss_weighting": "min_snr", "min_snr_gamma": 3},
            {"loss_weighting": "p2"}, {"loss_weighting": "p2", "p2_k": 2}]
    hashes = {run_hash(P.from_dict({"diffusion": d}), "data") for d in runs}
    assert len(hashes) == len(runs)
    stages = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"]
    assert "diffusion" in stages["train"]["params"]


BAD = [
    ({"loss_weighting": "min_snr", "min_snr_gamma": 0}, "diffusion.min_snr_gamma: must be > 0"),
    ({"loss_weighting": "min_snr", "min_snr_gamma": -5}, "diffusion.min_snr_gamma: must be > 0"),
    ({"loss_weighting": "p2", "p2_k": -1}, "diffusion.p2_k: must be > 0"),
    ({"loss_weighting": "p2", "p2_k": 0}, "diffusion.p2_k: must be > 0"),
    ({"loss_weighting": "p2", "p2_gamma": 0}, "diffusion.p2_gamma: must be > 0"),
    ({"loss_weighting": "p2", "min_snr_gamma": 5}, "diffusion.min_snr_gamma: only read with loss_weighting: min_snr"),
    ({"loss_weighting": "min_snr", "p2_k": 1}, "diffusion.p2_k: only read with loss_weighting: p2"),
    ({"p2_gamma": 1}, "diffusion.p2_gamma: only read with loss_weighting: p2 (it is none)"),
    ({"loss_weighting": "p2", "loss": "kl", "variance": "learned_range"}, "diffusion.loss_weighting: 'p2' weights"),
    ({"loss_weighting": "snr"}, "diffusion.loss_weighting: 'snr' is not one of none | min_snr | p2 | learned"),
]


@pytest.mark.parametrize("diffusion, message", BAD)
def test_bad_weighting_keys_exit_2_with_one_line_naming_the_key_and_write_nothing(tmp_path, monkeypatch, diffusion,
                                                                                  message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"diffusion": diffusion}))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("earlier")
    (tmp_path / "model" / "SHA256SUMS").write_text("earlier")  # an earlier model directory
    result = CliRunner().invoke(main, ["train", "--params", "params.yaml", "--data", "data", "--out", "model",
                                       "--live", "live", "--introspect", "introspect", "--checkpoints", "ckpt"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: params.yaml: {message}"), result.stderr
    assert result.stdout == ""
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["model", "model/SHA256SUMS", "model/config.json", "params.yaml"]
    assert (tmp_path / "model" / "config.json").read_text() == "earlier"


# --- end to end ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(P.DataParams(), out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("diffusion", [
    {"loss_weighting": "min_snr"},
    {"loss_weighting": "p2", "p2_gamma": 0.5, "prediction": "x0", "variance": "learned_range", "loss": "hybrid"},
    {"loss_weighting": "learned", "variance": "learned_range", "loss": "hybrid"},
], ids=["min_snr", "p2-x0-hybrid", "learned-hybrid"])
def test_a_short_train_with_a_weighting_runs_with_a_finite_loss(tmp_path, prepared, one_thread, diffusion):
    from test_train import SMALL, train_cmd

    raw = {k: dict(v) for k, v in SMALL.items()}
    raw["diffusion"].update(diffusion)
    raw["train"].update(steps=4, checkpoint_every=4)
    raw["introspect"] = {"every": 0, "steps": []}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, train_cmd(tmp_path, prepared, tmp_path / "params.yaml", 1)[3:])
    assert result.exit_code == 0, (result.output, result.exception)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    resolved = config["params"]["diffusion"]
    assert resolved["loss_weighting"] == diffusion["loss_weighting"]
    if diffusion["loss_weighting"] != "learned":
        assert resolved["min_snr_gamma" if diffusion["loss_weighting"] == "min_snr" else "p2_k"] is not None
    else:  # u(t) exported beside the weights, and its table in the introspection output at every log step
        import pandas as pd
        from ddpmrepro.files import load_weights

        exported = load_weights(tmp_path / "model" / "loss_weight.safetensors")
        assert exported["u"].shape == (10,) and exported["u"].abs().max() > 0  # it moved from 0
        table = pd.read_parquet(tmp_path / "introspect" / "loss_weight")
        assert sorted(table["step"].unique()) == [2, 4] and len(table) == 2 * 10
        last = table[table["step"] == 4].sort_values("t")
        np.testing.assert_allclose(last["u"], exported["u"].double().numpy(), rtol=0, atol=1e-7)
    final = config["final"]
    assert np.isfinite(final["loss"]) and final["loss"] > 0
    # The report draws u(t) from that table, and only then (its lines: tests/test_report.py).
    from ddpmrepro.evaluation.report import make_report
    from ddpmrepro.params import ReportParams

    drawn = make_report(tmp_path / "introspect", tmp_path / "live", tmp_path / "figures", ReportParams())
    assert ("loss_weight.png" in {p.name for p in drawn}) == (diffusion["loss_weighting"] == "learned")
    if diffusion["loss_weighting"] == "min_snr":  # eps: w_t = min(1, 5 / SNR_t) < 1 at the first steps of T=10
        assert final["loss"] < final["mse"]


# --- learned (EDM2): training/learned_weighting.py -------------------------------------------------------


def test_the_learned_weighting_converges_to_the_log_of_each_levels_mean_loss():
    """min_u E[L_t e^{-u} + u] is at u* = log E[L_t] (the derivative -E[L_t] e^{-u} + 1 vanishes there).

    Synthetic losses with known per-level mean s_t, smooth in log-SNR as real ones are:
    L_{t,i} = s_t g_{t,i}, g ~ chi2_k / k (mean 1, variance 2/k), N fixed draws per level. Over this
    sample the objective is mean_t (m_t e^{-u_t} + u_t), m_t the level's sample mean (it is linear
    in L, so the means stand for the draws exactly), convex in the layer's weights since u is
    linear in them: Adam reaches its one minimiser, where every gradient vanishes (checked). Its
    distance to log s_t has two parts: the sample's, |log m_t - log s_t| ~ |m_t/s_t - 1| of standard
    deviation sqrt(2/(kN)) (= 0.0129 for k = 3, N = 4000; under 4 of them, 0.052, at all 20 levels
    but with probability ~1e-3, and the seed is fixed; checked), which the smooth family filters
    rather than adds; and the family's, how far 128 Fourier features miss the smooth log s_t, given
    0.01. So |u_t - log s_t| < 0.052 + 0.01 (it is 0.019 here).
    """
    from ddpmrepro.training.learned_weighting import LearnedLossWeight

    torch.manual_seed(0)
    steps, k, n = 20, 3, 4000
    ac = np.cumprod(1.0 - D.get_beta_schedule("cosine", steps))
    lam = np.log(ac / (1 - ac))
    s = torch.tensor(0.05 + 1.0 / (1.0 + np.exp(lam)), dtype=torch.float32)  # x0-like: 0.05..1.05
    losses = s[:, None] * torch.distributions.Chi2(torch.tensor(float(k))).sample((steps, n)) / k  # (T, N)
    m = losses.double().mean(1).float()
    sd = (2 / (k * n)) ** 0.5
    assert (m.double().log() - s.double().log()).abs().max() < 4 * sd  # the sample is as the derivation says

    weight = LearnedLossWeight(ac, seed=0)
    t, zero = torch.arange(steps), torch.zeros(steps)
    assert torch.equal(weight(t), zero)  # at initialisation u = 0: the objective is the unweighted loss

    def objective():
        out = weight.weigh({"loss": m, "mse": m, "vb": zero}, t)
        return (out["loss"] + out["u"]).mean()

    opt = torch.optim.Adam(weight.parameters(), lr=0.1)
    for i in range(1000):
        opt.param_groups[0]["lr"] = 0.1 * (1 - i / 1000)
        opt.zero_grad()
        objective().backward()
        opt.step()
    opt.zero_grad()
    objective().backward()
    assert max(p.grad.abs().max() for p in weight.parameters()) < 1e-4  # at the family's minimiser
    u = weight.curve().double()
    assert (u - s.double().log()).abs().max() < 4 * sd + 0.01, (u - s.double().log()).abs().max()
    # The bias's zero gradient: the weighted terms m_t e^{-u_t} average exactly 1 over the levels.
    assert (m.double() * torch.exp(-u)).mean().item() == pytest.approx(1.0, abs=1e-4)


def test_the_learned_weighting_divides_the_mse_term_only_and_starts_at_the_unweighted_loss():
    from ddpmrepro.training.learned_weighting import LearnedLossWeight

    diff = make("cosine", steps=10, variance="learned_range", loss="hybrid")
    weight = LearnedLossWeight(diff.alphas_cumprod.numpy(), seed=3)
    torch.manual_seed(0)
    x0, t = torch.rand(6, 3, 8, 8) * 2 - 1, torch.randint(0, 10, (6,))
    out = torch.randn(6, 6, 8, 8, requires_grad=True)
    losses = diff.training_losses(lambda x, t_: out, x0, t)
    w = weight.weigh(losses, t)
    assert torch.equal(w["loss"] + w["u"], losses["mse"] * 1.0 + losses["vb"])  # u = 0: the hybrid loss itself
    with torch.no_grad():
        weight.bias.fill_(math.log(4.0))
    w = weight.weigh(losses, t)
    torch.testing.assert_close(w["loss"], losses["mse"] / 4 + losses["vb"])  # vb is not divided
    torch.testing.assert_close(w["u"], torch.full((6,), math.log(4.0)))
    # The frequencies come from the seed alone (not the global RNG), and a table of them is exported.
    again = LearnedLossWeight(diff.alphas_cumprod.numpy(), seed=3)
    assert torch.equal(again.freqs, weight.freqs) and not torch.equal(LearnedLossWeight(
        diff.alphas_cumprod.numpy(), seed=4).freqs, weight.freqs)
    assert set(weight.export()) == {"weight", "bias", "freqs", "phases", "logsnr", "u"}


@pytest.mark.parametrize("diffusion, message", [
    ({"loss_weighting": "learned", "loss": "kl", "variance": "learned_range"},
     "diffusion.loss_weighting: 'learned' weights the MSE term, which loss 'kl' has not"),
    ({"loss_weighting": "learned", "min_snr_gamma": 5}, "diffusion.min_snr_gamma: only read with loss_weighting: min_snr"),
    ({"loss_weighting": "learned", "p2_k": 1}, "diffusion.p2_k: only read with loss_weighting: p2 (it is learned)"),
    ({"loss_weighting": "Learned"}, "diffusion.loss_weighting: 'Learned' is not one of none | min_snr | p2 | learned"),
])
def test_check_params_refuses_bad_learned_weightings_with_one_line_and_writes_nothing(tmp_path, diffusion, message):
    from test_check_params import check

    proc = check(tmp_path, yaml.safe_dump({"diffusion": diffusion}))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(f"Error: params.yaml: {message}")
    assert not (tmp_path / "resolved").exists()


@pytest.mark.slow
def test_the_learned_weighting_resumes_bitwise_and_is_averaged_over_ranks(tmp_path, prepared):
    """2 processes: SIGKILLed after the step-4 checkpoint and resumed == uninterrupted, bit for bit
    (u's weights and AdamW state in the checkpoint, the exported model directory); and u after 8
    steps is that of 1 process with the double batch (its gradient all-reduced as DDP does the
    model's; float tolerance, as test_train's 2 x B = 1 x 2B)."""
    from ddpmrepro.files import load_weights
    from ddpmrepro.training.checkpoint import latest_checkpoint, load_checkpoint
    from test_train import assert_same, final_state, kill_after_checkpoint, run_train, write_params

    learned = {"loss_weighting": "learned", "variance": "learned_range", "loss": "hybrid", "timesteps": 10}
    two = write_params(tmp_path / "two.yaml", diffusion=learned, train={"nproc": 2, "batch_per_proc": 8})
    one = write_params(tmp_path / "one.yaml", diffusion=learned, train={"nproc": 1, "batch_per_proc": 16})
    run_train(tmp_path / "straight", prepared, two, 2)
    kill_after_checkpoint(tmp_path / "resumed", prepared, two, 2, step=4)
    run_train(tmp_path / "resumed", prepared, two, 2)
    run_train(tmp_path / "one", prepared, one, 1)

    def state(run):
        (ckpt_dir,) = (run / "ckpt").glob("*/*")
        return load_checkpoint(latest_checkpoint(ckpt_dir))

    a, b = state(tmp_path / "straight"), state(tmp_path / "resumed")
    assert a["step"] == b["step"] == 8
    for k, v in a["loss_weight"].items():
        assert torch.equal(v, b["loss_weight"][k]), k
    groups = a["optimizer"]["param_groups"]
    assert len(groups) == 2 and groups[1]["weight_decay"] == 0.0  # u's own group, no decay
    for i in groups[1]["params"]:
        for k, v in a["optimizer"]["state"][i].items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), (i, k)
    assert_same(final_state(tmp_path / "straight"), final_state(tmp_path / "resumed"), exact=True)

    def files(model):
        return {f.relative_to(model).as_posix(): f.read_bytes() for f in sorted(model.rglob("*")) if f.is_file()}
    assert files(tmp_path / "straight" / "model") == files(tmp_path / "resumed" / "model")
    u2 = load_weights(tmp_path / "straight" / "model" / "loss_weight.safetensors")["u"]
    u1 = load_weights(tmp_path / "one" / "model" / "loss_weight.safetensors")["u"]
    assert u1.abs().max() > 1e-3  # it moved
    torch.testing.assert_close(u2, u1, rtol=1e-3, atol=5e-4)
