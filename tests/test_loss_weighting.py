"""Loss weighting (diffusion.loss_weighting) against the papers' closed forms and invariants.

The weights are checked at every t against SNR_t written out from the betas (never against the
code's own tables); the x0 forms against the eps forms through the predictions they imply; the
importance sampler's composition as an exact sum over t; `none` bitwise against L_simple.
"""
from __future__ import annotations

import json
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
    ({"loss_weighting": "snr"}, "diffusion.loss_weighting: 'snr' is not one of none | min_snr | p2"),
]


@pytest.mark.parametrize("diffusion, message", BAD)
def test_bad_weighting_keys_exit_2_with_one_line_naming_the_key_and_write_nothing(tmp_path, monkeypatch, diffusion,
                                                                                  message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"diffusion": diffusion}))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("earlier")
    result = CliRunner().invoke(main, ["train", "--params", "params.yaml", "--data", "data", "--out", "model",
                                       "--live", "live", "--introspect", "introspect", "--checkpoints", "ckpt"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: params.yaml: {message}"), result.stderr
    assert result.stdout == ""
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["model", "model/config.json", "params.yaml"]
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
], ids=["min_snr", "p2-x0-hybrid"])
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
    assert resolved["min_snr_gamma" if diffusion["loss_weighting"] == "min_snr" else "p2_k"] is not None
    final = config["final"]
    assert np.isfinite(final["loss"]) and final["loss"] > 0
    if diffusion["loss_weighting"] == "min_snr":  # eps: w_t = min(1, 5 / SNR_t) < 1 at the first steps of T=10
        assert final["loss"] < final["mse"]
