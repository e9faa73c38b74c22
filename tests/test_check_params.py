"""The check_params stage: params.yaml validated and resolved before any other stage runs.

Through the real CLI; the end-to-end behaviour under DVC and Snakemake is in test_pipeline.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpmrepro.params import Params, from_dict
from ddpmrepro.pipeline.check_params import check_params_file

SRC = Path(__file__).resolve().parents[1] / "src"


def check(tmp_path: Path, params: str, name: str = "params.yaml") -> subprocess.CompletedProcess:
    (tmp_path / name).write_text(params)
    return subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "check-params", "--params", name, "--out", "resolved"],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})


def test_writes_every_section_resolved_and_rewrites_only_what_changed(tmp_path):
    assert check(tmp_path, "train:\n  lr: 0.001\n").returncode == 0
    files = {p.stem: p for p in (tmp_path / "resolved").glob("*.yaml")}
    assert set(files) == set(Params().to_dict())
    expected = from_dict({"train": {"lr": 0.001}}).to_dict()
    for name, path in files.items():
        assert yaml.safe_load(path.read_text()) == {name: expected[name]}  # defaults filled in
    mtimes = {name: p.stat().st_mtime_ns for name, p in files.items()}
    os.utime(files["data"], ns=(1, 1))  # a rewrite would show as a new mtime
    proc = check(tmp_path, "train:\n  lr: 0.002\n  steps: 1500\n")
    assert proc.returncode == 0 and "1 resolved section file(s) updated" in proc.stdout
    assert files["data"].stat().st_mtime_ns == 1
    assert yaml.safe_load(files["train"].read_text())["train"]["lr"] == 0.002
    assert all(files[n].stat().st_mtime_ns == mtimes[n] for n in mtimes if n not in ("train", "data"))


@pytest.mark.parametrize("params, message", [
    ("train:\n  bogus_key: 1\n", "params.yaml: train.bogus_key: unknown key"),
    ("trian:\n  lr: 0.1\n", "params.yaml: trian: unknown key"),
    ("sample:\n  eta: lots\n", "params.yaml: sample.eta: expected a number"),
    ("train: [\n", "params.yaml: line"),
    ("train:\n  timestep_sampler: output-grad-nrm\n", "params.yaml: train.timestep_sampler: 'output-grad-nrm' "
                                                      "is not one of uniform | loss-second-moment | grad-norm | "
                                                      "output-grad-norm"),
])
def test_a_bad_file_is_one_line_exit_2_and_leaves_the_resolved_files_alone(tmp_path, params, message):
    assert check(tmp_path, "{}\n").returncode == 0
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "resolved").iterdir()}
    proc = check(tmp_path, params)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith(f"Error: {message}") and len(proc.stderr.splitlines()) == 1
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "resolved").iterdir()} == before


def test_the_snakefile_check_exits_like_the_stages(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("train:\n  bogus_key: 1\n")
    with pytest.raises(SystemExit) as e:
        check_params_file(tmp_path / "params.yaml")
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"Error: {tmp_path / 'params.yaml'}: train.bogus_key: unknown key")
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.001\n")
    assert check_params_file(tmp_path / "params.yaml").train.lr == 0.001
    # An upsampler in the project's pipeline, whose sample stage takes base models: refused as check-params does.
    (tmp_path / "params.yaml").write_text("superres:\n  low_res: 4\n")
    with pytest.raises(SystemExit):
        check_params_file(tmp_path / "params.yaml")
    assert "superres.low_res: 4 would train an upsampler" in capsys.readouterr().err


def test_the_snakefile_refreshes_the_directory_the_stage_writes():
    root = Path(__file__).resolve().parents[1]
    cmd = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["check_params"]["cmd"].split()
    assert f'check_params_file("params.yaml", "{cmd[cmd.index("--out") + 1]}"' in (root / "Snakefile").read_text()


def test_the_snakefile_check_brings_the_resolved_files_up_to_date(tmp_path):
    (tmp_path / "params.yaml").write_text("sample:\n  guidance: 1.5\n")
    check_params_file(tmp_path / "params.yaml", tmp_path / "resolved")
    assert yaml.safe_load((tmp_path / "resolved/sample.yaml").read_text())["sample"]["guidance"] == 1.5
    assert len(list((tmp_path / "resolved").glob("*.yaml"))) == len(Params().to_dict())  # one per section


# --- every refusal that depends on params.yaml alone runs in check_params ---------------------------
# A stage's own refusal comes after DVC has removed that stage's outputs (and after every stage
# before it ran): `train.posthoc_ema: []` with `sample.ema_length: 0.08` used to retrain the model,
# then fail in `sample`. The rule, enforced: every `raise ParamsError` in a stage's code is listed
# here by file and function, each either with a params file that check-params refuses naming the
# same key, or with what else it depends on (a model directory, the data, an input file) that
# check-params cannot read. A new refusal fails `test_every_stage_refusal_is_listed` until it is.

SRC_PACKAGE = SRC / "ddpmrepro"
BY_PARAMS = {  # site -> [(params.yaml, the key the one line names)]
    "evaluation/sample.py:check_guidance#1": [({"train": {"label_dropout": 0.0}, "sample": {"guidance": 0.5}},
                                               "sample.guidance")],
    "model_dir.py:load_model": [({"sample": {"ema_rate": 0.99}}, "sample.ema_rate")],
    "model_dir.py:check_snapshots#0": [({"train": {"posthoc_ema": []}, "sample": {"ema_length": 0.08}},
                                        "sample.ema_length=0.08")],
    # (the model directory solves again with the updates the run made: fp16's skipped steps lower them)
    "model_dir.py:reconstruct#1": [({"sample": {"ema_length": 0.02}}, "sample.ema_length=0.02"),
                                   ({"sample": {"ema_length": 0.2, "ema_step": 47}}, "sample.ema_length=0.2, "
                                                                                      "sample.ema_step=47")],
    "evaluation/superres.py:sample_superres#1": [({"data": {"image_size": 28}, "superres": {"low_res": 12,
                                                                                             "project": True}},
                                                  "superres.project")],
    # (the project's pipeline samples with `ddpmrepro sample`; the cascade's files are not params.yaml)
    "evaluation/sample.py:sample": [({"superres": {"low_res": 4}}, "superres.low_res")],
    "evaluation/superres.py:sample_superres#2": [({"superres": {"noise_aug": 0.1, "sample_noise_aug": 0.2}},
                                                  "superres.sample_noise_aug")],
    "training/recording.py:gradient_recorders#0": [({"introspect": {"params": ["nothing.*"]}},
                                                       "introspect.params")],
    "training/recording.py:gradient_recorders#1": [({"introspect": {"modules": ["out", "bogus"]}},
                                                       "introspect.modules")],
    # (it said introspect.modules, a key the user had not touched)
    "training/recording.py:gradient_recorders#2": [({"introspect": {"dump_steps": [1], "dump_modules": ["nope"]}},
                                                       "introspect.dump_modules")],
    "training/recording.py:gradient_recorders#3": [({"introspect": {"dump_steps": [1], "dump_modules": ["out.0"]}},
                                                       "introspect.dump_modules")],
    # grad-norm steering only where its history can fill (the run's draws replayed: step 161 on the defaults)
    "training/timestep_sampler.py:check_steers#0": [({"train": {"timestep_sampler": "grad-norm", "steps": 100}},
                                                      "train.timestep_sampler")],
    "training/timestep_sampler.py:check_steers#1": [
        ({"train": {"timestep_sampler": "grad-norm"}, "introspect": {"every": 0, "steps": [1]}},
         "train.timestep_sampler"),
        ({"train": {"timestep_sampler": "grad-norm"}, "introspect": {"noise_levels_every": 1500}},
         "train.timestep_sampler")],
    # output-grad-norm only where its history fills before the last step (loss-second-moment: a note)
    "training/timestep_sampler.py:check_history_fills": [
        ({"train": {"timestep_sampler": "output-grad-norm", "steps": 150}}, "train.timestep_sampler")],
    "training/noise_levels.py:bucket_layout": [
        ({"introspect": {"noise_bucket_space": "logsnr", "noise_bucket_edges": [100.0]}},
         "introspect.noise_bucket_edges"),
        ({"introspect": {"noise_bucket_space": "logsnr", "noise_bucket_edges": [10.0]}},
         "introspect.noise_bucket_edges"),
        ({"introspect": {"noise_bucket_space": "logsnr", "noise_buckets": 64}}, "introspect.noise_buckets"),
        ({"introspect": {"noise_bucket_edges": [10.0]}}, "introspect.noise_bucket_edges"),
        ({"introspect": {"noise_bucket_edges": [600.0, 300.0]}}, "introspect.noise_bucket_edges")],
}
BY_OTHER_INPUTS = {  # site -> what it reads besides params.yaml
    "model_dir.py:list_snapshots": "the snapshot files' metadata",
    "model_dir.py:check_snapshots#1": "the snapshot files (of another run)",
    "model_dir.py:check_snapshots#2": "the snapshot files (a foreign one)",
    "model_dir.py:check_snapshots#3": "the snapshot files (one missing)",
    "model_dir.py:reconstruct#0": "the snapshots' update counts (every step skipped under fp16)",
    "model_dir.py:reconstruct#2": "the snapshot files' tensors",
    "evaluation/sample.py:check_guidance#0": "the imported model's config.json (whether it has a trained null label)",
    "evaluation/superres.py:low_res_inputs#0": "the command line (--data)",
    "evaluation/superres.py:low_res_inputs#1": "the prepared data's image size",
    "evaluation/superres.py:low_res_inputs#2": "the prepared data's test images per class (sample.per_class)",
    "evaluation/superres.py:low_res_inputs#3": "the file superres.low_res_from names",
    "evaluation/superres.py:low_res_inputs#4": "the file superres.low_res_from names",
    "evaluation/superres.py:low_res_inputs#5": "the file superres.low_res_from names",
    "evaluation/superres.py:sample_superres#0": "which command samples the model (see evaluation/sample.py)",
    "training/loop.py:train": "the prepared data's size: checked where the manifest is there "
                              "(test_batch_larger_than_the_prepared_data_is_refused_where_the_manifest_is_there) and "
                              "from an image folder's listing (test_batch_larger_than_an_image_folder_is_refused_"
                              "before_prepare_runs); a torchvision source's size is prepare's to know",
}


def stage_refusal_sites() -> list[str]:
    """`file:function` (`#i`: the i-th in that function) of every `raise ParamsError` outside params.py
    and this check itself."""
    import ast

    sites = []
    for path in sorted(SRC_PACKAGE.rglob("*.py")):
        rel = path.relative_to(SRC_PACKAGE).as_posix()
        if rel in ("params.py", "pipeline/check_params.py"):
            continue
        tree = ast.parse(path.read_text())
        found: dict[str, int] = {}

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                inner = f"{scope}.{child.name}" if scope and isinstance(child, (ast.FunctionDef, ast.ClassDef)) \
                    else getattr(child, "name", scope) if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else scope
                if isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call) and \
                        getattr(child.exc.func, "id", None) == "ParamsError":
                    found[scope] = found.get(scope, 0) + 1
                    sites.append((rel, scope, found[scope] - 1))
                visit(child, inner)

        visit(tree, "")
    counts = {(rel, scope): n for rel, scope, n in sites}
    return [f"{rel}:{scope}" + (f"#{i}" if counts[(rel, scope)] > 0 else "") for rel, scope, i in sites]


def test_every_stage_refusal_is_listed():
    sites = stage_refusal_sites()
    listed = set(BY_PARAMS) | set(BY_OTHER_INPUTS)
    assert not set(BY_PARAMS) & set(BY_OTHER_INPUTS)
    assert set(sites) == listed, (f"not listed (add a params case check-params refuses, or say what else it "
                                  f"reads): {sorted(set(sites) - listed)}; listed but gone: {sorted(listed - set(sites))}")


@pytest.mark.parametrize("raw, key", [case for cases in BY_PARAMS.values() for case in cases],
                         ids=[f"{site}-{i}" for site, cases in BY_PARAMS.items() for i in range(len(cases))])
def test_each_refusal_of_params_alone_fails_check_params_with_one_line(tmp_path, raw, key):
    assert check(tmp_path, "{}\n").returncode == 0
    before = {p: p.read_bytes() for p in (tmp_path / "resolved").iterdir()}
    # An upsampler's params are a file of the cascade's (params.yaml, the project pipeline's, refuses one).
    name = "upsampler.yaml" if raw.get("superres", {}).get("low_res") and key != "superres.low_res" else "params.yaml"
    proc = check(tmp_path, yaml.safe_dump(raw), name)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"Error: {name}: {key}"), proc.stderr
    assert {p: p.read_bytes() for p in (tmp_path / "resolved").iterdir()} == before


def test_the_default_patterns_match_every_preset_so_check_params_skips_building_the_model():
    """check_introspect_patterns builds the model (torch, seconds) only for patterns other than the
    defaults; this is what lets it skip them."""
    import torch

    from ddpmrepro.model.superres import build_superres
    from ddpmrepro.model.unet import PRESETS, build_unet
    from ddpmrepro.params import IntrospectParams
    from ddpmrepro.training.introspect import ActivationGradRecorder, ParamGradRecorder

    ip = IntrospectParams()
    for preset in PRESETS:
        for low_res in (0, 16):
            p = from_dict({"model": {"preset": preset}, "data": {"image_size": 32, "channels": 3},
                           "superres": {"low_res": low_res}})
            shape = dict(image_size=32, in_channels=3, num_classes=10, learn_sigma=True)
            with torch.device("meta"):
                model = build_superres(p.model, p.superres, **shape) if low_res else build_unet(p.model, **shape)
            assert ParamGradRecorder(model.named_parameters(), ip.params).names
            ActivationGradRecorder(model, ip.modules, dump_modules=ip.dump_modules).close()


def test_checking_params_whose_network_was_checked_imports_no_torch(tmp_path):
    """The Snakefile checks params.yaml every time Snakemake reads it. The network is built (torch,
    seconds) when a section it depends on differs from the resolved files of the last check that
    passed; an edit elsewhere (train.lr) is checked without torch."""
    code = ("import sys; from ddpmrepro.pipeline.check_params import check_params_file; "
            "check_params_file('params.yaml', 'resolved', write={write}); print('torch' in sys.modules)")

    def torch_imported(write: bool = True) -> bool:
        proc = subprocess.run([sys.executable, "-c", code.format(write=write)], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip() == "True"

    raw = yaml.safe_load((SRC.parent / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    # A job's parse (write=False: the Snakefile's in each job process, a process per SLURM job)
    # reads the resolved files and writes none: with none there, it builds the network, each time.
    assert torch_imported(write=False) and torch_imported(write=False)
    assert not (tmp_path / "resolved").exists()
    assert torch_imported()  # the main process: built, and the resolved files written
    assert not torch_imported() and not torch_imported(write=False)
    raw["train"]["lr"] = 1e-3
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert not torch_imported()
    raw["model"]["channels"] = 64
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert torch_imported() and not torch_imported()


@pytest.mark.parametrize("sample, diffusion", [({"sampler": "dpmpp_2m", "lambda_min": 10.0}, {}),
                                               ({"sampler": "unipc", "lambda_min": 4.7}, {"schedule": "linear"}),
                                               ({"sampler": "dpmpp_2m", "lambda_min": 0.0}, {}),
                                               ({"sampler": "heun", "lambda_min": -2.2}, {})])
def test_a_fast_solver_starting_short_of_pure_noise_is_refused_before_the_sample_stage(tmp_path, sample, diffusion):
    """Sampling starts from N(0, I): at lambda_min 0 the signal's scale there is 0.71, and 0 or 4.9 gave
    images an evaluator placed in their class 58% and 8% of the time, exit 0 (found from outside); a
    start at the clean end (10, above the table's top) sampled zeros. `sample` refuses it as well
    (params.load). samplers.sample_times still refuses a start at the top for its other callers."""
    raw = yaml.safe_load((SRC.parent / "params.yaml").read_text())
    raw["sample"].update(sample)
    raw["diffusion"].update(diffusion)
    proc = check(tmp_path, yaml.safe_dump(raw))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == f"Error: params.yaml: sample.lambda_min: must be <= -2.3, got {sample['lambda_min']!r}", lines[0]
    for fine in (-2.3, -5.1):
        raw["sample"]["lambda_min"] = fine
        assert check(tmp_path, yaml.safe_dump(raw)).returncode == 0


@pytest.mark.parametrize("model, data, words", [
    ({"num_head_channels": 7}, {}, "model: attention over 32 channels cannot be split into heads of 7"),
    ({"channel_mult": [1, 2, 2, 2, 2]}, {}, "model: image_size 8 is not divisible by 16, which 5 levels"),
    ({}, {"image_size": 9}, "model: image_size 9 is not divisible by "),
])
def test_a_network_train_would_refuse_is_refused_with_the_resolved_files_untouched(tmp_path, model, data, words):
    """These passed the check and DVC removed models/ddpm, the dvclive files and the gradient tables
    before train refused them (num_head_channels: 7 is a one-character edit of params.yaml)."""
    raw = yaml.safe_load((SRC.parent / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    check_params_file(tmp_path / "params.yaml", tmp_path / "resolved")
    before = {p: p.read_bytes() for p in (tmp_path / "resolved").iterdir()}
    raw["model"].update(model)
    raw["data"].update(data)
    proc = check(tmp_path, yaml.safe_dump(raw))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("Error: params.yaml: model: "), proc.stderr
    assert words in lines[0], lines[0]
    assert {p: p.read_bytes() for p in (tmp_path / "resolved").iterdir()} == before


@pytest.mark.parametrize("path", ["params.yaml", *sorted(f"configs/{p.name}" for p in (SRC.parent / "configs").glob("*.yaml")),
                                  "cascade/base.yaml", "cascade/upsampler.yaml"])
def test_every_params_file_of_the_project_passes_the_pipeline_check(path):
    from ddpmrepro.params import load
    from ddpmrepro.pipeline.check_params import check_pipeline

    check_pipeline(load(SRC.parent / path))


def test_batch_larger_than_the_prepared_data_is_refused_where_the_manifest_is_there(tmp_path):
    """train refuses a batch larger than a rank's share of the data; check-params sees it where the
    manifest prepare made from these very `data:` params is there (otherwise prepare runs first, and
    train refuses it itself)."""
    import json

    data = Params().to_dict()["data"]
    (tmp_path / "data/prepared").mkdir(parents=True)
    manifest = {"params": data, "num_classes": 10, "counts": {"train": [100] * 10, "test": [20] * 10}}
    (tmp_path / "data/prepared/manifest.json").write_text(json.dumps(manifest))
    assert check(tmp_path, "train: {batch_per_proc: 1000}\n").returncode == 0
    proc = check(tmp_path, "train: {batch_per_proc: 1001}\n")
    assert proc.returncode == 2 and proc.stderr.startswith("Error: params.yaml: train.batch_per_proc=1001 is larger "
                                                           "than this rank's 1000 training images"), proc.stderr
    assert check(tmp_path, "train: {batch_per_proc: 501, nproc: 2}\n").returncode == 2
    # a manifest of other data params: prepare remakes the data, so nothing is known yet
    assert check(tmp_path, "train: {batch_per_proc: 1001}\ndata: {split_seed: 1}\n").returncode == 0


@pytest.mark.parametrize("own_split", [False, True])
def test_batch_larger_than_an_image_folder_is_refused_before_prepare_runs(tmp_path, own_split):
    """Where prepare has yet to run, check-params counts an image folder's training images from its
    listing (the stratified split's rounding, or the folder's own train/), so that a first run on
    small own data is refused before DVC removes anything, not by train after prepare (it was).
    The count's truth is prepare's own manifest of the same folder."""
    from fake_datasets import fake_image_folder

    from ddpmrepro.data.prepared import prepare
    from ddpmrepro.params import ParamsError
    from ddpmrepro.pipeline.check_params import check_data_source

    raw = tmp_path / "raw"
    for cls, n in (("cat", 5), ("dog", 9), ("fox", 12)):
        for split, k in ((("train", n), ("test", 2)) if own_split else ((".", n),)):
            fake_image_folder(raw / split, classes=(cls,), per_class=k, seed=n + k)
    data = {"source": "image_folder", "root": str(raw), "test_fraction": 0.25, "image_size": 8}
    train_images = sum(prepare(from_dict({"data": data}).data, tmp_path / "elsewhere")["counts"]["train"])
    assert train_images == (26 if own_split else 4 + 7 + 9)
    for nproc, nodes in ((1, 1), (2, 1), (1, 2)):  # a rank's share: of every node's processes
        fits = train_images // (nproc * nodes)
        train = {"nproc": nproc, "nodes": nodes}
        check_data_source(from_dict({"data": data, "train": {"batch_per_proc": fits, **train}}), None)
        with pytest.raises(ParamsError, match=rf"^train.batch_per_proc={fits + 1} is larger than this rank's {fits} "
                                              rf"training images \({raw}, as prepare will split it\); lower it$"):
            check_data_source(from_dict({"data": data, "train": {"batch_per_proc": fits + 1, **train}}), None)
    if not own_split:  # the command, as DVC runs it: one line, exit 2, nothing made
        proc = check(tmp_path, yaml.safe_dump({"data": data, "train": {"batch_per_proc": train_images + 1}}))
        assert proc.returncode == 2 and proc.stderr == (
            f"Error: params.yaml: train.batch_per_proc={train_images + 1} is larger than this rank's {train_images} "
            f"training images ({raw}, as prepare will split it); lower it\n"), proc.stderr
    assert not (tmp_path / "data").exists()


def test_an_image_folder_that_changed_since_prepare_is_counted_from_its_listing_not_the_old_manifest(tmp_path):
    """The folder grew, and the batch was raised to what it now holds, in one edit: the manifest of
    data/prepared (from the same `data:` params, of the folder as it was) refused it, though prepare
    reruns first (the folder is its dependency, docs/DATA.md). The listing counts; the manifest only
    where the folder is not there (a DVC experiment's temporary clone: what train reads is that data)."""
    import shutil

    from fake_datasets import fake_image_folder

    from ddpmrepro.data.prepared import prepare

    raw = tmp_path / "raw"
    fake_image_folder(raw, classes=("cat", "dog"), per_class=4, seed=0)
    data = {"source": "image_folder", "root": str(raw), "test_fraction": 0.25, "image_size": 8}
    assert sum(prepare(from_dict({"data": data}).data, tmp_path / "data/prepared")["counts"]["train"]) == 6
    fake_image_folder(raw, classes=("cat", "dog"), per_class=8, seed=1)  # grown: 6 training images a class
    proc = check(tmp_path, yaml.safe_dump({"data": data, "train": {"batch_per_proc": 12}}))
    assert proc.returncode == 0, proc.stderr
    assert check(tmp_path, yaml.safe_dump({"data": data, "train": {"batch_per_proc": 13}})).returncode == 2
    for f in raw.glob("*/*"):  # shrunk to 2 a class, 1 for training: the old manifest's 6 would pass
        if f.stem >= "002":
            f.unlink()
    proc = check(tmp_path, yaml.safe_dump({"data": data, "train": {"batch_per_proc": 6}}))
    assert proc.returncode == 2 and f"({raw}, as prepare will split it)" in proc.stderr, proc.stderr
    shutil.rmtree(raw)  # gone: the prepared data is what train reads
    proc = check(tmp_path, yaml.safe_dump({"data": data, "train": {"batch_per_proc": 7}}))
    assert proc.returncode == 2 and "than this rank's 6 training images (data/prepared)" in proc.stderr, proc.stderr
    assert check(tmp_path, yaml.safe_dump({"data": data, "train": {"batch_per_proc": 6}})).returncode == 0


def test_grad_norms_schedule_is_checked_on_every_nodes_processes():
    """train.nodes multiplies the images a step, so the loss history fills sooner: a schedule that
    steers on two nodes was refused by the one-node replay (found from outside: 140 steps, buckets
    measured at step 100; one node fills at 161, two at 98)."""
    from ddpmrepro.params import ParamsError
    from ddpmrepro.pipeline.check_params import check_pipeline
    from ddpmrepro.training.timestep_sampler import steering_step

    base = {"train": {"steps": 140, "timestep_sampler": "grad-norm"},
            "introspect": {"every": 100, "steps": [], "noise_levels_every": 100}}
    for processes, fills in ((1, 161), (2, 98)):
        assert steering_step(seed=0, timesteps=1000, global_batch=128 * processes, grad_accum=1, steps=400) == fills
    with pytest.raises(ParamsError, match=r"is not full before the last step 140"):
        check_pipeline(from_dict(base))
    two_nodes = {**base, "train": {**base["train"], "nodes": 2}}
    check_pipeline(from_dict(two_nodes))
    check_pipeline(from_dict({**base, "train": {**base["train"], "nproc": 2}}))  # the same processes on one node


def test_raw_data_missing_in_a_dvc_experiments_temporary_clone_says_how_to_bring_it(tmp_path, monkeypatch):
    """DVC copies no DVC-tracked data into a queued experiment's clone (DVC issue 10744): where the
    data must be prepared again the line says `-C` (found from outside: it said only 'create it');
    where data/prepared holds the data prepared from these params, nothing is listed (train reads
    that), as in the workspace with the raw folder moved away."""
    import json

    from ddpmrepro.params import ParamsError
    from ddpmrepro.pipeline.check_params import check_data_source

    (tmp_path / "proj/.dvc").mkdir(parents=True)
    clone = tmp_path / "proj/.dvc/tmp/exps/tmpab12"
    (clone / ".dvc").mkdir(parents=True)
    monkeypatch.chdir(clone)
    params = from_dict({"data": {"source": "image_folder", "root": "data/raw/mine", "image_size": 8}})
    with pytest.raises(ParamsError, match=r"^data/raw/mine: data.root does not exist; .*; DVC does not copy "
                                          r"DVC-tracked data into an experiment's temporary clone \(DVC issue 10744\): "
                                          r"queue it with `-C data/raw/mine`, or run it in the workspace$"):
        check_data_source(params, clone / "data/prepared")
    (clone / "data/prepared").mkdir(parents=True)
    (clone / "data/prepared/manifest.json").write_text(json.dumps({"params": params.to_dict()["data"]}))
    check_data_source(params, clone / "data/prepared")  # the data as prepared from these params: nothing to list
    monkeypatch.chdir(tmp_path / "proj")  # the workspace: no DVC hint
    with pytest.raises(ParamsError, match=r"data.root does not exist; [^;]*$"):
        check_data_source(params, None)


def test_raw_data_it_may_not_read_is_one_line(tmp_path, monkeypatch):
    """check_data_source turns an OSError of the listing (a folder it may not read: root reads any,
    so the error is made here) into the one-line refusal every other check gives."""
    from ddpmrepro.data import prepared
    from ddpmrepro.params import ParamsError, from_dict
    from ddpmrepro.pipeline.check_params import check_data_source

    def denied(data):
        raise PermissionError(13, "Permission denied", "data/raw/mine/b")
    monkeypatch.setattr(prepared, "check_source", denied)
    params = from_dict({"data": {"source": "image_folder", "root": "data/raw/mine"}})
    with pytest.raises(ParamsError, match=r"^data/raw/mine/b: cannot be read \(Permission denied\); check its "
                                          r"permissions or fix data.root$"):
        check_data_source(params, tmp_path / "prepared")


def test_the_committed_resolved_sections_are_what_check_params_writes_for_params_yaml(tmp_path):
    """reports/params/ is git's (DVC's `cache: false`): a key added to the params without them
    committed anew leaves every fresh clone's check_params stale (found at the session's end:
    train.hflip was missing from the committed train.yaml)."""
    from ddpmrepro.params import load
    from ddpmrepro.pipeline.check_params import write_resolved

    root = Path(__file__).resolve().parents[1]
    write_resolved(load(root / "params.yaml"), tmp_path)
    committed = {f.name: f.read_text() for f in (root / "reports" / "params").glob("*.yaml")}
    assert committed == {f.name: f.read_text() for f in tmp_path.glob("*.yaml")}


def test_another_params_file_is_checked_without_overwriting_the_pipelines_resolved_sections(tmp_path):
    """`check-params -p configs/x.yaml` wrote x's sections into reports/params, the pipeline's
    (git-tracked, a DVC output): `dvc status` then showed changes until check_params reran (found
    from outside). Written only for ./params.yaml, or where --out says."""
    def run_check(*args):
        return subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "check-params", *args], cwd=tmp_path,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    (tmp_path / "params.yaml").write_text("train: {lr: 0.001}\n")
    (tmp_path / "other.yaml").write_text("train: {lr: 0.002}\n")
    proc = run_check("-p", "other.yaml")
    assert proc.returncode == 0 and proc.stdout == "other.yaml is valid (its resolved sections are written with --out DIR)\n"
    assert not (tmp_path / "reports").exists()
    assert run_check("-p", "other.yaml", "--out", "elsewhere").returncode == 0
    assert yaml.safe_load((tmp_path / "elsewhere/train.yaml").read_text())["train"]["lr"] == 0.002
    assert run_check().returncode == 0  # ./params.yaml: the pipeline's
    assert yaml.safe_load((tmp_path / "reports/params/train.yaml").read_text())["train"]["lr"] == 0.001
    assert run_check("-p", str(tmp_path / "params.yaml")).returncode == 0  # the same file, by another name


def test_conflict_steps_must_be_steps_whose_buckets_are_measured(tmp_path):
    """report.conflict_steps [5, 7] passed, and the report drew the first, middle and last measured
    steps in their place, saying nothing (found from outside). The truth of "measured": the training's
    own rule (`levels_measured_at`), here on every step of a short run."""
    from ddpmrepro.params import ParamsError, levels_measured_at
    from ddpmrepro.pipeline.check_params import check_conflict_steps

    base = {"train": {"steps": 60}, "introspect": {"every": 10, "noise_levels_every": 20, "steps": [1, 7]}}
    measured = [s for s in range(1, 61) if levels_measured_at(s, from_dict(base).introspect, last=60)]
    assert measured == [1, 7, 20, 40, 60]
    check_conflict_steps(from_dict({**base, "report": {"conflict_steps": measured}}))
    for step, nearest in ((5, "1 or 7"), (30, "20 or 40"), (61, "60"), (10, "7 or 20")):
        with pytest.raises(ParamsError, match=rf"^report.conflict_steps: step {step} is not one where the noise-level "
                                              rf"buckets are measured .*; the nearest: {nearest}$"):
            check_conflict_steps(from_dict({**base, "report": {"conflict_steps": [1, step]}}))
    with pytest.raises(ParamsError, match=r"^report.conflict_steps: the noise-level buckets are off"):
        check_conflict_steps(from_dict({"introspect": {"noise_buckets": 0}, "report": {"conflict_steps": [1]}}))
    proc = check(tmp_path, "report: {conflict_steps: [5]}\n")  # the command: one line, exit 2
    assert proc.returncode == 2 and proc.stderr.startswith("Error: params.yaml: report.conflict_steps: step 5 is not "), proc.stderr
