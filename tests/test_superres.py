"""Super-resolution end to end through the CLI (train an upsampler, sample it from the test split
and from a base run's samples.npz, score it beside bicubic), and its metrics against independent
computations."""
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
from ddpmrepro.data import load_prepared, prepare, to_model_range, to_uint8
from ddpmrepro.evaluation.evaluator import fit_evaluator
from ddpmrepro.evaluation.superres import consistency, psnr, ssim
from ddpmrepro.model.superres import downsample
from ddpmrepro.training import loop as T

RAW = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16},
    "diffusion": {"timesteps": 10},
    "train": {"steps": 12, "batch_per_proc": 16, "warmup_steps": 2, "checkpoint_every": 12, "log_every": 4,
              "ema_rates": [0.9]},
    "introspect": {"every": 0, "steps": []},
    "sample": {"respacing": "ddim5", "per_class": 2, "ema_rate": 0.9, "guidance": 0.5},
    "superres": {"low_res": 4, "noise_aug": 0.2, "sample_noise_aug": 0.1},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    """Digits 8x8, an evaluator, and an upsampler 4x4 -> 8x8 trained for a few steps."""
    root = tmp_path_factory.mktemp("sr")
    prepare(P.DataParams(), root / "data")
    data = load_prepared(root / "data")
    fit_evaluator(np.asarray(data.train_images), data.train_labels, np.asarray(data.test_images), data.test_labels,
                  P.EvaluatorParams(epochs=1), root / "evaluator", num_classes=10,
                  class_names=data.manifest["class_names"], num_threads=1)
    (root / "params.yaml").write_text(yaml.safe_dump(RAW))
    params = P.load(root / "params.yaml")
    T.train(params, T.TrainPaths(root / "data", root / "model", root / "live", root / "introspect", root / "ckpt"))
    return root


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def write_params(path: Path, **superres) -> Path:
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["superres"].update(superres)
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_an_upsampler_samples_the_test_split_reproducibly_and_is_scored_beside_bicubic(trained, tmp_path):
    config = json.loads((trained / "model" / "config.json").read_text())
    assert config["params"]["superres"]["low_res"] == 4
    cli("sample-superres", "--params", str(trained / "params.yaml"), "--model", str(trained / "model"),
        "--data", str(trained / "data"), "--out", str(tmp_path / "s"))
    with np.load(tmp_path / "s" / "samples.npz") as z:
        s = {k: z[k] for k in z.files}
    data = load_prepared(trained / "data")
    assert s["images"].shape == (20, 1, 8, 8) and s["images"].dtype == np.uint8 and bool(s["from_test"])
    # the inputs are the first 2 test images of each class, area-downsampled and rounded to uint8
    labels = np.asarray(data.test_labels)
    assert s["source_index"].tolist() == [i for c in range(10) for i in np.flatnonzero(labels == c)[:2]]
    truth = np.stack([data.test_images[i] for i in s["source_index"]])
    assert np.array_equal(s["labels"], labels[s["source_index"]])
    blocks = truth.astype(np.float64).reshape(20, 1, 4, 2, 4, 2).mean(axis=(3, 5))
    assert np.abs(s["low_res"] - np.clip(np.round(blocks), 0, 255)).max() <= 1  # (model range rounding)
    # image k depends on (seed, k) only: another batch size gives the same images, up to float rounding:
    # on some CPUs oneDNN's convolutions round differently at another batch size (an AMD EPYC, 2026-11-28:
    # 1 pixel of 1,280 one level apart), where a draw that depended on the batch would move most pixels far
    p2 = yaml.safe_load((trained / "params.yaml").read_text())
    p2["sample"]["batch_size"] = 3
    (tmp_path / "p2.yaml").write_text(yaml.safe_dump(p2))
    cli("sample-superres", "--params", str(tmp_path / "p2.yaml"), "--model", str(trained / "model"),
        "--data", str(trained / "data"), "--out", str(tmp_path / "s3"))
    with np.load(tmp_path / "s3" / "samples.npz") as z:
        apart = np.abs(z["images"].astype(int) - s["images"].astype(int))
        assert apart.max() <= 1 and (apart > 0).mean() <= 0.01, (apart.max(), (apart > 0).sum())
    # scored beside bicubic upsampling of the same inputs
    out = cli("evaluate-superres", "--params", str(trained / "params.yaml"), "--samples", str(tmp_path / "s"),
              "--data", str(trained / "data"), "--evaluator", str(trained / "evaluator"),
              "--out", str(tmp_path / "m.json"), "--detail", str(tmp_path / "d.json"))
    assert "sr_psnr=" in out
    head = json.loads((tmp_path / "m.json").read_text())
    assert set(head) >= {"sr_psnr", "bicubic_psnr", "sr_ssim", "bicubic_ssim", "sr_fid", "bicubic_fid",
                         "sr_precision", "bicubic_recall", "sr_consistency_mae", "bicubic_consistency_mae"}
    from ddpmrepro.model.superres import bicubic_upsample

    bicubic = bicubic_upsample(torch.from_numpy(s["low_res"]), 8).numpy()
    assert head["bicubic_psnr"] == pytest.approx(psnr(bicubic, truth))
    assert head["sr_psnr"] == pytest.approx(psnr(s["images"], truth))


@pytest.mark.parametrize("sampler, calls", [("ddim", 5), ("ddpm", 5), ("dpmpp_2m", 3), ("heun", 5)])
def test_the_upsampler_samples_with_the_sampler_of_sample_sampler(trained, tmp_path, monkeypatch, sampler, calls):
    """sample.sampler picks the solver (a fast one uses sample.nfe, ddpm/ddim sample.respacing), as
    for a base model: the network is called that many times per batch (w = 0.5 doubles the batch,
    not the calls), and the images stay reproducible per image."""
    from ddpmrepro.model.superres import SuperResUNet

    raw = yaml.safe_load((trained / "params.yaml").read_text())
    raw["sample"].update(sampler=sampler, respacing="ddim5", nfe=3 if sampler == "dpmpp_2m" else 5,
                         spacing="logsnr" if sampler != "heun" else "karras", batch_size=64)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    seen = []
    forward = SuperResUNet.forward
    monkeypatch.setattr(SuperResUNet, "forward", lambda self, x, *a, **k: seen.append(len(x)) or forward(self, x, *a, **k))
    cli("sample-superres", "--params", str(tmp_path / "p.yaml"), "--model", str(trained / "model"),
        "--data", str(trained / "data"), "--out", str(tmp_path / "s"))
    assert seen == [40] * calls  # 20 images, guided: one doubled batch per call


def test_with_project_the_output_downsampled_is_its_input(trained, tmp_path):
    """superres.project (a sampling key: the same trained model): every output, area-downsampled and
    rounded, is its uint8 input; without it this 12-step model is far from it."""
    shares = {}
    for project in (False, True):
        params = write_params(tmp_path / f"{project}.yaml", project=project)
        cli("sample-superres", "--params", str(params), "--model", str(trained / "model"),
            "--data", str(trained / "data"), "--out", str(tmp_path / str(project)))
        with np.load(tmp_path / str(project) / "samples.npz") as z:
            c = consistency(z["images"], z["low_res"])
            back = to_uint8(downsample(to_model_range(z["images"]), 4)).numpy().astype(int)
            shares[project] = (c["consistency_mae"], np.abs(back - z["low_res"]).max())
    assert shares[True] == (0.0, 0)  # within rounding: rounding each pixel moves a block mean by < 0.5 level
    assert shares[False][0] > 2.0


def test_sample_superres_takes_its_cpu_cores_as_the_other_torch_stages_do(trained, tmp_path, monkeypatch):
    """Found from outside: the cascade's heaviest stage took no cpu_slots share and ran beside a
    training that held every core."""
    import torch

    from ddpmrepro.runtime import cpu_slots

    claims = []
    monkeypatch.setattr(cpu_slots, "claim", lambda nproc=1, **kw: claims.append(nproc) or [])
    cli("sample-superres", "--params", str(write_params(tmp_path / "p.yaml")), "--model", str(trained / "model"),
        "--data", str(trained / "data"), "--out", str(tmp_path / "s"))
    assert claims == ([] if torch.cuda.device_count() else [1])
    assert (tmp_path / "s" / "samples.npz").is_file()


@pytest.mark.slow
def test_the_cascade_upsamples_a_base_runs_samples(trained, tmp_path):
    g = np.random.default_rng(0)
    base = {"images": g.integers(0, 256, (5, 1, 4, 4), dtype=np.uint8), "labels": np.array([0, 3, 3, 9, 1]),
            "seeds": np.arange(5)}
    np.savez(tmp_path / "base.npz", **base)
    params = write_params(tmp_path / "p.yaml", low_res_from=str(tmp_path / "base.npz"))
    cli("sample-superres", "--params", str(params), "--model", str(trained / "model"), "--out", str(tmp_path / "c"))
    with np.load(tmp_path / "c" / "samples.npz") as z:
        assert z["images"].shape == (5, 1, 8, 8) and not bool(z["from_test"])
        assert np.array_equal(z["low_res"], base["images"]) and np.array_equal(z["labels"], base["labels"])
    # a base run at the wrong size is refused in one line, nothing written
    np.savez(tmp_path / "big.npz", images=np.zeros((2, 1, 8, 8), np.uint8), labels=np.zeros(2, np.int64))
    params = write_params(tmp_path / "q.yaml", low_res_from=str(tmp_path / "big.npz"))
    result = CliRunner().invoke(main, ["sample-superres", "--params", str(params), "--model", str(trained / "model"),
                                       "--out", str(tmp_path / "d")])
    assert result.exit_code != 0 and "the upsampler takes (1, 4, 4)" in result.output
    assert not (tmp_path / "d").exists()


def _base(tmp_path, name, **arrays):
    g = np.random.default_rng(0)
    base = {"images": g.integers(0, 256, (3, 1, 4, 4), dtype=np.uint8), "labels": np.array([0, 3, 9]), **arrays}
    np.savez(tmp_path / name, **{k: v for k, v in base.items() if v is not None})
    return tmp_path / name


@pytest.mark.parametrize("arrays, words", [
    ({"labels": np.full(3, -1)}, "holds an unconditional model's samples (labels -1), and this upsampler is class-conditional"),
    ({"labels": np.array([0, 3, 99])}, "label 99 is not a class of the 10"),
    ({"labels": np.array([0, -3, 1])}, "label -3 is not a class of the 10"),
    ({"labels": np.array([0.5, 1.5, 2.5])}, "labels are float64 [3], not 3 whole numbers"),
    ({"labels": np.array([0, 1])}, "labels are int64 [2], not 3 whole numbers"),
    ({"images": np.zeros((3, 3, 4, 4), np.uint8)}, "holds images of shape (3, 4, 4), the upsampler takes (1, 4, 4)"),
    ({"images": np.zeros((0, 1, 4, 4), np.uint8), "labels": np.zeros(0, np.int64)}, "with N >= 1"),
    ({"labels": None}, "no labels array (images only)"),
    ("truncated", "unreadable (BadZipFile"),
    ("text", "not an .npz archive (a zip of .npy arrays"),  # was numpy's advice to load pickles
])
def test_a_bad_base_samples_file_is_one_line_exit_2_before_any_work(trained, tmp_path, arrays, words):
    """sample-superres --low-res-from a damaged or foreign samples.npz: IndexError and BadZipFile
    tracebacks before, or an upsampling of nonsense labels."""
    if arrays == "truncated":
        path = _base(tmp_path, "base.npz")
        path.write_bytes(path.read_bytes()[:100])
    elif arrays == "text":
        path = tmp_path / "base.npz"
        path.write_text("not a zip\n")
    else:
        path = _base(tmp_path, "base.npz", **arrays)
    params = write_params(tmp_path / "p.yaml", low_res_from=str(path))
    result = CliRunner().invoke(main, ["sample-superres", "--params", str(params), "--model", str(trained / "model"),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, (result.output, result.exception)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: ") and str(path) in line and words in line, line
    assert line.count(str(path)) == 1, line  # said once: "no labels array" was wrapped in "unreadable (...)"
    assert not (tmp_path / "out").exists()


def test_more_per_class_than_the_test_split_has_is_one_line_not_fewer_images(trained, tmp_path):
    """sample.per_class 150 of a test split with 100 of a class gave 100 per class, exit 0, and wrote
    params.yaml saying 150 (found from outside)."""
    labels = np.asarray(load_prepared(trained / "data").test_labels)
    fewest = int(np.bincount(labels).min())
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["sample"]["per_class"] = fewest + 1
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, ["sample-superres", "--params", str(tmp_path / "p.yaml"), "--model",
                                       str(trained / "model"), "--data", str(trained / "data"), "--out", str(tmp_path / "s")])
    assert result.exit_code == 2, (result.output, result.exception)
    (line,) = result.stderr.strip().splitlines()
    c = int(np.bincount(labels).argmin())
    assert line == (f"Error: sample.per_class: {fewest + 1}, but class {c} has {fewest} test "
                    f"images in {trained / 'data'} (superres.low_res_from: test); lower it to {fewest} or less"), line
    assert not (tmp_path / "s").exists()


def test_a_damaged_superres_samples_file_is_one_line_for_evaluate_superres(trained, tmp_path):
    params = write_params(tmp_path / "p.yaml", low_res_from=str(_base(tmp_path, "base.npz")))
    cli("sample-superres", "--params", str(params), "--model", str(trained / "model"), "--out", str(tmp_path / "s"))
    good = dict(np.load(tmp_path / "s" / "samples.npz"))
    cases = {
        "source_index": ({**good, "from_test": np.array(True), "source_index": np.array([0, 1, 10**6])},
                         "source_index does not index the"),
        "labels": ({**good, "labels": good["labels"] + 99}, "label 99 is not a class of the 10"),
        "low_res": ({**good, "low_res": good["low_res"][:1]}, "low_res is uint8 [1, 1, 4, 4], not uint8 low-res images"),
        "missing": ({k: v for k, v in good.items() if k != "from_test"}, "no from_test array"),
    }
    for name, (arrays, words) in cases.items():
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / "samples.npz", **arrays)
        result = CliRunner().invoke(main, ["evaluate-superres", "--params", str(params), "--samples", str(tmp_path / name),
                                           "--data", str(trained / "data"), "--evaluator", str(trained / "evaluator"),
                                           "--out", str(tmp_path / name / "m.json"),
                                           "--detail", str(tmp_path / name / "d.json")])
        assert result.exit_code == 1, (name, result.output, result.exception)
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("Error: ") and words in line, (name, line)
        assert not (tmp_path / name / "m.json").exists()


@pytest.mark.parametrize("raw, message", [
    ({"superres": {"low_res": 8}}, "superres.low_res: 8 is not below data.image_size (8)"),
    ({"superres": {"noise_aug": 0.0}}, "superres.sample_noise_aug: 0.1 is above superres.noise_aug"),
])
def test_bad_superres_params_name_the_key(raw, message):
    with pytest.raises(P.ParamsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        P.from_dict(raw)


def test_ssim_equals_a_direct_window_by_window_computation():
    g = np.random.default_rng(1)
    a = g.integers(0, 256, (2, 3, 13, 13), dtype=np.uint8)
    b = np.clip(a.astype(int) + g.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    r = np.arange(11) - 5
    w = np.exp(-r**2 / (2 * 1.5**2))
    w = np.outer(w, w) / w.sum() ** 2
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    vals = []
    for img in range(2):
        for ch in range(3):
            x, y = a[img, ch].astype(np.float64), b[img, ch].astype(np.float64)
            for i in range(13 - 10):
                for j in range(13 - 10):
                    px, py = x[i:i + 11, j:j + 11], y[i:i + 11, j:j + 11]
                    mx, my = (w * px).sum(), (w * py).sum()
                    vx, vy = (w * (px - mx) ** 2).sum(), (w * (py - my) ** 2).sum()
                    cxy = (w * (px - mx) * (py - my)).sum()
                    vals.append((2 * mx * my + c1) * (2 * cxy + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    assert ssim(a, b) == pytest.approx(np.mean(vals), rel=1e-9)
    assert ssim(a, a) == pytest.approx(1.0)


def test_psnr_and_consistency_closed_forms():
    a = np.full((2, 1, 8, 8), 100, np.uint8)
    b = a.copy()
    b[:, :, 0, 0] = 110  # MSE = 100 / 64 per image
    assert psnr(a, b) == pytest.approx(10 * np.log10(255**2 / (100 / 64)))
    # the true image is consistent with its own downsampled, rounded version: error 0
    g = np.random.default_rng(2)
    hi = g.integers(0, 256, (4, 1, 8, 8), dtype=np.uint8)
    low = to_uint8(downsample(to_model_range(hi), 4)).numpy()
    c = consistency(hi, low)
    assert c["consistency_mae"] == 0 and c["consistent_share"] == 1.0


def test_the_cascade_pipeline_names_real_commands_options_and_params():
    """cascade/dvc.yaml (the second pipeline): its params files load, and every stage's command
    parses with this CLI (unknown options would be refused before --help prints)."""
    root = Path(__file__).resolve().parents[1] / "cascade"
    base, up = P.load(root / "base.yaml"), P.load(root / "upsampler.yaml")
    assert up.superres.low_res == base.data.image_size and up.data.image_size == 2 * base.data.image_size
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        for entry in stage.get("params", []):  # DVC refuses a stage whose params key is not in the file
            for file, keys in entry.items():
                raw = yaml.safe_load((root / file).read_text())
                for key in keys:
                    section, _, sub = key.partition(".")
                    assert section in raw and (not sub or sub in raw[section]), (name, file, key)
        args = stage["cmd"].split()
        args = args[args.index("ddpmrepro.cli") + 1:]
        result = CliRunner().invoke(main, [*args, "--help"])
        assert result.exit_code == 0, (name, result.output)


@pytest.mark.slow
def test_the_cascade_runs_as_snakemake_jobs_that_dvc_records(tmp_path):
    """`cd cascade && snakemake --cores 2` on shrunk settings, in a fresh git repo: every stage runs
    as a job through `dvc repro --single-item`, both metrics files get the model's and bicubic's
    numbers, DVC then finds everything up to date, and a second Snakemake has nothing to do."""
    import shutil
    import subprocess

    from project_copy import BIN, copy_project, deep_update, run

    repo = copy_project(tmp_path / "repo")
    source = Path(__file__).resolve().parents[1] / "cascade"
    # The folder's own files only: not the outputs or the DVC cache of a cascade run in this checkout.
    shutil.copytree(source, repo / "cascade", ignore=lambda d, names: [
        n for n in names if Path(d) == source and n not in {".dvc", ".dvcignore", "dvc.yaml", "Snakefile",
                                                            "base.yaml", "upsampler.yaml"}
    ] + [n for n in names if Path(d) == source / ".dvc" and n in {"cache", "tmp"}])
    small = {"model": {"channels": 16, "num_head_channels": 16, "attention_resolutions": []},
             "diffusion": {"timesteps": 20},
             "train": {"steps": 3, "batch_per_proc": 8, "warmup_steps": 1, "checkpoint_every": 3, "log_every": 1},
             "sample": {"per_class": 1, "respacing": "ddim3", "batch_size": 64},
             "evaluator": {"epochs": 1}}
    for name in ("base.yaml", "upsampler.yaml"):
        path = repo / "cascade" / name
        path.write_text(yaml.safe_dump(deep_update(yaml.safe_load(path.read_text()), small), sort_keys=False))
    run(repo, "git", "init", "-q", "-b", "main")
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "the cascade, shrunk")
    cascade = repo / "cascade"
    out = run(cascade, str(Path(BIN) / "snakemake"), "--cores", "2").stderr
    for stage in yaml.safe_load((cascade / "dvc.yaml").read_text())["stages"]:
        assert f"rule {stage}:" in out, stage
    for name in ("metrics_test.json", "metrics_cascade.json"):
        metrics = json.loads((cascade / name).read_text())
        for key in ("fid", "consistency_mae"):
            assert isinstance(metrics[f"sr_{key}"], float) and isinstance(metrics[f"bicubic_{key}"], float), name
    assert "sr_psnr" in json.loads((cascade / "metrics_test.json").read_text())
    assert "up to date" in run(cascade, "dvc", "status").stdout
    assert "Nothing to be done" in run(cascade, str(Path(BIN) / "snakemake"), "--cores", "2").stderr


@pytest.mark.slow
def test_an_unconditional_upsampler_trains_samples_and_is_scored(trained, tmp_path):
    """model.class_cond: false with superres.low_res (issue 31, item 2): it used to pass check-params
    and fail at step 1 ("labels y are required"): the upsampler was built with a label table."""
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["model"]["class_cond"] = False
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw))
    cli("check-params", "--params", str(params_path), "--out", str(tmp_path / "resolved"))
    cli("train", "--params", str(params_path), "--data", str(trained / "data"), "--out", str(tmp_path / "model"),
        "--live", str(tmp_path / "live"), "--introspect", str(tmp_path / "introspect"),
        "--checkpoints", str(tmp_path / "ckpt"))
    from ddpmrepro.evaluation.sample import load_model

    model, _, _ = load_model(tmp_path / "model", 0.9)
    assert model.label_embed is None and model.input_blocks[0][0].in_channels == 2  # unconditional, 2C inputs
    cli("sample-superres", "--params", str(params_path), "--model", str(tmp_path / "model"),
        "--data", str(trained / "data"), "--out", str(tmp_path / "s"))
    with np.load(tmp_path / "s" / "samples.npz") as z:
        assert z["images"].shape == (20, 1, 8, 8)
    cli("evaluate-superres", "--params", str(params_path), "--samples", str(tmp_path / "s"),
        "--data", str(trained / "data"), "--evaluator", str(trained / "evaluator"),
        "--out", str(tmp_path / "m.json"), "--detail", str(tmp_path / "d.json"))
    head = json.loads((tmp_path / "m.json").read_text())
    assert np.isfinite(head["sr_psnr"]) and np.isfinite(head["sr_fid"])


@pytest.mark.slow
def test_an_upsampler_samples_in_bf16_near_its_fp32_images(trained, tmp_path):
    """sample.precision and sample.channels_last reach sample-superres: the images move by the
    network's rounding only (NHWC: within one uint8 level)."""
    images = {}
    for name, sample in (("fp32", {}), ("bf16", {"precision": "bf16"}), ("nhwc", {"channels_last": True})):
        raw = yaml.safe_load((trained / "params.yaml").read_text())
        raw["sample"].update(sample)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        cli("sample-superres", "--params", str(tmp_path / f"{name}.yaml"), "--model", str(trained / "model"),
            "--data", str(trained / "data"), "--out", str(tmp_path / name))
        with np.load(tmp_path / name / "samples.npz") as z:
            images[name] = z["images"].astype(int)
        assert yaml.safe_load((tmp_path / name / "params.yaml").read_text())["sample"]["channels_last"] == (name == "nhwc")
    diff = np.abs(images["bf16"] - images["fp32"])
    print(f"bf16 upsampling against fp32: mean uint8 difference {diff.mean():.3f}, max {diff.max()}, "
          f"equal {(diff == 0).mean():.3f}")
    assert diff.max() > 0 and diff.mean() < 2.0
    nhwc = np.abs(images["nhwc"] - images["fp32"])
    print(f"NHWC upsampling against NCHW: mean uint8 difference {nhwc.mean():.4f}, max {nhwc.max()}")
    assert nhwc.max() <= 1
