"""Figures from the introspection tables and the dvclive metrics (matplotlib, Agg, no display).

`make_report` draws what its inputs hold and returns the paths written (a missing or empty input
directory is an error, not an empty report):

* `param_grad_heatmap.png`   log10 grad norm, parameter (or module) x recorded step
* `param_update_heatmap.png` log10 update ratio ||dp|| / ||p||, same rows
* `act_grad_heatmap.png`     log10 L2 of activation gradients, module (output, input) x step
* `grad_norm_topk.png`       the top-k rows of both heatmaps by mean norm, as lines
* `total_grad_norm.png`      global grad norm against the clipping threshold, clipped/skipped steps marked
* `noise_level_shares.png`   each noise-level bucket's share of the update and gradient norm (`noise_levels`)
* `noise_level_conflicts.png` the buckets' cosine matrices at `report.conflict_steps`
* `noise_scale.png`          the gradient noise scale B_simple, |G|² and tr(Σ)
* `loss_weight.png`          the learned loss weighting u(t) at up to 8 logged steps (`loss_weight` table;
                             only under `diffusion.loss_weighting: learned`)
* `training_curves.png`      every dvclive metric in `live_dir/plots/metrics/**/*.tsv` but images/s

`FIGURES` names them all. The directory is replaced whole (`files.replacing_dir`), so it shows one
run: never a figure of an earlier report that this one does not draw (loss_weight.png after `learned`
was turned off), nor, after an interrupted report, old figures beside new ones.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .. import files, outputs  # noqa: E402
from ..tables import SUMS_FILE, read_table, verify_sums  # noqa: E402  (the training's tables, not its code)
from ..params import ReportParams  # noqa: E402

MAX_ROWS = 60  # heatmap rows; more parameters are combined per module (norm of the concatenation)
LOSS_WEIGHT_LINES = 8  # logged steps drawn in loss_weight.png, evenly chosen, the first and last among them

# Every figure make_report can draw. dvc.yaml's `plots:` lists each (tests/test_report.py checks it)
# except training_curves.png: `dvc plots` draws the dvclive series it is made of one by one.
FIGURES = ("param_grad_heatmap.png", "param_update_heatmap.png", "act_grad_heatmap.png", "grad_norm_topk.png",
           "total_grad_norm.png", "noise_level_shares.png", "noise_level_conflicts.png", "noise_scale.png",
           "loss_weight.png", "training_curves.png")


def group_param_rows(df: pd.DataFrame, max_rows: int = MAX_ROWS) -> pd.DataFrame:
    """Per (step, row label) grad norm / update ratio, with at most `max_rows` labels in model order.

    Parameter names are kept if few enough; otherwise they are cut to their module (drop the last
    dotted part), then to ever shorter prefixes. A group's grad norm is the norm of the concatenated
    grads, sqrt(sum of squares); its update ratio is ||dp|| / ||p|| over the group.
    """
    names = list(dict.fromkeys(df["name"]))
    depth = max(n.count(".") + 1 for n in names)
    label = {n: n for n in names}
    while len(set(label.values())) > max_rows and depth > 1:
        depth -= 1
        label = {n: ".".join(n.split(".")[:depth]) for n in names}
    d = df.assign(label=df["name"].map(label),
                  g2=df["grad_norm"] ** 2, p2=df["param_norm"] ** 2,
                  u2=(df["update_ratio"] * df["param_norm"]) ** 2)
    out = d.groupby(["label", "step"], sort=False)[["g2", "p2", "u2"]].sum(min_count=1).reset_index()
    out["grad_norm"] = np.sqrt(out["g2"])
    out["update_ratio"] = np.sqrt(out["u2"]) / np.sqrt(out["p2"])
    order = list(dict.fromkeys(label[n] for n in names))
    out["label"] = pd.Categorical(out["label"], categories=order, ordered=True)
    return out[["label", "step", "grad_norm", "update_ratio"]]


def act_rows(df: pd.DataFrame) -> pd.DataFrame:
    """(label, step, l2) for activation gradients; per-rank rows are combined to the global L2."""
    label = df["module"] + np.where(df["tensor"] == "input", " (in)", "")
    d = df.assign(label=label, l22=df["l2"] ** 2)
    out = d.groupby(["label", "step"], sort=False)["l22"].sum(min_count=1).reset_index()
    out["l2"] = np.sqrt(out["l22"])
    out["label"] = pd.Categorical(out["label"], categories=list(dict.fromkeys(label)), ordered=True)
    return out[["label", "step", "l2"]]


def _log10(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.log10(a.astype(float))
    return np.where(np.isfinite(v), v, np.nan)


def _step_axis(ax, **label) -> None:
    """x is the step: a whole number of updates (matplotlib's own ticks put 2.25 between 2 and 4
    on a short run's figures, found from outside); its ticks as matplotlib's AutoLocator places them."""
    ax.set_xlabel("step", **label)
    ax.xaxis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))


def _heatmap(table: pd.DataFrame, value: str, title: str, cbar: str, path: Path) -> Path:
    wide = table.pivot_table(index="label", columns="step", values=value, aggfunc="first", observed=True, dropna=False)
    z = _log10(wide.to_numpy())
    # At least 7 inches: with few recorded steps the title was cut ("... before clippin").
    width = max(7.0, min(4 + 0.12 * wide.shape[1], 16))
    fig, ax = plt.subplots(figsize=(width, 1.5 + 0.22 * wide.shape[0]))
    im = ax.imshow(np.ma.masked_invalid(z), aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(wide.index)), [str(x) for x in wide.index], fontsize=7)
    steps = list(wide.columns)
    # As many step labels as the axes (about half the figure, beside the layer names) hold apart:
    # 12 on 7 inches ran together ("100110120").
    ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 12, int(width * 0.75))).round().astype(int))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
    ax.set_xlabel("step")  # its own ticks: the columns of the recorded steps
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=cbar)
    return _save(fig, path)


def _topk_lines(ax, table: pd.DataFrame, value: str, k: int, title: str) -> None:
    means = table.groupby("label", observed=True)[value].mean().sort_values(ascending=False)
    for label in means.index[:k]:
        d = table[table["label"] == label].sort_values("step")
        # A zero (no gradient yet: every layer but the zero-initialised output at step 1) has no place on
        # a log axis; matplotlib drew it as a drop to the bottom. A gap instead.
        ax.plot(d["step"], d[value].where(d[value] > 0), marker=".", ms=3, lw=1, label=str(label))
    ax.set_yscale("log")
    _step_axis(ax)
    ax.set_title(title)
    ax.legend(fontsize=6, loc="best")


def _total_norm(steps: pd.DataFrame, path: Path) -> Path:
    s = steps.sort_values("step")
    fig, ax = plt.subplots(figsize=(8, 4))
    finite = s[np.isfinite(s["total_grad_norm"])]
    ax.plot(finite["step"], finite["total_grad_norm"], lw=1, marker=".", ms=3, label="total grad norm (before clipping)")
    thr = s["clip_threshold"].where(s["clip_threshold"] > 0)
    if thr.notna().any():
        ax.plot(s["step"], thr, color="k", ls="--", lw=1, label="clip threshold")
    c = s[s["clipped"] & ~s["skipped"] & np.isfinite(s["total_grad_norm"])]
    ax.scatter(c["step"], c["total_grad_norm"], color="tab:orange", s=14, zorder=3, label=f"clipped ({len(c)})")
    sk = s[s["skipped"]]
    for i, st in enumerate(sk["step"]):
        ax.axvline(st, color="tab:red", alpha=0.5, lw=1, label=f"skipped ({len(sk)})" if i == 0 else None)
    if (finite["total_grad_norm"] > 0).all() and len(finite):
        ax.set_yscale("log")
    _step_axis(ax)
    ax.set_ylabel("L2 norm")
    ax.set_title("Global gradient norm")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _bucket_label(row) -> str:
    """"0: t [0, 250)" or "1: log-SNR [-2.5, 0.5)": timesteps as whole numbers (`.3g` wrote 1000 as 1e+03)."""
    unit = "t" if row["space"] == "t" else "log-SNR"
    def edge(v):
        return f"{int(v)}" if unit == "t" and float(v).is_integer() else f"{v:.3g}"
    return f"{int(row['bucket'])}: {unit} [{edge(row['lo'])}, {edge(row['hi'])})"


def _noise_level_shares(levels: pd.DataFrame, path: Path) -> Path:
    """Each noise level's share of the update (<G_b, G>/|G|²) and its gradient norm over training."""
    fig, (ax_share, ax_norm) = plt.subplots(1, 2, figsize=(12, 4))
    for b, rows in levels.sort_values("step").groupby("bucket"):
        label = _bucket_label(rows.iloc[0])
        ax_share.plot(rows["step"], rows["share"], lw=1, marker=".", ms=3, label=label)
        ax_norm.plot(rows["step"], rows["grad_norm"], lw=1, marker=".", ms=3, label=label)
    ax_share.axhline(0, color="k", lw=0.5)
    ax_share.set_title("Share of the update by noise level (sums to 1; < 0: against the step)")
    _step_axis(ax_share)
    ax_share.legend(fontsize=7, title="bucket (0 = least noise)", title_fontsize=7)
    ax_norm.set_yscale("log")
    ax_norm.set_title("Gradient norm of each noise level's part |G_b|")
    _step_axis(ax_norm)
    return _save(fig, path)


def _conflict_matrices(levels: pd.DataFrame, steps: list[int], path: Path) -> Path:
    """The cosine between the buckets' gradients at chosen steps: < 0 is the noise levels pulling
    against each other (Min-SNR's "conflicting optimization directions")."""
    fig, axes = plt.subplots(1, len(steps), figsize=(3.6 * len(steps) + 1, 3.4), squeeze=False)
    for ax, st in zip(axes[0], steps):
        rows = levels[levels["step"] == st].sort_values("bucket")
        cos = np.array(rows["cos"].tolist(), dtype=float)
        im = ax.imshow(cos, vmin=-1, vmax=1, cmap="RdBu")
        for (i, j), v in np.ndenumerate(cos):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(f"step {st}", fontsize=9)
        ax.set_xticks(range(len(rows)))
        ax.set_yticks(range(len(rows)))
        ax.set_xlabel("bucket (0 = least noise)", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="cos(G_b, G_c)")
    fig.suptitle("Gradient conflicts between noise levels", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _noise_scale(metrics: dict[str, pd.DataFrame], steps: pd.DataFrame, path: Path) -> Path:
    """B_simple from the smoothed |G|² and tr(Σ), and the per-step estimates it averages."""
    fig, (ax_b, ax_terms) = plt.subplots(1, 2, figsize=(12, 4))
    b = metrics.get("gns_b_simple")
    if b is not None:
        ax_b.plot(b["step"], b["value"], lw=1.5, label="B_simple (smoothed)")
    ax_b.set_title("Gradient noise scale B_simple = tr(Σ) / |G|²")
    _step_axis(ax_b)
    ax_b.set_ylabel("examples")
    ax_b.legend(fontsize=7)
    for name, color in (("gns_g2", "tab:blue"), ("gns_trace", "tab:orange")):
        if name in metrics:
            m = metrics[name]
            ax_terms.plot(m["step"], m["value"], lw=1, color=color, label=f"{name} (log window mean)")
        if name in steps and steps[name].notna().any():
            ax_terms.scatter(steps["step"], steps[name], s=6, color=color, alpha=0.4, label=f"{name} (one step)")
    ax_terms.axhline(0, color="k", lw=0.5)
    ax_terms.set_yscale("symlog")
    ax_terms.set_title("Unbiased |G|² and tr(Σ) (|G|² can be < 0 on one step)")
    _step_axis(ax_terms)
    ax_terms.legend(fontsize=7)
    return _save(fig, path)


def loss_weight_figure(table: pd.DataFrame, lines: int = LOSS_WEIGHT_LINES):
    """The learned loss weighting u(t) (the `loss_weight` table), one line per chosen logged step.

    Up to `lines` logged steps, evenly chosen with the first and the last, coloured by step; the
    last is drawn thick. The curves are the first lines of the first axes, in step order, each with
    gid "step N". exp(u_t), the scale level t's MSE is divided by (u_t tends to log E[L_t]), is
    read on the right axis; log-SNR on the top one. Returns the matplotlib figure, not yet saved.
    """
    recorded = sorted(int(s) for s in table["step"].unique())
    pick = np.unique(np.linspace(0, len(recorded) - 1, min(lines, len(recorded))).round().astype(int))
    chosen = [recorded[i] for i in pick]
    norm = plt.Normalize(min(chosen[0], chosen[-1] - 1), chosen[-1])  # one step alone: drawn dark too
    cmap = plt.get_cmap("viridis_r")  # the last step darkest
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for s in chosen:
        d = table[table["step"] == s].sort_values("t")
        last = s == chosen[-1]
        ax.plot(d["t"], d["u"], color=cmap(norm(s)), lw=2.5 if last else 1, zorder=3 if last else 2, gid=f"step {s}",
                label=f"step {s} (last)" if last else (f"step {s}" if s == chosen[0] else None))
    ax.axhline(0, color="k", lw=0.5, ls=":", label="u = 0 (the start: no rescaling)")
    ax.set_xlabel("t (0 = least noise)")
    ax.set_ylabel("u_t (about log E[L_t])")
    ax.set_title("Learned loss weighting: L = L_t / exp(u_t) + u_t")
    ax.legend(fontsize=7, loc="best")
    # exp(u) on the right: the loss scale each level is divided by (a log axis is linear in u).
    right = ax.secondary_yaxis("right", functions=(np.exp, lambda v: np.log(np.maximum(v, 1e-300))))
    u = table.loc[table["step"].isin(chosen), "u"]
    if u.max() - u.min() > 1.5:  # more than a factor ~4.5 in exp(u): ticks at 1, 2, 5 x 10^k (or 10^k)
        right.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5) if u.max() - u.min() < 7 else (1,)))
    right.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    right.set_ylabel("exp(u_t): level t's MSE is divided by this")
    # log-SNR on top, interpolated on the table's grid of t (it decreases with t).
    grid = table[table["step"] == chosen[-1]].sort_values("t")
    ts, ls = grid["t"].to_numpy(float), grid["logsnr"].to_numpy(float)
    if len(ts) > 1:
        top = ax.secondary_xaxis("top", functions=(lambda x: np.interp(x, ts, ls),
                                                   lambda v: np.interp(v, ls[::-1], ts[::-1])))
        top.set_xticks(np.round(np.interp(np.linspace(ts[0], ts[-1], 6), ts, ls), 1))  # evenly in t: not crowded
        top.set_xlabel("log-SNR", fontsize=8)
    if len(chosen) > 1:
        bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, pad=0.13, label="step")
        bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def read_live_metrics(live_dir: Path) -> dict[str, pd.DataFrame]:
    """dvclive's `plots/metrics/**/*.tsv`: name -> DataFrame with columns step, value."""
    root = Path(live_dir) / "plots" / "metrics"
    out = {}
    for f in sorted(root.rglob("*.tsv")) if root.exists() else []:
        df = pd.read_csv(f, sep="\t")
        name = f.relative_to(root).with_suffix("").as_posix()
        col = f.stem if f.stem in df.columns else df.columns[-1]
        if "step" in df.columns and len(df):
            out[name] = pd.DataFrame({"step": df["step"], "value": pd.to_numeric(df[col], errors="coerce")})
    return out


def _training_curves(metrics: dict[str, pd.DataFrame], path: Path) -> Path:
    n = len(metrics)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3 * rows), squeeze=False)
    for ax, (name, df) in zip(axes.flat, metrics.items()):
        ax.plot(df["step"], df["value"], lw=1)
        if (df["value"] > 0).all() and name.split("/")[-1].startswith(("loss", "mse", "vb", "grad_norm")):
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        _step_axis(ax, fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

log = logging.getLogger("ddpmrepro.evaluation.report")


class ReportInputError(ValueError):
    """An input directory of the report is missing or holds nothing to draw (one line, names it)."""


def _require_dir(path: Path, what: str, option: str) -> None:
    if not path.exists():
        raise ReportInputError(f"{path}: no such {what} directory; train first (`dvc repro train`) "
                               f"or pass {option} DIR")
    if not path.is_dir():
        raise ReportInputError(f"{path}: not a directory; {option} takes the {what} directory that train writes")


def make_report(introspect_dir: str | Path, live_dir: str | Path, out_dir: str | Path, params: ReportParams,
                imported_from: str = "") -> list[Path]:
    """Draws the figures into `out_dir`, replacing it whole (an interrupted or failed report leaves
    the old one as it was, never old figures beside new ones), and returns their paths.

    Raises `ReportInputError` before writing anything when either input directory is missing or
    holds nothing to draw: a report of zero figures would look like success. The exception is a
    model imported instead of trained (`imported_from`, train.import_from): there is no training
    to draw, so `out_dir` gets only IMPORTED.txt saying so, and no figures.
    """
    if imported_from:
        with files.replacing_dir(Path(out_dir), outputs.FIGURES) as tmp:
            (tmp / "IMPORTED.txt").write_text(
                f"The model was imported from {imported_from} (train.import_from), not trained here:\nthere are "
                "no loss curves or gradient tables to draw. metrics.json has its evaluation.\n")
        return []
    introspect_dir, live_dir = Path(introspect_dir), Path(live_dir)
    _require_dir(introspect_dir, "introspection", "--introspect")
    _require_dir(live_dir, "dvclive", "--live")
    # train always leaves steps.tsv (with no rows when nothing was recorded) and the sums: without
    # either this is a wrong path, which deserves that message rather than "SHA256SUMS: not found".
    if not any((introspect_dir / name).is_file() for name in ("steps.tsv", SUMS_FILE)):
        raise ReportInputError(f"{introspect_dir}: no introspection tables (param_grads/, act_grads/, steps/, "
                               "steps.tsv); pass --introspect the directory that train writes")
    verify_sums(introspect_dir)  # a figure from damaged numbers would look like a finding
    pg = read_table(introspect_dir, "param_grads")
    ag = read_table(introspect_dir, "act_grads")
    st = read_table(introspect_dir, "steps")
    if not (len(pg) or len(ag) or len(st)):
        # The writer's layout with no rows is a run with introspection turned off (introspect.every 0
        # and no introspect.steps): the training curves are still worth drawing.
        log.warning("%s: no steps recorded (introspect.every is 0 and introspect.steps is empty): "
                    "drawing the training curves only (and the learned loss weighting, if any)", introspect_dir)
    metrics = read_live_metrics(live_dir)
    if not metrics:
        raise ReportInputError(f"{live_dir}: no dvclive metrics (no plots/metrics/*.tsv with rows); train writes them")
    with files.replacing_dir(Path(out_dir), outputs.FIGURES) as tmp:
        written = _draw(tmp, pg, ag, st, metrics, introspect_dir, params)
    return [Path(out_dir) / p.name for p in written]


def _draw(out: Path, pg, ag, st, metrics, introspect_dir: Path, params: ReportParams) -> list[Path]:
    written: list[Path] = []
    pt = group_param_rows(pg) if len(pg) else None
    at = act_rows(ag) if len(ag) else None
    if pt is not None:
        written.append(_heatmap(pt, "grad_norm", "Parameter gradient norm (after unscale, before clipping)",
                                "log10 ||grad||", out / "param_grad_heatmap.png"))
        if pt["update_ratio"].notna().any():
            written.append(_heatmap(pt, "update_ratio", "Update ratio ||dp|| / ||p||", "log10 ratio",
                                    out / "param_update_heatmap.png"))
    if at is not None:
        written.append(_heatmap(at, "l2", "Activation gradient L2 (divided by the loss scale)", "log10 ||dL/da||",
                                out / "act_grad_heatmap.png"))
    panels = [(t, v, ttl) for t, v, ttl in ((pt, "grad_norm", "parameters"), (at, "l2", "activations")) if t is not None]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
        for ax, (t, v, ttl) in zip(axes[0], panels):
            _topk_lines(ax, t, v, params.top_k, f"Top {params.top_k} {ttl} by mean gradient norm")
        written.append(_save(fig, out / "grad_norm_topk.png"))
    if len(st):
        written.append(_total_norm(st, out / "total_grad_norm.png"))
    levels = read_table(introspect_dir, "noise_levels")
    if len(levels):
        written.append(_noise_level_shares(levels, out / "noise_level_shares.png"))
        recorded = sorted(levels["step"].unique())
        chosen = [s for s in params.conflict_steps if s in recorded] or \
            sorted({recorded[0], recorded[len(recorded) // 2], recorded[-1]})
        written.append(_conflict_matrices(levels, chosen, out / "noise_level_conflicts.png"))
    if "gns_b_simple" in metrics or (len(st) and st["gns_g2"].notna().any()):
        written.append(_noise_scale(metrics, st, out / "noise_scale.png"))
    weighting = read_table(introspect_dir, "loss_weight")  # rows only under loss_weighting: learned
    if len(weighting):
        written.append(_save(loss_weight_figure(weighting), out / "loss_weight.png"))
    # Not the throughput: a timing would give reports/figures (a DVC cached out) new bytes on every
    # rerun, and a fresh clone's cache would never hold the committed version (found from outside).
    # `dvc plots show` draws it from its TSV.
    written.append(_training_curves({k: v for k, v in metrics.items() if k != outputs.TIMING},
                                    out / "training_curves.png"))
    return written


__all__ = ["make_report", "ReportInputError", "group_param_rows", "act_rows", "read_live_metrics", "loss_weight_figure",
           "FIGURES", "MAX_ROWS", "LOSS_WEIGHT_LINES"]
