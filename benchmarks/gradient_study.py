"""IDDPM's finding about gradient noise, and Min-SNR's convergence claim, on the bundled data,
through `dvc exp run` alone (issue 32, item 5).

    PYTHONPATH=src python benchmarks/gradient_study.py --workdir /tmp/gradient-study [--seeds 0 1] [--steps 800]

Builds a git + DVC repo of the pipeline (the default params, so digits) and runs one `dvc exp run`
per (configuration, seed). Every run uses the default global batch of 128 as 2 microbatches of 64,
so the gradient noise scale is measured on every step (docs/INTROSPECTION.md):

- IDDPM (Nichol & Dhariwal 2021, sec. 3.3): learned variances, L_vb (`diffusion.loss: kl`) with
  uniform timesteps, L_vb with their loss-second-moment importance sampling, and L_hybrid (uniform).
  They found L_vb's gradient far noisier than L_hybrid's, and importance sampling to reduce it.
- Min-SNR (Hang et al. 2023): `diffusion.loss_weighting: min_snr` (gamma 5) against `none`, eps
  prediction, fixed variances: the evaluator's metrics after the same number of steps.
- The ways of balancing the noise levels (issue 39), each on `none`'s eps MSE: Min-SNR gamma 20,
  EDM2's learned weighting, IDDPM's loss-second-moment sampler, and the gradient-norm sampler,
  which learns from the noise-level buckets (measured every 10 steps in its runs).

Every run measures 8 noise-level buckets every 50 steps, so each bucket's share of the update over
training is drawn per configuration (gradient_study-shares.png).

After each run it keeps the run's dvclive curves and metrics.json, then writes
benchmarks/results/gradient_study.json (per run: the noise scale averaged over the second half of
training, the last logged vb/mse, the final metrics, the buckets' shares) and gradient_study.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from project_copy import copy_project  # noqa: E402
from results_io import write_result  # noqa: E402

# Every key any configuration sets, at its default: each run sets all of them, because `dvc exp run`
# leaves the last experiment's params in the workspace, and a key a configuration left out would
# silently keep the previous run's value (the first version of this script ran "mse_none" as hybrid).
BASE = {"diffusion.variance": "fixed_small", "diffusion.loss": "mse", "diffusion.loss_weighting": "none",
        "diffusion.min_snr_gamma": "null", "train.timestep_sampler": "uniform",
        # The noise-level buckets every 50 steps, 8 of them, in every run: each bucket's share of the
        # update over training, per method (gradient_study-shares.png).
        "introspect.every": 25, "introspect.noise_levels_every": 50, "introspect.noise_buckets": 8}
LEARNED = {"diffusion.variance": "learned_range"}
CONFIGS = {  # name: the -S overrides of the run
    "vb_uniform": {**LEARNED, "diffusion.loss": "kl", "train.timestep_sampler": "uniform"},
    "vb_importance": {**LEARNED, "diffusion.loss": "kl", "train.timestep_sampler": "loss-second-moment"},
    "hybrid_uniform": {**LEARNED, "diffusion.loss": "hybrid", "train.timestep_sampler": "uniform"},
    "mse_none": {"diffusion.loss_weighting": "none", "train.timestep_sampler": "uniform"},
    "mse_min_snr5": {"diffusion.loss_weighting": "min_snr", "train.timestep_sampler": "uniform"},
    # Issue 39: the ways of balancing the noise levels, each on `none`'s eps MSE.
    "mse_min_snr20": {"diffusion.loss_weighting": "min_snr", "diffusion.min_snr_gamma": 20},
    "mse_learned": {"diffusion.loss_weighting": "learned"},
    "mse_loss_moment": {"train.timestep_sampler": "loss-second-moment"},
    # the gradient sampler learns from the buckets: measured every 10 steps (as in convergence.py)
    "mse_grad_norm": {"train.timestep_sampler": "grad-norm", "introspect.every": 10,
                      "introspect.noise_levels_every": 10},
    # the output layer's per-example gradient norms, per t on every step (issue 39's second route)
    "mse_output_grad_norm": {"train.timestep_sampler": "output-grad-norm"},
}


def _command(a) -> str:
    return (f"PYTHONPATH=src python benchmarks/gradient_study.py --workdir DIR --steps {a.steps} "
            f"--seeds {' '.join(map(str, a.seeds))} --configs {' '.join(a.configs)}")


def sh(repo: Path, *cmd: str, env: dict) -> str:
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def study_env(workdir: Path) -> dict:
    """The environment of the study's `dvc exp run`s: this Python's tools first, the CPU slots
    (which the pipeline's stages take) counted in the study's own lock directory, or in
    $DDPMREPRO_CPU_LOCK_DIR where it is set."""
    env = {k: v for k, v in os.environ.items() if k != "DDPMREPRO_CPU_SLOTS"}
    # Two studies side by side share one lock directory (set it), each with OMP_NUM_THREADS=1: with
    # a directory each, both took both cores at 2 threads and ran several times slower.
    env.update(PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"], DVC_NO_ANALYTICS="1",
               DDPMREPRO_CPU_LOCK_DIR=os.environ.get("DDPMREPRO_CPU_LOCK_DIR", str(workdir / "cpu-locks")))
    return env


def make_repo(workdir: Path, steps: int, env: dict, extra: dict | None = None) -> Path:
    """The study's git + DVC repo: the default params at `steps` steps as 2 microbatches of 64, and
    `extra` ({section: {key: value}}) on top."""
    repo = workdir / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    copy_project(repo)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"].update(steps=steps, batch_per_proc=64, grad_accum=2)
    # BASE sets these in every run: `-S` only sets keys that exist
    params["diffusion"].setdefault("min_snr_gamma", None)
    params["introspect"].update(noise_levels_every=50, noise_buckets=8)
    for section, values in (extra or {}).items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q", "-b", "main"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "study params"]):
        sh(repo, *cmd, env=env)
    return repo


def series(live: Path, name: str) -> list[tuple[int, float]]:
    f = live / "plots" / "metrics" / f"{name}.tsv"
    if not f.exists():
        return []
    lines = f.read_text().splitlines()
    header = lines[0].split("\t")
    i_step, i_value = header.index("step"), header.index(name)
    rows = [ln.split("\t") for ln in lines[1:] if ln]
    return [(int(r[i_step]), float(r[i_value])) for r in rows]


def summarise(run_dir: Path, steps: int) -> dict:
    live = run_dir / "live"
    out = {"metrics": json.loads((run_dir / "metrics.json").read_text())}
    for name in ("gns_b_simple", "gns_g2", "gns_trace", "vb", "mse", "loss"):
        s = series(live, name)
        out[f"{name}_curve"] = s
        late = [v for st, v in s if st > steps // 2 and math.isfinite(v)]
        out[f"{name}_late_mean"] = statistics.fmean(late) if late else math.nan
    # B_simple from the late averages of both terms (the smoothed value at the end is another view)
    g2, tr = out["gns_g2_late_mean"], out["gns_trace_late_mean"]
    out["b_simple_late"] = tr / g2 if g2 > 0 else math.nan
    out["shares"] = sh = bucket_shares(run_dir / "noise_levels")
    # the second half's mean share of the least noisy bucket, and of the buckets of the noisier half
    late = [i for i, st in enumerate(sh.get("steps", [])) if st > steps // 2]
    top = max((hi for _, hi in sh.get("edges", [])), default=0)
    noisy = [b for b, (lo, _) in enumerate(sh.get("edges", [])) if lo >= top / 2]
    out["share_least_noisy_late"] = statistics.fmean(sh["share"][i][0] for i in late) if late else math.nan
    out["share_noisier_half_late"] = (statistics.fmean(sum(sh["share"][i][b] for b in noisy) for i in late)
                                      if late and noisy else math.nan)
    return out


def bucket_shares(table: Path) -> dict:
    """Each noise-level bucket's share of the update <G_b, G>/|G|² on the measured steps:
    {"edges": [[lo, hi] per bucket], "steps": [...], "share": [[per bucket] per step]}; {} if none."""
    if not table.exists():
        return {}
    import pandas as pd

    df = pd.read_parquet(table).sort_values(["step", "bucket"])
    wide = df.pivot(index="step", columns="bucket", values="share").sort_index()
    edges = df.drop_duplicates("bucket").sort_values("bucket")[["lo", "hi"]].values.tolist()
    return {"space": str(df["space"].iloc[0]), "edges": edges, "steps": [int(s) for s in wide.index],
            "share": wide.values.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gradient_study.json")
    ap.add_argument("--summarise", action="store_true", help="only the table and the picture of the runs kept in "
                    "--workdir/runs so far (no training)")
    a = ap.parse_args()
    if a.summarise:
        order = list(CONFIGS)  # the table's and the figures' order: the configurations as listed above
        dirs = sorted((a.workdir / "runs").iterdir(), key=lambda d: (order.index(d.name.rsplit("-s", 1)[0]),
                                                                      int(d.name.rsplit("-s", 1)[1])))
        runs = {d.name: {"config": d.name.rsplit("-s", 1)[0], "seed": int(d.name.rsplit("-s", 1)[1]),
                         **summarise(d, a.steps)} for d in dirs}
        write_result({"command": _command(a) + " (then --summarise of the runs kept: " + ", ".join(runs) + ")",
                      "steps": a.steps, "seeds": a.seeds, "configs": CONFIGS,
                      "paired_trace_ratio": paired_ratios(runs), "runs": runs}, a.out)
        plot(runs, a.out.with_suffix(".png"))
        print(table(runs))
        print(paired_text(paired_ratios(runs)))
        return
    env = study_env(a.workdir)
    repo = make_repo(a.workdir, a.steps, env)
    runs = {}
    # seed by seed, so that a study stopped early has every configuration at the same seeds
    for seed in a.seeds:
        for name in a.configs:
            t0 = time.perf_counter()
            sets = [f"{k}={v}" for k, v in {**BASE, **CONFIGS[name], "train.seed": seed}.items()]
            sh(repo, "dvc", "exp", "run", "-n", f"{name}-s{seed}", *[x for s in sets for x in ("-S", s)], env=env)
            keep = a.workdir / "runs" / f"{name}-s{seed}"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(repo / "reports" / "train" / "live", keep / "live")
            shutil.copy2(repo / "metrics.json", keep / "metrics.json")
            if (repo / "reports" / "introspect" / "noise_levels").exists():
                shutil.copytree(repo / "reports" / "introspect" / "noise_levels", keep / "noise_levels")
            runs[f"{name}-s{seed}"] = {"config": name, "seed": seed, "wall_s": time.perf_counter() - t0,
                                       **summarise(keep, a.steps)}
            r = runs[f"{name}-s{seed}"]
            print(f"{name:16} seed {seed}: B_simple(late) {r['b_simple_late']:9.1f}  vb {r['vb_late_mean']:.4f}  "
                  f"mse {r['mse_late_mean']:.4f}  fid {r['metrics'].get('fid', math.nan):.3f}  "
                  f"acc {r['metrics'].get('class_acc', math.nan)}  ({r['wall_s']:.0f} s)", flush=True)
    write_result({"command": _command(a), "steps": a.steps, "seeds": a.seeds, "configs": CONFIGS,
                  "paired_trace_ratio": paired_ratios(runs), "runs": runs}, a.out)
    plot(runs, a.out.with_suffix(".png"))
    print(table(runs))
    print(paired_text(paired_ratios(runs)))


def table(runs: dict) -> str:
    """The markdown table of docs/INTROSPECTION.md: per configuration, the mean over seeds and the
    spread (min..max) of each number."""
    cols = [("b_simple_late", "B_simple, 2nd half", "{:.0f}"), ("gns_trace_late_mean", "tr(Σ), 2nd half", "{:.3g}"),
            ("vb_late_mean", "L_vb, 2nd half", "{:.4f}"),
            ("mse_late_mean", "eps MSE, 2nd half", "{:.4f}"), ("fid", "FID", "{:.2f}"),
            ("class_acc", "class acc.", "{:.3f}"), ("bpd", "bits/dim", "{:.3f}"),
            ("share_least_noisy_late", "share of the least noisy bucket, 2nd half", "{:.2f}"),
            ("share_noisier_half_late", "share of the noisier half, 2nd half", "{:.2f}")]
    lines = ["| config | seeds | " + " | ".join(c[1] for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for config in dict.fromkeys(r["config"] for r in runs.values()):
        rs = [r for r in runs.values() if r["config"] == config]
        cells = []
        for key, _, fmt in cols:
            if key == "vb_late_mean" and not config.startswith(("vb", "hybrid")):
                cells.append("–")  # an eps-MSE run logs no L_vb (its column reads 0)
                continue
            vals = [r.get(key, r["metrics"].get(key)) for r in rs]
            vals = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
            if not vals:
                cells.append("–")
            elif len(vals) == 1:
                cells.append(fmt.format(vals[0]))
            else:
                cells.append(f"{fmt.format(statistics.fmean(vals))} ({fmt.format(min(vals))}..{fmt.format(max(vals))})")
        lines.append(f"| {config} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_ratios(runs: dict, key: str = "gns_trace_late_mean", references=("mse_none", "mse_loss_moment")) -> dict:
    """Seed by seed, each configuration's `key` over a reference configuration's at the same seed
    (the same initial weights and data order): {reference: {config: {seed: ratio}}}. Seeds differ
    from each other more than the methods do, so the ranges of the means can overlap while every
    paired ratio is on one side of 1."""
    by = {(r["config"], r["seed"]): r.get(key) for r in runs.values()}
    out = {}
    for ref in references:
        out[ref] = {}
        for (config, seed), v in by.items():
            base = by.get((ref, seed))
            if config != ref and isinstance(v, (int, float)) and isinstance(base, (int, float)) and base:
                out[ref].setdefault(config, {})[seed] = v / base
    return out


def paired_text(ratios: dict) -> str:
    lines = []
    for ref, configs in ratios.items():
        for config, per_seed in configs.items():
            vals = [per_seed[s] for s in sorted(per_seed)]
            lines.append(f"tr(Σ) {config} / {ref}, seed by seed: " + ", ".join(f"{v:.3f}" for v in vals)
                         + f" (range {min(vals):.3f}..{max(vals):.3f})")
    return "\n".join(lines)


def plot(runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_vb, ax_mse) = plt.subplots(1, 3, figsize=(15, 4))
    colors = {}
    for key, r in runs.items():
        c = colors.setdefault(r["config"], f"C{len(colors)}")
        label = r["config"] if r["seed"] == min(x["seed"] for x in runs.values() if x["config"] == r["config"]) else None
        for ax, name in ((ax_b, "gns_b_simple"), (ax_vb, "vb"), (ax_mse, "mse")):
            s = r[f"{name}_curve"]
            if s and (name != "vb" or r["config"].startswith(("vb", "hybrid"))):
                ax.plot([x for x, _ in s], [y for _, y in s], color=c, lw=1, label=label)
    ax_b.set_title("gradient noise scale B_simple (smoothed)")
    ax_b.set_yscale("log")
    ax_vb.set_title("L_vb per log window (nats/dim)")
    ax_vb.set_yscale("log")
    ax_mse.set_title("eps MSE per log window (unweighted)")
    ax_mse.set_yscale("log")
    for ax in (ax_b, ax_vb, ax_mse):
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:  # the L_vb panel of an eps-MSE study has nothing to name
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plot_shares(runs, path.with_name(path.stem + "-shares.png"))


def plot_shares(runs: dict, path: Path) -> None:
    """One panel per configuration: each bucket's share of the update against step, the mean over
    the seeds as a line and their range as a band (buckets coloured from least to most noisy)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    configs = [c for c in dict.fromkeys(r["config"] for r in runs.values())
               if any(r["config"] == c and r.get("shares") for r in runs.values())]
    if not configs:
        return
    fig, axes = plt.subplots(1, len(configs), figsize=(3.6 * len(configs), 3.6), sharey=True, squeeze=False)
    # the steps every run measured (grad-norm's runs measure every 10 steps, the others every 50): one grid
    common = set.intersection(*(set(r["shares"]["steps"]) for r in runs.values() if r.get("shares")))
    for ax, config in zip(axes[0], configs):
        seeds = [r["shares"] for r in runs.values() if r["config"] == config and r.get("shares")]
        steps = sorted(common) if len(common) > 1 else sorted(set.intersection(*(set(s["steps"]) for s in seeds)))
        per_seed = np.array([[s["share"][s["steps"].index(st)] for st in steps] for s in seeds])  # seed, step, bucket
        edges = seeds[0]["edges"]
        cmap = plt.get_cmap("viridis", len(edges))
        for b, (lo, hi) in enumerate(edges):
            ax.plot(steps, per_seed[:, :, b].mean(0), color=cmap(b), lw=1.2, label=f"[{lo:.0f}, {hi:.0f})")
            ax.fill_between(steps, per_seed[:, :, b].min(0), per_seed[:, :, b].max(0), color=cmap(b), alpha=0.2, lw=0)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"{config} ({len(seeds)} seeds)", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("share of the update <G_b, G>/|G|²")
    axes[0][-1].legend(title=f"bucket ({seeds[0]['space']})", fontsize=6, title_fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
