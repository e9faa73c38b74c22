"""The report draws non-empty figures from small synthetic tables; grouping keeps norms exact."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from ddpmrepro.tables import write_sums
from ddpmrepro.training.introspect import TableWriter
from ddpmrepro.params import ReportParams
from ddpmrepro.evaluation.report import FIGURES, act_rows, group_param_rows, loss_weight_figure, make_report


def synthetic_run(root, n_blocks=30, steps=range(10, 110, 10), per_rank=False):
    rng = np.random.default_rng(0)
    w = TableWriter(root, start_step=0, flush_every=40)
    names = [f"input_blocks.{b}.{layer}.{kind}" for b in range(n_blocks) for layer in ("conv", "norm")
             for kind in ("weight", "bias")]  # 4 * n_blocks parameters
    for s in steps:
        params = [{"step": s, "name": n, "shape": "3x3", "numel": 9, "grad_norm": float(rng.lognormal(-3, 1)),
                   "param_norm": 1.0, "update_ratio": 1e-3} for n in names]
        total = math.sqrt(sum(r["grad_norm"] ** 2 for r in params))
        summary = {"step": s, "total_grad_norm": math.inf if s == 50 else total, "selected_grad_norm": total,
                   "clip_threshold": 0.2, "clipped": total > 0.2, "skipped": s == 50, "loss_scale": 1.0, "lr": 1e-4}
        acts = [{"step": s, "module": m, "tensor": t, "reduction": "per_rank" if per_rank else "global",
                 "rank": r, "world_size": 2 if per_rank else 1, "calls": 1, "numel": 100,
                 "l2": float(rng.lognormal(-5, 1)), "mean": 0.0, "std": 1e-3, "absmax": 1e-2, "zero_frac": 0.0,
                 "hist": [], "hist_lo": math.nan, "hist_hi": math.nan}
                for m in ("input_blocks.0", "middle_block", "out") for t in ("output", "input")
                for r in ((0, 1) if per_rank else (-1,))]
        w.add(s, params=params, summary=summary, activations=acts)
    w.close()
    write_sums(root)  # as train exports them
    return names


def test_make_report_draws_nonempty_pngs(tmp_path):
    synthetic_run(tmp_path / "introspect")
    metrics = tmp_path / "live" / "plots" / "metrics"
    (metrics / "train").mkdir(parents=True)
    for path in (metrics / "loss.tsv", metrics / "train" / "grad_norm.tsv"):
        col = path.stem
        pd.DataFrame({"timestamp": range(5), "step": [25, 50, 75, 100, 125], col: [1.0, 0.5, 0.3, 0.2, 0.15]}).to_csv(
            path, sep="\t", index=False)
    paths = make_report(tmp_path / "introspect", tmp_path / "live", tmp_path / "figs", ReportParams(top_k=3))
    assert {p.name for p in paths} == {"param_grad_heatmap.png", "param_update_heatmap.png", "act_grad_heatmap.png",
                                        "grad_norm_topk.png", "total_grad_norm.png", "training_curves.png"}
    for p in paths:
        img = np.asarray(Image.open(p).convert("L"), dtype=float)
        assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 5, p.name  # not blank
    assert not (tmp_path / "figs" / "loss_weight.png").exists()  # no loss_weight rows: not `learned`
    assert {p.name for p in paths} <= set(FIGURES)


def test_dvc_plots_lists_every_figure_the_report_draws():
    """`dvc plots show` / `dvc plots diff` are how runs are compared: a figure the report draws and
    dvc.yaml does not list is one no comparison shows. Two exceptions: training_curves.png, whose
    dvclive series DVC draws itself, and loss_weight.png, drawn only under `learned`: listed, every
    other run's `dvc plots show` warns "DVC failed to load some plots" (`dvc plots show
    reports/figures/loss_weight.png` shows it; docs/INTROSPECTION.md)."""
    dvc = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())
    listed = {p for p in dvc["plots"] if isinstance(p, str)}
    figures = {f"reports/figures/{name}" for name in FIGURES if name not in ("training_curves.png", "loss_weight.png")}
    assert figures - listed == set(), "add these to dvc.yaml's plots:"
    assert {p for p in listed if p.startswith("reports/figures/")} - figures == set(), "the report draws no such figure"


def live_metrics(live, rows=True):
    metrics = live / "plots" / "metrics"
    metrics.mkdir(parents=True)
    pd.DataFrame({"timestamp": [0, 1], "step": [25, 50], "loss": [1.0, 0.5]}).iloc[: 2 if rows else 0].to_csv(
        metrics / "loss.tsv", sep="\t", index=False)


def no_rows_run(root):
    TableWriter(root, start_step=0).close()  # what train leaves when it recorded no step
    write_sums(root)


@pytest.mark.parametrize("introspect, live, named, words", [
    (None, live_metrics, "introspect", "no such introspection directory"),
    (lambda d: d.mkdir(), live_metrics, "introspect", "no introspection tables"),
    (lambda d: d.write_text("x"), live_metrics, "introspect", "not a directory"),
    (synthetic_run, None, "live", "no such dvclive directory"),
    (synthetic_run, lambda d: d.mkdir(), "live", "no dvclive metrics"),
    (synthetic_run, lambda d: live_metrics(d, rows=False), "live", "no dvclive metrics"),
], ids=["introspect-missing", "introspect-empty", "introspect-file", "live-missing",
        "live-empty", "live-header-only"])
def test_a_missing_or_empty_input_fails_in_one_line_naming_it_and_writes_nothing(tmp_path, introspect, live,
                                                                                 named, words):
    from click.testing import CliRunner

    from ddpmrepro.cli import main

    for make, d in ((introspect, tmp_path / "introspect"), (live, tmp_path / "live")):
        if make is not None:
            make(d)
    (tmp_path / "params.yaml").write_text("{}\n")
    result = CliRunner().invoke(main, ["report", "-p", str(tmp_path / "params.yaml"), "--introspect",
                                       str(tmp_path / "introspect"), "--live", str(tmp_path / "live"),
                                       "--out", str(tmp_path / "figs")])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: {tmp_path / named}: ") and words in line, line
    assert not (tmp_path / "figs").exists()


def test_group_param_rows_combines_to_module_norms(tmp_path):
    names = synthetic_run(tmp_path, n_blocks=20)  # 80 parameters > MAX_ROWS: grouped per module
    df = pd.read_parquet(tmp_path / "param_grads")
    g = group_param_rows(df)
    assert g["label"].nunique() == 40 and str(g["label"].cat.categories[0]) == "input_blocks.0.conv"
    s0 = df[(df["step"] == 10) & df["name"].str.startswith("input_blocks.3.norm.")]
    row = g[(g["step"] == 10) & (g["label"] == "input_blocks.3.norm")]
    assert row["grad_norm"].item() == pytest.approx(math.sqrt((s0["grad_norm"] ** 2).sum()))
    assert row["update_ratio"].item() == pytest.approx(1e-3)
    assert group_param_rows(df[df["name"].isin(names[:8])])["label"].nunique() == 8  # few: kept per parameter


def test_act_rows_combine_ranks_to_global_l2(tmp_path):
    synthetic_run(tmp_path, per_rank=True)
    df = pd.read_parquet(tmp_path / "act_grads")
    a = act_rows(df)
    src = df[(df["step"] == 10) & (df["module"] == "out") & (df["tensor"] == "input")]
    assert len(src) == 2
    got = a[(a["step"] == 10) & (a["label"] == "out (in)")]["l2"].item()
    assert got == pytest.approx(math.sqrt((src["l2"] ** 2).sum()))


def test_introspection_turned_off_still_draws_the_training_curves(tmp_path, caplog):
    no_rows_run(tmp_path / "introspect")
    live_metrics(tmp_path / "live")
    with caplog.at_level("WARNING", logger="ddpmrepro.evaluation.report"):
        paths = make_report(tmp_path / "introspect", tmp_path / "live", tmp_path / "figs", ReportParams(top_k=3))
    assert [p.name for p in paths] == ["training_curves.png"]
    assert "no steps recorded" in caplog.text


def test_an_imported_model_gets_a_note_instead_of_figures(tmp_path):
    """train.import_from: nothing was trained, so no figure is drawn (and none from an earlier
    trained model stays); the note names the source. The training inputs are not even read."""
    out = tmp_path / "figures"
    out.mkdir()
    (out / "training_curves.png").write_bytes(b"from a trained model before")
    written = make_report(tmp_path / "no-introspect", tmp_path / "no-live", out, ReportParams(),
                          imported_from="models/published/ema_0.9999_500000.pt")
    assert written == [] and [p.name for p in out.iterdir()] == ["IMPORTED.txt"]
    assert "models/published/ema_0.9999_500000.pt" in (out / "IMPORTED.txt").read_text()


def learned_weighting_run(root, steps):
    """A loss_weight table as the loop writes it: `LearnedLossWeight.rows(step)` at each log step,
    its curve moved between steps; steps.tsv only, as with introspection off."""
    import torch

    from ddpmrepro.training.learned_weighting import LearnedLossWeight

    betas = np.linspace(1e-4, 0.02, 200)
    weight = LearnedLossWeight(np.cumprod(1 - betas), seed=0)
    gen = torch.Generator().manual_seed(0)
    w = TableWriter(root, start_step=0, flush_every=5)
    for s in steps:
        with torch.no_grad():
            weight.weight.add_(torch.randn(weight.weight.shape, generator=gen))
            weight.bias.sub_(0.5)
        w.add(s, loss_weight=weight.rows(s))
    w.close()
    write_sums(root)


@pytest.mark.parametrize("logged, drawn", [(range(10, 130, 10), [10, 30, 40, 60, 70, 90, 100, 120]),
                                           ([5, 10, 15], [5, 10, 15]), ([7], [7])],
                         ids=["12-steps", "3-steps", "1-step"])
def test_the_learned_loss_weighting_is_drawn_one_line_per_chosen_step(tmp_path, logged, drawn):
    learned_weighting_run(tmp_path / "introspect", logged)
    live_metrics(tmp_path / "live")
    table = pd.read_parquet(tmp_path / "introspect" / "loss_weight")
    assert len(table) == 64 * len(logged)  # T = 200: 64 evenly spaced t per log step

    fig = loss_weight_figure(table)
    curves = [line for line in fig.axes[0].lines if line.get_gid()]
    assert [c.get_gid() for c in curves] == [f"step {s}" for s in drawn]  # the first and last among them
    for c, s in zip(curves, drawn):
        rows = table[table["step"] == s].sort_values("t")
        np.testing.assert_array_equal(c.get_xdata(), rows["t"])
        np.testing.assert_array_equal(c.get_ydata(), rows["u"])
    assert curves[-1].get_linewidth() > max([c.get_linewidth() for c in curves[:-1]], default=0)  # the last stands out
    if len(drawn) > 1:
        assert curves[0].get_color() != curves[-1].get_color()  # coloured by step

    paths = make_report(tmp_path / "introspect", tmp_path / "live", tmp_path / "figs", ReportParams())
    assert [p.name for p in paths] == ["loss_weight.png", "training_curves.png"]
    img = np.asarray(Image.open(paths[0]).convert("L"), dtype=float)
    assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 5


def test_a_report_into_an_earlier_reports_folder_leaves_only_its_own_figures(tmp_path):
    """By hand, `ddpmrepro report --out DIR` twice: the second run (`learned` turned off) must not
    leave the first run's loss_weight.png beside its own figures. The folder is replaced whole, as
    every stage's output directory is (an interrupted report left 3 new figures beside 6 old ones
    that looked like one report: found from outside); a folder that is no report is refused."""
    learned_weighting_run(tmp_path / "learned", [10, 20])
    live_metrics(tmp_path / "live")
    out = tmp_path / "figs"
    first = make_report(tmp_path / "learned", tmp_path / "live", out, ReportParams())
    assert (out / "loss_weight.png") in first
    synthetic_run(tmp_path / "plain")
    second = make_report(tmp_path / "plain", tmp_path / "live", out, ReportParams(top_k=3))
    assert "loss_weight.png" not in {p.name for p in second}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in second)
    assert all(p.parent == out for p in second)
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="is not a figures directory"):
        make_report(tmp_path / "plain", tmp_path / "live", other, ReportParams())
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_a_damaged_table_shared_with_dvcs_cache_says_how_to_mend_the_cache_too(tmp_path):
    """A table checked out by DVC is a hard link to its cache: damaged through one name, both are, and
    `dvc repro --force train` leaves the cached copy as it is (DVC 3.67), so the line says to delete it."""
    from ddpmrepro.files import CheckpointError
    from ddpmrepro.tables import verify_sums

    synthetic_run(tmp_path / "introspect")
    live_metrics(tmp_path / "live")
    part = sorted((tmp_path / "introspect" / "steps").glob("part-*.parquet"))[0]
    cache = tmp_path / "cache" / "md5" / "ab" / "cdef"
    cache.parent.mkdir(parents=True)
    os.link(part, cache)
    data = bytearray(part.read_bytes())
    data[-20] ^= 0xFF
    cache.write_bytes(bytes(data))  # through the cache's name
    with pytest.raises(CheckpointError) as e:
        make_report(tmp_path / "introspect", tmp_path / "live", tmp_path / "figs", ReportParams())
    assert str(e.value).startswith(f"{part}: sha256 differs from {tmp_path / 'introspect' / 'SHA256SUMS'}")
    assert f"first delete the cached copy (`find .dvc/cache -samefile {part} -delete`), then re-export them" \
        in str(e.value) and "shared by 2 hard links" in str(e.value)  # before a pull: DVC trusts its cache
    assert not (tmp_path / "figs").exists()
    os.unlink(cache)  # one name left: re-exporting is enough
    with pytest.raises(CheckpointError, match="; re-export them: `dvc repro --force train` \\(from the run's checkpoint"):
        verify_sums(tmp_path / "introspect")


def test_bucket_labels_write_timesteps_as_whole_numbers():
    from ddpmrepro.evaluation.report import _bucket_label

    assert _bucket_label({"bucket": 3, "space": "t", "lo": 750.0, "hi": 1000.0}) == "3: t [750, 1000)"  # was 1e+03
    assert _bucket_label({"bucket": 0, "space": "logsnr", "lo": -2.4567, "hi": 4.0}) == "0: log-SNR [-2.46, 4)"


def test_a_sums_file_naming_a_file_outside_its_directory_is_not_a_sums_file(tmp_path):
    from ddpmrepro.files import CheckpointError
    from ddpmrepro.tables import verify_sums

    synthetic_run(tmp_path / "introspect")
    sums = tmp_path / "introspect" / "SHA256SUMS"
    sums.write_text(sums.read_text() + "0" * 64 + "  ../../params.yaml\n")
    with pytest.raises(CheckpointError, match="SHA256SUMS: not a SHA256SUMS file \\(line '0+  ../../params"):
        verify_sums(tmp_path / "introspect")


def test_the_step_axes_of_a_short_run_tick_whole_steps_only(tmp_path, monkeypatch):
    """Found from outside: a run recording steps 2 and 4 had 2.00, 2.25, ... 4.00 under its top-k and
    total-norm lines. Every figure's step axis (but the heatmaps', which label their columns) ticks
    whole numbers, and still several of them."""
    from ddpmrepro.evaluation import report

    synthetic_run(tmp_path / "introspect", n_blocks=2, steps=[2, 4])
    metrics = tmp_path / "live" / "plots" / "metrics"
    metrics.mkdir(parents=True)
    pd.DataFrame({"timestamp": [0, 1], "step": [2, 4], "loss": [1.0, 0.5]}).to_csv(metrics / "loss.tsv", sep="\t",
                                                                                   index=False)
    figures = {}
    save = report._save
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.setdefault(path.name, fig) and save(fig, path))
    make_report(tmp_path / "introspect", tmp_path / "live", tmp_path / "figs", ReportParams(top_k=3))
    step_axes = [(name, ax) for name, fig in figures.items() if "heatmap" not in name
                 for ax in fig.axes if ax.get_xlabel() == "step"]
    assert {name for name, _ in step_axes} == {"grad_norm_topk.png", "total_grad_norm.png", "training_curves.png"}
    for name, ax in step_axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(ticks) >= 2 and all(t == round(t) for t in ticks), (name, ticks)
