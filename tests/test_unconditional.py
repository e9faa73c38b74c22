"""An unconditional model (`model.class_cond: false`) end to end: train, sample, evaluate.

Most published DDPM/IDDPM checkpoints are unconditional, so the pipeline must carry one through
without inventing labels: the samples are labelled -1 (conditioned on nothing) and evaluate
reports class accuracy as null (not applicable), never as a 0 that reads like broken conditioning.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from ddpmrepro import params as P
from ddpmrepro.data import prepare

SRC = Path(__file__).resolve().parents[1] / "src"
UNCOND = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16, "class_cond": False},
    "diffusion": {"timesteps": 20},
    "train": {"steps": 3, "batch_per_proc": 16, "ema_rates": [0.9]},
    "sample": {"ema_rate": 0.9, "per_class": 2, "respacing": "ddim4", "guidance": 0.5},
    "evaluator": {"epochs": 1},
    "evaluate": {"bpd_images": 2},
}


def cli(*args, cwd: Path):
    proc = subprocess.run([sys.executable, "-m", "ddpmrepro.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_an_unconditional_model_trains_samples_and_evaluates_with_class_accuracy_not_applicable(tmp_path):
    from safetensors.torch import load_file

    prepare(P.DataParams(), tmp_path / "data")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(UNCOND))
    cli("train", "--data", "data", "--out", "model", "--live", "live", "--introspect", "intro",
        "--checkpoints", "ckpt", cwd=tmp_path)
    weights = load_file(str(tmp_path / "model" / "ema_0.9.safetensors"))
    assert not any(k.startswith("label_embed") for k in weights)  # no label table at all

    cli("sample", "--model", "model", "--out", "samples", cwd=tmp_path)
    with np.load(tmp_path / "samples" / "samples.npz") as z:
        assert z["images"].shape == (20, 1, 8, 8)  # per_class x classes of the data, as for a conditional model
        assert (z["labels"] == -1).all()

    cli("fit-evaluator", "--data", "data", "--out", "evaluator", cwd=tmp_path)
    cli("evaluate", "--samples", "samples", "--data", "data", "--evaluator", "evaluator", "--model", "model",
        "--out", "metrics.json", "--detail", "detail.json", cwd=tmp_path)
    headline = json.loads((tmp_path / "metrics.json").read_text())
    assert "class_acc" in headline and headline["class_acc"] is None
    assert list(headline)[0] == "class_acc" and headline["fid"] > 0 and headline["bpd"] > 0
    detail = json.loads((tmp_path / "detail.json").read_text())
    assert detail["samples"]["conditional"] is False and detail["samples"]["accuracy"] is None

    # Labels that are neither classes nor all -1 are refused in one line, and the metrics stay: they
    # were scored, exit 0, and a float label gave a class accuracy of 0.
    before = (tmp_path / "metrics.json").read_bytes()
    good = dict(np.load(tmp_path / "samples" / "samples.npz"))
    for labels, words in ((np.r_[good["labels"][:-1], 99], "label -1 is not a class of the 10 (nor all -1"),
                          (good["labels"] + 0.5, "labels are float64 [20], not 20 whole numbers")):
        np.savez(tmp_path / "samples" / "samples.npz", **{**good, "labels": labels})
        proc = subprocess.run([sys.executable, "-m", "ddpmrepro.cli", "evaluate", "--samples", "samples", "--data",
                               "data", "--evaluator", "evaluator", "--model", "model", "--out", "metrics.json",
                               "--detail", "detail.json"], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}, timeout=600)
        assert proc.returncode == 1 and proc.stderr.startswith("Error: samples/samples.npz: ") and words in proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert (tmp_path / "metrics.json").read_bytes() == before
