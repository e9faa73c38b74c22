"""Min-SNR's convergence claim on the bundled data: quality against training steps, over seeds, and
the steps each weighting needs to reach a fixed class accuracy or FID (issue 32, item 5).

    PYTHONPATH=src python benchmarks/convergence.py --workdir /tmp/convergence [--seeds 0 1 2] [--steps 400]
    PYTHONPATH=src python benchmarks/convergence.py --workdir /tmp/convergence --summarise

Hang et al. 2023 ("Efficient Diffusion Training via Min-SNR Weighting Strategy") report 3.4x faster
convergence on ImageNet 256 from their FID-against-iterations curves, at a constant learning rate.
Here, the same through `dvc exp run` alone, in a git + DVC repo of the pipeline (the default params,
digits, eps prediction, fixed variances, uniform timesteps, 2 microbatches of 64 as in
benchmarks/gradient_study.py), with:

- a constant learning rate after the warmup (`train.anneal: none`): with the default linear anneal
  a point mid-run would be a model still at a high rate, not one "trained for that many steps";
- one training run per (weighting, seed), and its quality after every `--every` steps from the
  post-hoc EMA of length 0.1 as it stood then (`sample.ema_step`, docs/POSTHOC_EMA.md): one
  `dvc exp run -S sample.ema_step=S` per point, which samples and evaluates and never trains. The
  same EMA length at every point (relative to the steps so far), so the points are comparable;
- the evaluator's class accuracy and FID (500 images; no bits/dim: `evaluate.bpd_images: 0`).

Steps to a threshold: the first evaluated step at which a run reaches it (a run that never does
counts as "> steps"). The thresholds are set in the summary from what `none` reaches by its end.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gradient_study import BASE, CONFIGS, make_repo, sh, study_env  # noqa: E402
from results_io import write_result  # noqa: E402

EMA_LENGTH = 0.1  # one of train.posthoc_ema's tracked lengths: its snapshots are exact, no fit error
ACC_THRESHOLDS = (0.80, 0.90, 0.93)
FID_THRESHOLDS = (4.0, 3.0, 2.5)


def weightings(gamma: float, method: str = "min_snr") -> tuple[str, str]:
    """The two runs compared: the reference first, then `method` (--method): Min-SNR at `gamma`
    (--gamma), EDM2's learned weighting, or the timestep sampler from the gradients."""
    return ("mse_none", f"mse_min_snr{gamma:g}" if method == "min_snr" else f"mse_{method.replace('-', '_')}")


WEIGHTINGS = weightings(5.0)
# What a run of another method may set, put back for every run (`dvc exp run` keeps the last run's params).
RESET = {"introspect.every": 0, "introspect.noise_levels_every": 250, "introspect.noise_buckets": "null"}
EXTRA = {  # the methods of issue 39
    "mse_learned": {"diffusion.loss_weighting": "learned", "train.timestep_sampler": "uniform"},
    # grad-norm learns from the noise-level buckets: 8 of them (4 are no better than IDDPM's sampler at one
    # model, docs/INTROSPECTION.md), measured every 10 steps
    "mse_grad_norm": {"diffusion.loss_weighting": "none", "train.timestep_sampler": "grad-norm",
                      "introspect.every": 10, "introspect.noise_levels_every": 1, "introspect.noise_buckets": 8},
}


def config(name: str) -> dict:
    """The -S overrides of a weighting: this study's own first (issue 39's methods as its runs were
    made; gradient_study.py has runs of the same names with its own instruments), Min-SNR at another
    γ, then gradient_study's."""
    if name in EXTRA:
        return EXTRA[name]
    if name.startswith("mse_min_snr") and name not in ("mse_min_snr5",):
        return {"diffusion.loss_weighting": "min_snr", "diffusion.min_snr_gamma": float(name.removeprefix("mse_min_snr")),
                "train.timestep_sampler": "uniform"}
    return CONFIGS[name]


def command(a) -> str:
    return (f"PYTHONPATH=src python benchmarks/convergence.py --workdir DIR --steps {a.steps} --every {a.every} "
            f"--seeds {' '.join(map(str, a.seeds))}" + (f" --anneal {a.anneal}" if a.anneal != "none" else "")
            + (f" --gamma {a.gamma:g}" if a.gamma != 5 else "") + (f" --method {a.method}" if a.method != "min_snr" else ""))


def steps_to(curve: list[tuple[int, dict]], key: str, threshold: float, higher_is_better: bool):
    for step, m in curve:
        v = m.get(key)
        if v is not None and (v >= threshold if higher_is_better else v <= threshold):
            return step
    return None


def summary(runs: dict, steps: int, names: tuple[str, str] = WEIGHTINGS) -> dict:
    """Per weighting and threshold: the steps of each seed, and the ratio none / min_snr per seed
    (paired: the same seed's data order and initial weights)."""
    none, min_snr = names
    out = {}
    for key, thresholds, higher in (("class_acc", ACC_THRESHOLDS, True), ("fid", FID_THRESHOLDS, False)):
        for th in thresholds:
            row = {}
            for w in names:
                row[w] = {r["seed"]: steps_to(r["curve"], key, th, higher) for r in runs.values() if r["config"] == w}
            ratios = [row[none][s] / row[min_snr][s] for s in row[none] if row[none][s] and row[min_snr].get(s)]
            out[f"{key} {'>=' if higher else '<='} {th:g}"] = {
                **{w: {str(s): v for s, v in row[w].items()} for w in names},
                "ratio_none_over_min_snr": ratios}
    return out


def crossing(curve: list, key: str, threshold: float, higher: bool) -> float | None:
    """Where the curve crosses the threshold, between the two evaluated steps around it: linear in
    the step, of the metric (class accuracy) or of its logarithm (FID, which falls about
    exponentially here). An estimate finer than the `--every` grid; None if it never does."""
    import math

    f = (lambda v: v) if higher else (lambda v: -math.log(v))
    goal = f(threshold)
    prev = None
    for step, m in curve:
        v = f(m[key])
        if v >= goal:
            if prev is None or prev[1] >= goal:
                return float(step)
            (s0, v0) = prev
            return s0 + (goal - v0) / (v - v0) * (step - s0)
        prev = (step, v)
    return None


def interpolated(runs: dict, names: tuple[str, str] = WEIGHTINGS) -> dict:
    """Per threshold: each weighting's interpolated crossing per seed, and the paired ratios
    (the second weighting's steps over the first's: below 1 is sooner)."""
    first, second = names
    out = {}
    for key, thresholds, higher in (("class_acc", ACC_THRESHOLDS, True), ("fid", FID_THRESHOLDS, False)):
        for th in thresholds:
            row = {w: {r["seed"]: crossing(r["curve"], key, th, higher) for r in runs.values() if r["config"] == w}
                   for w in names}
            out[f"{key} {'>=' if higher else '<='} {th:g}"] = {
                **{w: {str(s): v for s, v in row[w].items()} for w in names},
                "ratio_second_over_first": [row[second][s] / row[first][s] for s in row[first]
                                            if row[first][s] and row[second].get(s)]}
    return out


def table(runs: dict, steps: int, names: tuple[str, str] = WEIGHTINGS) -> str:
    none, min_snr = names
    lines = [f"| threshold | steps, none (per seed) | steps, {min_snr} (per seed) | none / {min_snr} (per seed) |",
             "|---|---|---|---|"]
    fmt = lambda v: str(v) if v is not None else f">{steps}"
    for name, row in summary(runs, steps, names).items():
        ratios = ", ".join(f"{r:.2f}" for r in row["ratio_none_over_min_snr"]) or "–"
        lines.append(f"| {name} | {', '.join(fmt(v) for v in row[none].values())} | "
                     f"{', '.join(fmt(v) for v in row[min_snr].values())} | {ratios} |")
    lines += ["", "| step | " + " | ".join(f"{w} acc" for w in names) + " | "
              + " | ".join(f"{w} FID" for w in names) + " |", "|---|" + "---|" * 4]
    points = sorted({st for r in runs.values() for st, _ in r["curve"]})
    for st in points:
        cells = []
        for key, fmt_v in (("class_acc", "{:.3f}"), ("fid", "{:.2f}")):
            for w in names:
                vals = [m[key] for r in runs.values() if r["config"] == w for s, m in r["curve"] if s == st]
                cells.append(f"{fmt_v.format(statistics.fmean(vals))} ({fmt_v.format(min(vals))}..{fmt_v.format(max(vals))})"
                             if vals else "–")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict, path: Path, names: tuple[str, str] = WEIGHTINGS) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    colors = {w: f"C{i}" for i, w in enumerate(names)}
    for r in runs.values():
        xs = [s for s, _ in r["curve"]]
        for ax, key in zip(axes, ("class_acc", "fid")):
            ax.plot(xs, [m[key] for _, m in r["curve"]], color=colors[r["config"]], lw=1, marker="o", ms=3,
                    label=r["config"] if r["seed"] == min(x["seed"] for x in runs.values()) else None)
    axes[0].set_title("evaluator class accuracy (500 samples)")
    axes[1].set_title("evaluator FID (500 samples)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("training step (post-hoc EMA 0.1 as of then)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50, help="evaluate after every this many steps")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/convergence.json")
    ap.add_argument("--anneal", default="none", choices=("none", "linear"),
                    help="train.anneal: with a decay, a point before the end is a model still at a high rate, "
                         "so compare the last points (--every = --steps evaluates only the end)")
    ap.add_argument("--gamma", type=float, default=5.0, help="Min-SNR's γ (diffusion.min_snr_gamma)")
    ap.add_argument("--method", default="min_snr", choices=("min_snr", "learned", "grad-norm"),
                    help="what is compared with none: Min-SNR at --gamma, diffusion.loss_weighting: learned, or "
                         "train.timestep_sampler: grad-norm")
    ap.add_argument("--resume", action="store_true",
                    help="skip a (weighting, seed) whose curve is kept in WORKDIR/runs already")
    ap.add_argument("--summarise", action="store_true", help="only the tables and picture of the runs kept")
    a = ap.parse_args()
    if a.steps % a.every:
        sys.exit("--steps must be a multiple of --every (the snapshot steps)")
    keep = a.workdir / "runs"
    names = weightings(a.gamma, a.method)
    if not a.summarise:
        env = study_env(a.workdir)
        repo = make_repo(a.workdir, a.steps, env, extra={
            # fp32 snapshots: the studies before the fp16 default were made so; every point is then comparable
            "train": {"anneal": a.anneal, "posthoc_ema": [0.05, EMA_LENGTH], "posthoc_ema_snapshots": a.steps // a.every,
                      "posthoc_ema_dtype": "fp32"},
            # no gradient tables: the noise scale comes from the microbatches (grad-norm's runs record some)
            "introspect": {"every": 0, "noise_levels_every": 250, "noise_buckets": None},
            "evaluate": {"bpd_images": 0}})
        points = list(range(a.every, a.steps + 1, a.every))
        for seed in a.seeds:  # seeds outermost: a run cut short still has both weightings of the first seeds
            for name in names:
                run = keep / f"{name}-s{seed}"
                if a.resume and (run / "curve.json").exists():
                    continue
                t0, curve = time.perf_counter(), []
                base = {**BASE, **RESET, **config(name), "train.seed": seed, "sample.ema_length": EMA_LENGTH}
                for step in points[::-1]:  # the last first: that run trains, the others only sample
                    sets = {**base, "sample.ema_step": 0 if step == a.steps else step}
                    sh(repo, "dvc", "exp", "run", "-n", f"{name}-s{seed}-at{step}",
                       *[x for k, v in sets.items() for x in ("-S", f"{k}={v}")], env=env)
                    metrics = json.loads((repo / "metrics.json").read_text())
                    curve.append((step, {k: metrics.get(k) for k in ("class_acc", "fid", "precision", "recall")}))
                    print(f"{name:14} seed {seed} step {step:5}: acc {metrics.get('class_acc')}  "
                          f"fid {metrics.get('fid'):.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
                shutil.rmtree(run, ignore_errors=True)
                run.mkdir(parents=True)
                (run / "curve.json").write_text(json.dumps({"config": name, "seed": seed, "curve": curve[::-1],
                                                            "wall_s": time.perf_counter() - t0}, indent=1))
    runs = {}
    for d in sorted(keep.iterdir()):
        r = json.loads((d / "curve.json").read_text())
        if r["config"] in names:
            runs[d.name] = {**r, "curve": [tuple(x) for x in r["curve"]]}
    write_result({"command": command(a), "steps": a.steps, "every": a.every, "anneal": a.anneal, "ema_length": EMA_LENGTH,
                  "gamma": a.gamma, "runs_kept": sorted(runs), "summary": summary(runs, a.steps, names),
                  "interpolated": interpolated(runs, names), "runs": runs},
                 a.out)
    plot(runs, a.out.with_suffix(".png"), names)
    print(table(runs, a.steps, names))


if __name__ == "__main__":
    main()
