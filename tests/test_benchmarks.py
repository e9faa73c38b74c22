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


def test_data_scale_benchmark_measures_every_stage_and_writes_its_json(tmp_path):
    out = tmp_path / "data_scale.json"
    run("data_scale.py", "--root", str(tmp_path / "ds"), "--sizes", "300", "--batch", "8", "--train-steps", "2",
        "--pair-steps", "1", "--rounds", "1", "--threads", "1", "--test-fraction", "0.1", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["command"].startswith("PYTHONPATH=src python benchmarks/data_scale.py") and "--sizes 300" in r["command"]
    (s,) = r["sizes"]
    assert s["n"] == 300 and s["n_train"] == 270 and s["generate"]["reused"] is False
    assert s["prepare"]["images_per_s"] > 0 and s["prepare"]["peak_rss_mb_main"] > 0 and s["prepare"]["shards"] == 2
    load = s["load"]
    assert load["cold"]["hashed_bytes"] == load["data_bytes"] > 270 * 3072  # no stamp: every shard hashed
    assert load["warm"]["hashed_bytes"] == 0  # the cold run's stamps, read by another process
    assert s["train"]["steps"] == 2 and s["train"]["peak_rss_mb"] > 0
    st = s["step_time"]
    for name, key in (("step_time", "step_s_median_per_round"), ("cpu_time", "main_thread_cpu_s_median_per_round")):
        shards, memory = st[key]["shards"][0], st[key]["memory"][0]
        assert shards > 0 and memory > 0 and st[f"{name}_ratio_per_round"] == [pytest.approx(shards / memory)]
    assert len(st["reader_thread_cpu_s_per_run"]) == 1 and st["threads"] == 1
    assert s["dvc"]["link_counts"] == [3]  # the benchmark's copy, the repo's workspace and DVC's cache: one inode
    assert s["dvc"]["repo_bytes_on_disk"] < 1.5 * s["dvc"]["data_bytes"]
    assert not (tmp_path / "ds" / "prepared-300").exists() and (tmp_path / "ds" / "raw-300" / ".complete").exists()
