"""How much each timestep sampler lowers the noise of the gradient, at one and the same model.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampler_variance.py --seeds 0 1 2

An importance sampler draws t with probability p_t and weighs the example by w_t = 1/(T p_t): the
estimate w_t ∇L_t(x) of the uniform-t gradient is unbiased whatever p, and its per-example
covariance has trace

    tr(Σ_p) = sum_t p_t w_t² E‖∇L_t‖² - ‖E ∇L‖² = (1/T²) sum_t E‖∇L_t‖² / p_t - ‖G‖²,

least at p_t ∝ sqrt(E‖∇L_t‖²). IDDPM's sampler uses p_t ∝ sqrt(E[L_t²]) instead (the losses it
sees for free); `grad-norm` (training/timestep_sampler.py) p_t ∝ sqrt(E‖∇L_t‖²) per noise-level
bucket, as the introspection's buckets measure it. This measures tr(Σ_p) of each at a fixed model,
so at the same loss, from per-example gradients (torch.func: vmap of grad, exact):

1. train the default `tiny` UNet on the digits for `--steps` steps (seed s: weights and data order);
2. at `--levels` evenly spaced t, draw `--examples` (image, noise) pairs per level (seed s) and take
   each one's loss and full parameter gradient;
3. estimate each sampler's p from the first half of the examples (what a sampler learns), and
   tr(Σ_p) from the second half (so that no p is fitted to the very draws that judge it), over the
   level grid as the support (uniform: 1/levels each); |G|² as the inner product of the two halves'
   mean gradients (unbiased, where one mean's square is not).

Samplers: uniform; loss-second-moment (p ∝ sqrt(mean L²) per level, IDDPM's with a full history);
the bucket means alone (p ∝ sqrt(E‖∇L‖²) constant over each bucket: the first `grad-norm`, before
issue 39's second round), with the buckets of the default introspection (4 equal ranges of t) and
with 8; grad-norm as it is now, p ∝ sqrt(r_b E[L_t²]) with r_b each bucket's ratio of the
gradient's second moment to the loss's (4 and 8 buckets); per level (one bucket per level: the
optimum of the formula up to estimation noise); and output-grad-norm per level, p ∝ sqrt(E‖∇L_t‖²)
of the output layer's parameters alone (the last convolution: what that sampler measures per
example on every step). Each with the 0.1% uniform share the samplers mix in.
Writes benchmarks/results/sampler_variance.json: per seed, tr(Σ) of each sampler and its ratio to
uniform's, and |G|² (the same for all: unbiased).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

import ddpmrepro.training.loop as T
from ddpmrepro import params as P
from ddpmrepro.data import load_prepared, prepare, to_model_range
from ddpmrepro.files import load_weights
from ddpmrepro.model.diffusion import from_params as diffusion_from_params
from ddpmrepro.model.unet import build_unet
from ddpmrepro.training.noise_buckets import bucket_table

from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path

UNIFORM_SHARE = 0.001
OUTPUT_LAYER = "out.2."  # the UNet's last convolution (weight and bias): what `output-grad-norm` measures
BUCKETS = (4, 8)  # the introspection's default, and more (each needs a level of the grid: levels >= 2 x count)


def mixed(w: np.ndarray) -> np.ndarray:
    """w normalised, then 0.1% uniform mixed in (as the samplers do)."""
    p = w / w.sum()
    return p * (1 - UNIFORM_SHARE) + UNIFORM_SHARE / len(p)


def trace_of(p: np.ndarray, second: np.ndarray, g_sq: float) -> float:
    """tr(Σ_p) over the level grid: (1/K²) sum_k m_k / p_k - |G|²."""
    K = len(p)
    return float(np.sum(second / p) / K ** 2 - g_sq)


def per_example(model, diffusion, x0, y, t, noise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses (B,), flat gradients (B, P), the output layer's squared gradient norms (B,)) of each
    example alone."""
    names = [n for n, q in model.named_parameters()]
    params = {n: q.detach() for n, q in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}

    def loss_of(ps, x, yy, tt, nn):
        fn = lambda xt, ts: functional_call(model, (ps, buffers), (xt, ts, yy[None]))  # noqa: E731
        return diffusion.training_losses(fn, x[None], tt[None], noise=nn[None])["loss"][0]

    grads = vmap(grad(loss_of), in_dims=(None, 0, 0, 0, 0))(params, x0, y, t, noise)
    losses = vmap(loss_of, in_dims=(None, 0, 0, 0, 0))(params, x0, y, t, noise)
    out_sq = sum(grads[n].double().square().flatten(1).sum(1) for n in names if n.startswith(OUTPUT_LAYER))
    return losses.detach(), torch.cat([grads[n].reshape(len(x0), -1) for n in names], 1), out_sq


def measure(seed: int, a, tmp: Path) -> dict:
    data_dir = tmp / "data"
    params = P.from_dict({"train": {"seed": seed, "steps": a.steps, "checkpoint_every": a.steps,
                                    "log_every": a.steps, "posthoc_ema_snapshots": 1},
                          "introspect": {"every": 0, "steps": []}})
    run = tmp / f"run{seed}"
    T.train(params, T.TrainPaths(data_dir, run / "model", run / "live", run / "introspect", run / "ckpt"))
    data = load_prepared(data_dir)
    model = build_unet(params.model, image_size=8, in_channels=1, num_classes=data.num_classes, learn_sigma=False)
    model.load_state_dict(load_weights(run / "model" / "model.safetensors"))
    model.eval()  # dropout off: the gradient of the deterministic loss (tiny has no dropout anyway)
    diffusion = diffusion_from_params(params.diffusion)
    Tn = diffusion.num_timesteps
    levels = np.linspace(0, Tn - 1, a.levels).round().astype(np.int64)
    g = torch.Generator().manual_seed(10_000 + seed)
    images = torch.as_tensor(np.asarray(data.train_images))
    labels = torch.as_tensor(data.train_labels)
    halves = {h: {"second": [], "loss_sq": [], "out_second": [], "grad": 0} for h in ("fit", "judge")}
    for t in levels:
        idx = torch.randint(len(images), (a.examples,), generator=g)
        x0 = to_model_range(images[idx])
        noise = torch.randn(x0.shape, generator=g)
        losses, grads, out_sq = per_example(model, diffusion, x0, labels[idx], torch.full((a.examples,), int(t)), noise)
        sq = grads.double().square().sum(1)
        for h, part in (("fit", slice(0, a.examples // 2)), ("judge", slice(a.examples // 2, None))):
            halves[h]["second"].append(float(sq[part].mean()))
            halves[h]["loss_sq"].append(float(losses[part].double().square().mean()))
            halves[h]["out_second"].append(float(out_sq[part].mean()))
            halves[h]["grad"] = halves[h]["grad"] + grads[part].double().mean(0) / len(levels)
    second = np.array(halves["judge"]["second"])
    # |G|² without the tr(Σ)/n bias of one mean's square: the inner product of two independent means.
    g_sq = float(halves["fit"]["grad"] @ halves["judge"]["grad"])
    fit = {k: np.array(halves["fit"][k]) for k in ("second", "loss_sq", "out_second")}
    samplers = {"uniform": np.full(len(levels), 1.0 / len(levels)),
                "loss-second-moment": mixed(np.sqrt(fit["loss_sq"]))}
    for count in BUCKETS:  # one mean per bucket of equal t range, as the introspection's
        which, _ = bucket_table(np.asarray(diffusion.alphas_cumprod, dtype=np.float64), count=count, edges=[],
                                space="t")
        bucket = which[levels]
        per_bucket = np.array([fit["second"][bucket == b].mean() for b in range(count)])
        samplers[f"bucket means ({count})"] = mixed(np.sqrt(per_bucket[bucket]))
        # grad-norm (timestep_sampler.py): E‖∇L_t‖² = r_b E[L_t²], r_b each bucket's gradient-to-loss ratio
        ratio = np.array([fit["second"][bucket == b].mean() / fit["loss_sq"][bucket == b].mean()
                          for b in range(count)])
        samplers[f"grad-norm ({count} buckets)"] = mixed(np.sqrt(ratio[bucket] * fit["loss_sq"]))
    samplers["per level (the optimum)"] = mixed(np.sqrt(fit["second"]))
    # the output layer's gradient alone, per level: what `output-grad-norm` measures on every step
    samplers["output-grad-norm (per level)"] = mixed(np.sqrt(fit["out_second"]))
    traces = {name: trace_of(p, second, g_sq) for name, p in samplers.items()}
    return {"seed": seed, "g_sq": g_sq, "trace": traces,
            "ratio_to_uniform": {n: v / traces["uniform"] for n, v in traces.items()},
            "levels": levels.tolist(), "second_moment_judge": second.tolist(),
            "loss_sq_fit": fit["loss_sq"].tolist(), "second_moment_fit": fit["second"].tolist(),
            "output_second_moment_fit": fit["out_second"].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=400, help="training steps before measuring")
    ap.add_argument("--levels", type=int, default=40)
    ap.add_argument("--examples", type=int, default=32, help="per level (half fit p, half judge it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sampler_variance.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    runs = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepare(P.DataParams(), tmp / "data")
        for seed in a.seeds:
            runs.append(measure(seed, a, tmp))
            r = runs[-1]
            print(f"seed {seed}: |G|² {r['g_sq']:.4g}; tr(Σ) " + ", ".join(
                f"{n} {v:.4g} ({r['ratio_to_uniform'][n]:.3f}x)" for n, v in r["trace"].items()), flush=True)
    names = list(runs[0]["trace"])
    summary = {n: {"median": statistics.median(r["ratio_to_uniform"][n] for r in runs),
                   "min": min(r["ratio_to_uniform"][n] for r in runs),
                   "max": max(r["ratio_to_uniform"][n] for r in runs)} for n in names}
    for n, s in summary.items():
        print(f"{n:24} tr(Σ) / uniform's: {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}] over {len(runs)} seeds")
    write_result({"command": command_line("sampler_variance.py", a), "machine": platform.machine(),
                  "torch": torch.__version__, "ratio_to_uniform": summary, "runs": runs}, a.out)


if __name__ == "__main__":
    main()
