"""The benchmark scripts still run and report what they claim (smallest settings; no timing asserted)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(script: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_train_step_benchmark_compares_the_same_model_in_each_loop(tmp_path):
    out = tmp_path / "train.json"
    run("train_step.py", "--batch", "8", "--steps", "2", "--warmup", "2", "--repeats", "2",
        "--modes", "ddpmrepro,plain", "--out", str(out))
    r = json.loads(out.read_text())
    med = {m: v["median"] for m, v in r["images_per_sec"].items()}
    assert set(med) == {"ddpmrepro", "plain"} and all(v > 0 for v in med.values())
    assert all(len(v["all"]) == 2 for v in r["images_per_sec"].values())
    assert r["step_time_ratio_vs_plain"]["ddpmrepro"] == pytest.approx(med["plain"] / med["ddpmrepro"])
    assert r["params"]["plain"] == 457_761  # the default tiny UNet


def test_sample_speed_benchmark_reports_overhead_over_bare_forwards(tmp_path):
    out = tmp_path / "sample.json"
    run("sample_speed.py", "--batch", "4", "--repeats", "1", "--samplers", "ddim50", "--out", str(out))
    r = json.loads(out.read_text())["samplers"]["ddim50"]
    assert r["steps"] == 50 and r["forward_batch"] == 8  # guidance doubles the batch
    ips = r["images_per_sec"]
    assert r["overhead_pct"] == pytest.approx(100 * (ips["bare"] / ips["ddpmrepro"] - 1))
