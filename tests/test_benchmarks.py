"""The benchmarks' timing statistics (on synthetic timings with known answers), and that each
script still runs at its smallest settings and writes the method and spread of every ratio
(no speed is asserted: timings belong in docs/BENCHMARKS.md, not in tests)."""
import json
import os
import statistics
import subprocess
import sys
from itertools import permutations
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import binom

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import timing  # noqa: E402

SPREAD_KEYS = {"median", "min", "max", "q1", "q3", "median_ci95", "n"}


# --- the statistics of benchmarks/timing.py ---------------------------------------------------

def test_spread_of_known_samples():
    s = timing.spread([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3, 1, 5, 2, 4, 5)
    s = timing.spread([4.0, 1.0, 3.0, 2.0])  # quartiles interpolate: 1 + 0.75 * (2 - 1), 3 + 0.25 * (4 - 3)
    assert (s["median"], s["q1"], s["q3"]) == (2.5, 1.75, 3.25)
    assert timing.spread([7.0]) | {"median_ci95": None} == {"median": 7, "min": 7, "max": 7, "q1": 7, "q3": 7,
                                                            "median_ci95": None, "n": 1}


def test_quartiles_agree_with_numpy_on_random_samples():
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 41):
        xs = rng.lognormal(size=n)
        s = timing.spread(list(xs))
        assert [s["q1"], s["median"], s["q3"]] == pytest.approx(np.percentile(xs, [25, 50, 75]))


def test_median_interval_rank_is_the_binomial_order_statistic():
    # Textbook values: n = 10 -> (x_2, x_9), n = 20 -> (x_6, x_15), n = 40 -> (x_14, x_27); none below 6.
    assert [timing.median_ci_rank(n) for n in (5, 6, 10, 20, 40)] == [0, 1, 2, 6, 14]
    for n in range(1, 120):
        k = timing.median_ci_rank(n)
        assert binom.cdf(k - 1, n, 0.5) <= 0.025 < binom.cdf(k, n, 0.5)
    xs = list(range(1, 21))
    assert timing.spread(xs)["median_ci95"] == [6, 15]


def test_median_interval_covers_the_true_median_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    hits = sum(lo <= np.log(2) <= hi for lo, hi in
               (timing.spread(list(rng.exponential(size=25)))["median_ci95"] for _ in range(4000)))
    assert 0.94 < hits / 4000 < 0.985  # exact coverage for n = 25: 1 - 2 P(B <= 7) = 0.957


def test_verdict_needs_the_whole_interval_on_one_side_of_the_target():
    around = lambda c, w: timing.spread([c + w * (i / 19 - 0.5) for i in range(20)])  # noqa: E731
    assert timing.verdict(around(1.02, 0.02), 1.05) == "met"
    assert timing.verdict(around(1.08, 0.02), 1.05) == "missed"
    assert timing.verdict(around(1.04, 0.1), 1.05) == "unresolved"  # median below, interval across
    assert timing.verdict(timing.spread([1.0, 1.0]), 1.05).startswith("unresolved (too few")


def test_round_orders_are_fresh_uniform_shuffles():
    names = ["a", "b", "c", "d"]
    orders = timing.round_orders(names, 480, seed=3)
    assert all(sorted(o) == names for o in orders)
    assert orders == timing.round_orders(names, 480, seed=3) != timing.round_orders(names, 480, seed=4)
    assert {tuple(o) for o in orders} == set(permutations(names))  # all 24 orders occur
    for pos in range(4):  # each name leads / trails about a quarter of the rounds (binomial sd ~9.5)
        counts = [sum(o[pos] == n for o in orders) for n in names]
        assert all(80 < c < 160 for c in counts), counts


class FakeMachine:
    """Blocks that take base[name] x drift[round] seconds on fake clocks; CPU time is 90% of wall."""

    def __init__(self, base: dict, drift: list[float]):
        self.base, self.drift, self.round, self.now, self.calls = base, drift, 0, 0.0, []

    def block(self, name):
        def run():
            self.calls.append(name)
            self.now += self.base[name] * (self.drift[self.round] if self.round < len(self.drift) else 1.0)
        return run

    def end_round(self, r, times):
        self.round = r + 1


def test_ratios_pair_blocks_of_the_same_round_under_drift():
    # The machine's speed changes 3x between rounds; `ours` is always 1.04x `ref` in the same round.
    base = {"ref": 1.0, "ours": 1.04, "other": 2.0}
    drift = [1.0, 3.0, 1.5, 0.8, 2.5, 1.1, 2.0]
    m = FakeMachine(base, drift)
    r = timing.paired_rounds({n: m.block(n) for n in base}, "ref", len(drift), warmup=2, seed=5,
                             wall_clock=lambda: m.now, cpu_clock=lambda: 0.9 * m.now, progress=m.end_round)
    assert m.calls[:6] == ["ref", "ref", "ours", "ours", "other", "other"]  # warm-up, untimed
    assert m.calls[6:] == [n for order in r["orders"] for n in order]  # the recorded orders were run
    for n in base:
        assert r["wall_s"][n]["per_round"] == pytest.approx([base[n] * d for d in drift])
        assert r["cpu_s"][n]["per_round"] == pytest.approx([0.9 * base[n] * d for d in drift])
    for key in ("ratio_wall", "ratio_cpu"):
        s = r[key]["ours"]
        assert s["min"] == pytest.approx(1.04) and s["max"] == pytest.approx(1.04) and set(s) == SPREAD_KEYS
    assert r["ratio_wall"]["ref"]["median"] == 1.0
    assert len(r["load1_per_round"]) == len(drift) and len(r["before"]["load_avg"]) == 3
    assert r["before"]["torch_threads"] >= 1 and r["reference"] == "ref" and r["rounds"] == len(drift)


def test_paired_rounds_rejects_an_unknown_reference():
    with pytest.raises(ValueError, match="reference"):
        timing.paired_rounds({"a": lambda: None}, "plain", 3)


# --- the scripts, end to end, at the smallest settings ----------------------------------------

def run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def table_rows(results: Path) -> list[str]:
    """benchmarks/tables.py's markdown rows for a results file (what the doc quotes)."""
    return [ln for ln in run("tables.py", str(results)).splitlines() if ln.startswith("| ") and "---" not in ln][1:]


def check_paired(t: dict, names: set, rounds: int, reference: str, threads: int) -> None:
    """A results JSON's timing block: per-round times of every contender, ratios that are exactly the
    per-round quotients, their spread, the thread count and the load before and after."""
    assert t["rounds"] == rounds and t["reference"] == reference and len(t["orders"]) == rounds
    assert all(sorted(o) == sorted(names) for o in t["orders"])
    assert t["before"]["torch_threads"] == t["after"]["torch_threads"] == threads
    assert len(t["before"]["load_avg"]) == len(t["after"]["load_avg"]) == 3
    for kind, ratio in (("wall_s", "ratio_wall"), ("cpu_s", "ratio_cpu")):
        assert set(t[kind]) == set(t[ratio]) == names
        for n in names:
            per_round = t[kind][n]["per_round"]
            assert len(per_round) == rounds and all(x > 0 for x in per_round)
            quotients = [a / b for a, b in zip(per_round, t[kind][reference]["per_round"])]
            assert set(t[ratio][n]) == SPREAD_KEYS
            assert t[ratio][n]["median"] == pytest.approx(statistics.median(quotients))
            assert t[ratio][n]["min"] == pytest.approx(min(quotients))


@pytest.mark.slow
def test_train_step_benchmark_pairs_ddpmrepro_with_the_plain_loop(tmp_path):
    out = tmp_path / "train.json"
    run("train_step.py", "--batch", "8", "--steps", "2", "--warmup", "1", "--rounds", "6", "--threads", "1",
        "--modes", "ddpmrepro,ddpmrepro+is,ddpmrepro+ogn,ddpmrepro+graphs,ddpmrepro+cl,plain,plain+cl",
        "--out", str(out))
    r = json.loads(out.read_text())
    names = {"ddpmrepro", "ddpmrepro+is", "ddpmrepro+ogn", "ddpmrepro+graphs", "ddpmrepro+cl", "plain", "plain+cl"}
    check_paired(r["timing"], names, 6, "plain", threads=1)
    assert r["threads"] == 1 and r["params"]["plain"] == 457_761  # the default tiny UNet
    assert r["step_time_ratio_vs_plain"]["ddpmrepro"] == r["timing"]["ratio_wall"]["ddpmrepro"]
    assert set(r["target"]["verdict"]) == {"ddpmrepro", "ddpmrepro+is", "ddpmrepro+ogn", "ddpmrepro+graphs",
                                           "ddpmrepro+cl"}
    assert r["timing"]["ratio_wall"]["plain+cl"]["median"] > 0  # the plain loop in NHWC: a contender, no target
    assert "--threads 1" in r["command"] and "--rounds 6" in r["command"]
    rows = table_rows(out)
    assert len(rows) == 7 and f"{r['timing']['ratio_wall']['ddpmrepro']['median']:.3f} [" in rows[0]


@pytest.mark.slow
def test_host_profile_reports_each_loops_step_time_and_its_ops():
    out = run("step_host_profile.py", "--device", "cpu", "--batch", "4", "--steps", "2", "--warmup", "1", "--top", "5")
    for mode in ("ddpmrepro", "plain"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"=== {mode}: "))
        assert float(line.split()[2]) > 0 and "ms/step" in line
    assert out.count("Self CPU time total") == 2 and "aten::convolution_backward" in out


def test_host_profile_charges_each_wait_to_the_python_line_that_caused_it():
    import warnings

    import step_host_profile

    class Loop:  # stands in for a training loop; each warning stands for one of CUDA's sync warnings
        def run(self, steps):
            for _ in range(steps):
                self.wait_twice()

        def wait_twice(self):
            warnings.warn("synchronizing", UserWarning)
            warnings.warn("synchronizing", UserWarning)

    lines = step_host_profile.synchronising_lines(Loop(), 3, debug_mode=lambda mode: None)
    first = Loop.wait_twice.__code__.co_firstlineno
    assert {where.split(" <- ")[0]: n for where, n in lines.items()} == {
        f"test_benchmarks.py:{first + 1}": 3, f"test_benchmarks.py:{first + 2}": 3}
    assert all(f"test_benchmarks.py:{Loop.run.__code__.co_firstlineno + 2}" in where for where in lines)


@pytest.mark.slow
def test_sample_speed_benchmark_pairs_generate_with_bare_forwards(tmp_path):
    out = tmp_path / "sample.json"
    run("sample_speed.py", "--batch", "4", "--rounds", "3", "--samplers", "ddim50", "--graphs", "--precision", "bf16",
        "--out", str(out))
    r = json.loads(out.read_text())
    s = r["samplers"]["ddim50"]
    assert s["steps"] == 50 and s["forward_batch"] == 8  # guidance doubles the batch
    check_paired(s["timing"], {"ddpmrepro", "bare", "ddpmrepro+graphs", "ddpmrepro+bf16", "ddpmrepro+bf16+graphs"}, 3,
                 "bare", threads=r["threads"])
    # on a CPU nothing is captured: the graphed path's images are eager's, bit for bit
    assert s["vs_eager"]["ddpmrepro+graphs"]["images"] == {"max_uint8_difference": 0, "identical": 1.0}
    # the network's output depends on its input (no layer left at zero), so bf16's rounding shows in the images
    bf16 = s["vs_eager"]["ddpmrepro+bf16"]["images"]
    assert bf16["max_uint8_difference"] > 0 and s["vs_eager"]["ddpmrepro+bf16+graphs"]["images"] == bf16
    assert s["overhead_pct"] == pytest.approx(100 * (s["time_ratio_vs_bare"]["median"] - 1))
    assert s["verdict"].startswith("unresolved (too few")  # 3 rounds cannot give a 95% interval
    (row,) = table_rows(out)
    assert f"{s['time_ratio_vs_bare']['median']:.3f} (" in row and row.endswith("| not resolved |")


@pytest.mark.slow
def test_growth_benchmark_times_each_row_against_the_first(tmp_path):
    out = tmp_path / "growth.json"
    run("growth.py", "--presets", "tiny", "--sizes", "8,16", "--batch", "4", "--steps", "1", "--rounds", "2",
        "--threads", "1", "--out", str(out))
    r = json.loads(out.read_text())
    check_paired(r["timing"], {"tiny@8px", "tiny@16px"}, 2, "tiny@8px", threads=1)
    first, second = r["rows"]
    assert first["step_time_ratio_vs_first"]["median"] == 1.0 and first["flop_ratio_vs_first"] == 1.0
    assert second["flop_ratio_vs_first"] == pytest.approx(4, rel=0.1)  # 4x the pixels, convolutions dominate
    assert second["images_per_sec"] == pytest.approx(4 / (r["timing"]["wall_s"]["tiny@16px"]["median"]))
    rows = table_rows(out)
    assert len(rows) == 2 and "| tiny | 16 px |" in rows[1]


@pytest.mark.slow
def test_paused_training_run_is_the_uninterrupted_run(tmp_path):
    """train_step.py times train() paused after every block: the pauses change nothing it computes."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file

    import ddpmrepro.training.loop as T
    import train_step
    from ddpmrepro import params as P
    from ddpmrepro.data import prepare

    torch.set_num_threads(1)
    prepare(P.DataParams(), tmp_path / "data")
    cfg = SimpleNamespace(image_size=8, channels=1, preset="tiny", batch=8, steps=2, device="cpu", precision="fp32")
    params = train_step.bench_params(cfg, "loss-second-moment", total_steps=6)
    paused, straight = (train_step.train_paths(tmp_path, tmp_path / "data") for _ in range(2))
    original = T._agree
    loop = train_step.DdpmreproLoop(params, paused)
    for _ in range(3):
        loop.run(2)
        assert T._agree is original  # the step hook is in place only while the run runs
    assert loop.steps_done == 6
    assert loop.finish()["step"] == 6
    T.train(params, straight, restart=True)
    a, b = (load_file(p.model_dir / "model.safetensors") for p in (paused, straight))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_profile_shares_charge_samples_to_the_loop_statement(tmp_path):
    """profile_step.py reads py-spy's collapsed stacks: each sample goes to the loop line it was under."""
    import profile_step

    source = tmp_path / "loop.py"
    source.write_text("def train():\n    forward()\n    backward()\n")
    raw = tmp_path / "raw.txt"
    raw.write_text("main (run.py:9);train (pkg/loop.py:2);forward (m.py:5);conv (m.py:7) 30\n"
                   "main (run.py:9);train (pkg/loop.py:3);backward (m.py:9) 60\n"
                   "main (run.py:9);train (pkg/loop.py:2) 10\n"
                   "main (run.py:9);import_stuff (x.py:1) 100\n")
    shares = profile_step.statement_shares(raw, "train (pkg/loop.py:", source)
    assert shares == {"(outside the loop)": 0.5, "loop.py:3  backward()": 0.3, "loop.py:2  forward()": 0.2}


@pytest.mark.slow
def test_convergence_steps_to_a_threshold_and_the_paired_ratios():
    """benchmarks/convergence.py's reading of the curves, on hand-made ones: the first evaluated step
    at or past each threshold (higher class accuracy, lower FID is better), ratios only between runs
    of the same seed that both reached it, and "> steps" for one that never did."""
    import convergence

    def curve(*points):
        return [(step, {"class_acc": acc, "fid": fid}) for step, acc, fid in points]
    runs = {
        "mse_none-s0": {"config": "mse_none", "seed": 0, "curve": curve((50, 0.5, 9.0), (100, 0.85, 3.5), (150, 0.95, 2.0))},
        "mse_min_snr5-s0": {"config": "mse_min_snr5", "seed": 0, "curve": curve((50, 0.82, 3.9), (100, 0.93, 2.4),
                                                                                 (150, 0.96, 2.2))},
        "mse_none-s1": {"config": "mse_none", "seed": 1, "curve": curve((50, 0.2, 30.0), (100, 0.79, 5.0), (150, 0.80, 4.0))},
        "mse_min_snr5-s1": {"config": "mse_min_snr5", "seed": 1, "curve": curve((50, 0.3, 20.0), (100, 0.9, 3.0),
                                                                                 (150, 0.9, 3.0))},
    }
    s = convergence.summary(runs, 150)
    assert s["class_acc >= 0.8"] == {"mse_none": {"0": 100, "1": 150}, "mse_min_snr5": {"0": 50, "1": 100},
                                     "ratio_none_over_min_snr": [2.0, 1.5]}
    assert s["class_acc >= 0.93"] == {"mse_none": {"0": 150, "1": None}, "mse_min_snr5": {"0": 100, "1": None},
                                      "ratio_none_over_min_snr": [1.5]}
    assert s["fid <= 4"] == {"mse_none": {"0": 100, "1": 150}, "mse_min_snr5": {"0": 50, "1": 100},
                             "ratio_none_over_min_snr": [2.0, 1.5]}
    assert s["fid <= 2.5"]["mse_min_snr5"] == {"0": 100, "1": None}
    assert "| class_acc >= 0.93 | 150, >150 | 100, >150 | 1.50 |" in convergence.table(runs, 150)
    # --gamma 20: the same reading for Min-SNR at another γ, whose runs set the key the others reset
    assert convergence.weightings(20) == ("mse_none", "mse_min_snr20")
    assert convergence.config("mse_min_snr20") == {"diffusion.loss_weighting": "min_snr", "diffusion.min_snr_gamma": 20.0,
                                                   "train.timestep_sampler": "uniform"}
    assert convergence.BASE["diffusion.min_snr_gamma"] == "null"
    # its own definitions of issue 39's methods, not gradient_study's runs of the same name
    assert convergence.config("mse_grad_norm")["introspect.noise_buckets"] == 8
    assert convergence.config("mse_learned") == convergence.EXTRA["mse_learned"]
    assert convergence.config("mse_min_snr5") == {"diffusion.loss_weighting": "min_snr", "train.timestep_sampler": "uniform"}
    renamed = {k.replace("min_snr5", "min_snr20"): {**r, "config": r["config"].replace("min_snr5", "min_snr20")}
               for k, r in runs.items()}
    assert convergence.summary(renamed, 150, ("mse_none", "mse_min_snr20"))["class_acc >= 0.8"] == {
        "mse_none": {"0": 100, "1": 150}, "mse_min_snr20": {"0": 50, "1": 100}, "ratio_none_over_min_snr": [2.0, 1.5]}
    # between the grid's points: linear in the step, of the accuracy and of log FID
    assert convergence.crossing(curve((50, 0.5, 9.0), (100, 0.85, 3.5)), "class_acc", 0.8, True) == pytest.approx(
        50 + 50 * (0.8 - 0.5) / (0.85 - 0.5))
    assert convergence.crossing(curve((50, 0.5, 8.0), (100, 0.85, 2.0)), "fid", 4.0, False) == pytest.approx(75.0)
    assert convergence.crossing(curve((50, 0.9, 3.0)), "fid", 4.0, False) == 50.0  # at the first point already
    assert convergence.crossing(curve((50, 0.5, 9.0), (100, 0.6, 5.0)), "fid", 4.0, False) is None
    i = convergence.interpolated(runs)
    import math
    log_cross = lambda s0, a, b: s0 + 50 * (math.log(a) - math.log(2.5)) / (math.log(a) - math.log(b))
    assert i["fid <= 2.5"]["mse_min_snr5"]["1"] is None  # seed 1 never reaches it: no ratio for it
    assert i["fid <= 2.5"]["ratio_second_over_first"] == pytest.approx([log_cross(50, 3.9, 2.4) / log_cross(100, 3.5, 2.0)])
    assert i["class_acc >= 0.8"]["ratio_second_over_first"] == pytest.approx(
        [(50 - 0) / i["class_acc >= 0.8"]["mse_none"]["0"], i["class_acc >= 0.8"]["mse_min_snr5"]["1"] / 150.0])


def test_serial_pieces_script_times_every_piece():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serial_pieces.py"), "--calls", "0.01"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if " ms  " in ln]
    assert len(lines) == 9 and all(float(ln.split()[0]) > 0 for ln in lines[:8])  # the 9th is a difference


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
        assert st[f"{name}_ratio"]["median"] == pytest.approx(shards / memory)
        assert st[f"{name}_target_1.05"].startswith("unresolved (too few rounds")  # one round has no interval
    assert len(st["reader_thread_cpu_s_per_run"]) == 1 and st["threads"] == 1
    assert s["dvc"]["link_counts"] == [3]  # the benchmark's copy, the repo's workspace and DVC's cache: one inode
    assert s["dvc"]["repo_bytes_on_disk"] < 1.5 * s["dvc"]["data_bytes"]
    assert not (tmp_path / "ds" / "prepared-300").exists() and (tmp_path / "ds" / "raw-300" / ".complete").exists()


# --- benchmarks/mfu.py: the step's FLOPs, the GEMM rate, and their quotient ------------------------


def test_step_flops_are_linear_in_the_batch_and_a_forward_and_two_backward_passes():
    """FlopCounterMode over the real training loss: per-image FLOPs do not depend on the batch, and
    for a network of convolutions and matmuls the backward pass does about twice the forward's work
    (the gradients of inputs and of weights; the first convolution's input needs none)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import mfu
    from ddpmrepro import params as P
    from ddpmrepro.model.unet import build_unet

    params = P.from_dict({"model": {"preset": "tiny"}})
    two, nparams = mfu.step_flops(params, image_size=8, channels=1, batch=2)
    assert mfu.step_flops(params, image_size=8, channels=1, batch=6)[0] == 3 * two
    model = build_unet(params.model, image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    assert nparams == sum(p.numel() for p in model.parameters())
    with FlopCounterMode(display=False) as forward:
        model(torch.randn(2, 1, 8, 8), torch.tensor([1, 2]), torch.tensor([0, 1]))
    assert 2.5 < two / forward.get_total_flops() <= 3.0
    # iddpm-cifar10's learned variance doubles the output channels: more FLOPs than without it
    learned = P.from_dict({"model": {"preset": "tiny"}, "diffusion": mfu.preset_diffusion("iddpm-cifar10") |
                           {"timesteps": 100}})
    assert learned.diffusion.variance == "learned_range" and mfu.step_flops(learned, image_size=8, channels=1,
                                                                            batch=2)[0] > two


def test_matmul_rate_is_the_flops_of_its_repetitions_over_their_time():
    import mfu

    r = mfu.matmul_tflops("cpu", "fp32", n=128, seconds=0.05)
    assert r["n"] == 128 and r["reps"] % 4 == 0 and r["seconds"] >= 0.05
    assert r["tflops"] == pytest.approx(2 * 128 ** 3 * r["reps"] / r["seconds"] / 1e12)


@pytest.mark.slow
def test_the_profile_sorts_kernel_and_op_names_into_kinds_of_work():
    """mfu.py's categories on names as torch.profiler reports them on a GPU (cuDNN, CUTLASS, flash
    attention, fused Adam kernels) and on a CPU (aten ops, autograd nodes)."""
    import re

    import mfu

    def kind(name):
        return next((c for c, rx in mfu.CATEGORIES if re.search(rx, name, re.I)), "other")
    assert kind("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64") == "convolution"
    assert kind("void cudnn::engines_precompiled::nchwToNhwcKernel<float>") == "convolution"
    assert kind("aten::mkldnn_convolution") == kind("aten::convolution_backward") == "convolution"
    assert kind("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>") == "group norm"
    assert kind("aten::native_group_norm_backward") == kind("void at::native::group_norm_kernel") == "group norm"
    assert kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kind("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert kind("aten::_fused_adamw_") == kind("aten::_foreach_lerp_") == "optimizer"
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"  # cuBLAS's, on Hopper
    assert kind("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>") == "matmul"
    assert kind("aten::addmm") == kind("aten::mm") == "matmul"
    assert kind("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == "elementwise"
    assert kind("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>") == "reduction"
    assert kind("autograd::engine::evaluate_function: ConvolutionBackward0") == "autograd"  # bookkeeping: the
    assert kind("ConvolutionBackward0") == kind("torch::autograd::AccumulateGrad") == "autograd"  # work is the op's


def test_mfu_benchmark_divides_each_rows_flops_rate_by_the_gemm_rate_of_the_same_run(tmp_path):
    out = tmp_path / "mfu.json"
    run("mfu.py", "--presets", "tiny", "--image-size", "8", "--channels", "1", "--batches", "4,8", "--steps", "1",
        "--rounds", "2", "--threads", "1", "--peak-tflops", "1", "--profile-steps", "1", "--out", str(out))
    r = json.loads(out.read_text())
    check_paired(r["timing"], {"tiny/b4", "tiny/b8"}, 2, "tiny/b4", threads=1)
    for row in r["rows"]:  # what the step's time went to: on a CPU, the aten ops' self time by kind
        kinds = row["time_by_category"]
        assert sum(v["share"] for v in kinds.values()) == pytest.approx(1.0)
        assert {"convolution", "group norm", "optimizer", "autograd"} <= set(kinds), kinds
        assert kinds["convolution"]["ms_per_step"] > 0 and list(kinds) == sorted(kinds, key=lambda c: -kinds[c]["share"])
    rate = r["gemm"]["tflops"]
    assert rate == pytest.approx((r["gemm"]["before"]["tflops"] + r["gemm"]["after"]["tflops"]) / 2)
    small, big = r["rows"]
    assert big["gflops_per_step"] == pytest.approx(2 * small["gflops_per_step"])
    for row in r["rows"]:
        assert row["step_seconds"] == pytest.approx(r["timing"]["wall_s"][f"tiny/b{row['batch']}"]["median"])
        assert row["mfu_vs_gemm"] == pytest.approx(row["gflops_per_step"] / 1e3 / row["step_seconds"] / rate)
        assert row["mfu_vs_peak"] == pytest.approx(row["gflops_per_step"] / 1e3 / row["step_seconds"])
        low, high = row["mfu_vs_gemm_range"]
        assert low <= row["mfu_vs_gemm"] <= high


# --- benchmarks/graph_step.py: the step eager, in a CUDA graph, compiled ----------------------------

def test_graph_step_contenders_start_from_a_fresh_optimizer_after_their_warm_up():
    """Every contender warms up (and `graph` captures) at lr 0, then resets AdamW's state, so the
    agreement check compares steps from one state: the warmed-up step must equal, bitwise, the
    same steps with an optimizer that never stepped (a missed 'step' count would change Adam's
    bias correction)."""
    import copy

    import torch
    import graph_step
    from ddpmrepro import params as P
    from ddpmrepro.model.unet import build_unet

    torch.manual_seed(0)
    model = build_unet(P.ModelParams(preset="tiny"), image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    data = graph_step.batches(3, 4, 1, 8, torch.device("cpu"))
    warmed = graph_step.Step("eager", copy.deepcopy(model), data, "fp32")
    assert all(torch.equal(a, b) for a, b in zip(warmed.params, model.parameters()))  # lr 0: the weights as they were
    assert all(torch.equal(a, b) for a, b in zip(warmed.ema, model.parameters()))
    fresh = graph_step.Step("eager", copy.deepcopy(model), data, "fp32")
    fresh.opt = torch.optim.AdamW(fresh.params, lr=graph_step.LR, weight_decay=0.0, foreach=True)
    for step in (warmed, fresh):
        torch.manual_seed(2)  # the same dropout masks
        step.run(3)
    assert graph_step.agreement(warmed, fresh) == {"all_weights": 0.0, "worst_tensor": 0.0}
    assert not all(torch.equal(a, b) for a, b in zip(warmed.params, model.parameters()))  # it trained


def test_graph_step_benchmark_writes_each_batchs_times_and_agreement(tmp_path):
    out = tmp_path / "graph_step.json"
    run("graph_step.py", "--preset", "tiny", "--image-size", "8", "--channels", "1", "--batches", "4,8",
        "--modes", "eager", "--steps", "1", "--rounds", "2", "--threads", "1", "--out", str(out))
    r = json.loads(out.read_text())
    assert [row["batch"] for row in r["rows"]] == [4, 8]
    for row in r["rows"]:
        check_paired(row["timing"], {"eager"}, 2, "eager", threads=1)
        assert row["agreement_after_3_steps"]["eager"] == {"all_weights": 0.0, "worst_tensor": 0.0}
        assert row["ms_per_step"]["eager"] == pytest.approx(1e3 * row["timing"]["wall_s"]["eager"]["median"])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graph_step.py"), "--modes", "eager,graph"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--modes graph needs --device cuda" in refused.stderr


def test_main_thread_benchmark_times_the_microbatch_of_the_code_on_the_path(tmp_path):
    out = tmp_path / "main_thread.json"
    run("main_thread.py", "--microbatches", "2", "--rounds", "2", "--step-ms", "1", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["draws_on_reader_thread"] is True and r["code"] == str(ROOT / "src" / "ddpmrepro")
    for shape in ("1x8x8", "3x32x32"):
        s = r["shapes"][shape]
        assert len(s["per_round_ms"]) == 2 and s["min_ms"] <= s["median_ms"] <= s["max_ms"] and s["min_ms"] > 0


# --- benchmarks/sampler_variance.py: tr(Σ) of the importance-weighted gradient under each sampler -----


def test_sampler_variance_trace_is_the_covariance_trace_of_the_weighted_estimate():
    """On synthetic per-level gradients (levels x examples x dims), the formula equals the trace of the
    covariance of w_t g computed directly over the mixture p (each level's examples equally likely)."""
    import sampler_variance as sv

    rng = np.random.default_rng(1)
    g = rng.normal(size=(5, 7, 3)) * rng.uniform(0.1, 3, size=(5, 1, 1)) + rng.normal(size=(1, 1, 3))
    p = rng.dirichlet(np.ones(5))
    K = len(p)
    second = (g ** 2).sum(-1).mean(1)
    G = g.mean((0, 1))
    weighted = g / (K * p)[:, None, None]                     # w_t g
    probs = np.repeat(p / 7, 7)                                # each (level, example) pair
    flat = weighted.reshape(-1, 3)
    mean = probs @ flat
    direct = float(probs @ ((flat - mean) ** 2).sum(1))
    assert np.allclose(mean, G)                                # unbiased: the uniform-level gradient
    assert sv.trace_of(p, second, float(G @ G)) == pytest.approx(direct, rel=1e-12)
    assert sv.mixed(np.array([1.0, 3.0])) == pytest.approx([0.25 * 0.999 + 0.0005, 0.75 * 0.999 + 0.0005])


@pytest.mark.slow
def test_sampler_variance_benchmark_writes_each_samplers_trace_and_ratio(tmp_path):
    out = tmp_path / "sv.json"
    run("sampler_variance.py", "--seeds", "0", "--steps", "2", "--levels", "16", "--examples", "4", "--out", str(out))
    r = json.loads(out.read_text())
    (seed,) = r["runs"]
    assert set(seed["trace"]) == {"uniform", "loss-second-moment", "bucket means (4)", "bucket means (8)",
                                  "grad-norm (4 buckets)", "grad-norm (8 buckets)", "per level (the optimum)",
                                  "output-grad-norm (per level)"}
    for name, tr in seed["trace"].items():
        assert seed["ratio_to_uniform"][name] == pytest.approx(tr / seed["trace"]["uniform"])
        assert r["ratio_to_uniform"][name]["median"] == pytest.approx(seed["ratio_to_uniform"][name])
    assert len(seed["levels"]) == len(seed["second_moment_judge"]) == 16


@pytest.mark.slow
@pytest.mark.parametrize("section", ["defaults", "vjp"])
def test_introspect_overhead_sections_run_at_their_quick_size_and_write_their_spread(tmp_path, section):
    out = tmp_path / f"{section}.json"
    printed = run("introspect_overhead.py", "--section", section, "--quick", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["section"] == section and r["quick"] is True and "--section " + section in r["command"]
    assert json.loads(printed[printed.index("{"):])  # the summary it prints is the JSON's
    if section == "defaults":
        ratios = r["timing"]["ratio_cpu"]
        assert all(set(v) >= {"median", "min", "max"} for v in ratios.values())
        assert set(r["projected_by_noise_levels_every"])


def test_gradient_study_reads_each_buckets_share_and_draws_them_per_configuration(tmp_path):
    """benchmarks/gradient_study.py's shares over training: the noise_levels table the training
    writes, read back per step and bucket (buckets in order, steps sorted), and the figure drawn
    from the runs of two configurations (one band per bucket per panel)."""
    import gradient_study
    from ddpmrepro.training.introspect import TableWriter

    edges = [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0)]
    shares = {50: [0.7, 0.2, 0.1], 100: [0.5, 0.6, -0.1]}
    for seed in (0, 1):
        w = TableWriter(tmp_path / f"s{seed}", start_step=0)
        for step in (100, 50):  # out of order, as a resumed run may leave parts
            w.add(step, noise_levels=[
                {"step": step, "bucket": b, "space": "t", "lo": lo, "hi": hi, "examples": 10, "grad_norm": 1.0,
                 "share": shares[step][b] + seed / 100, "cos": [1.0, 0.0, 0.0], "g2": 1.0, "trace": 2.0,
                 "b_simple": 2.0} for b, (lo, hi) in reversed(list(enumerate(edges)))])
        w.close()
    read = gradient_study.bucket_shares(tmp_path / "s0" / "noise_levels")
    assert read == {"space": "t", "edges": [list(e) for e in edges], "steps": [50, 100],
                    "share": [[0.7, 0.2, 0.1], [0.5, 0.6, -0.1]]}
    assert gradient_study.bucket_shares(tmp_path / "none") == {}
    runs = {f"{c}-s{seed}": {"config": c, "seed": seed,
                             "shares": gradient_study.bucket_shares(tmp_path / f"s{seed}" / "noise_levels")}
            for c in ("mse_none", "mse_learned") for seed in (0, 1)}
    gradient_study.plot_shares(runs, tmp_path / "shares.png")
    from PIL import Image
    img = np.asarray(Image.open(tmp_path / "shares.png").convert("L"), dtype=float)
    assert img.shape[1] > 2 * img.shape[0] * 0.9 and img.std() > 5  # two panels side by side, not blank


def test_gradient_study_pairs_each_configuration_with_the_reference_at_the_same_seed():
    """paired_ratios: seed by seed, never across seeds; the reference itself, a seed the reference
    lacks and a missing value are left out."""
    import gradient_study

    runs = {"a": {"config": "mse_none", "seed": 0, "gns_trace_late_mean": 4.0},
            "b": {"config": "mse_none", "seed": 1, "gns_trace_late_mean": 5.0},
            "c": {"config": "mse_x", "seed": 0, "gns_trace_late_mean": 3.0},
            "d": {"config": "mse_x", "seed": 1, "gns_trace_late_mean": 4.5},
            "e": {"config": "mse_x", "seed": 2, "gns_trace_late_mean": 1.0},
            "f": {"config": "mse_y", "seed": 0}}
    got = gradient_study.paired_ratios(runs, references=("mse_none",))
    assert got == {"mse_none": {"mse_x": {0: 0.75, 1: 0.9}}}
    assert gradient_study.paired_text(got) == "tr(Σ) mse_x / mse_none, seed by seed: 0.750, 0.900 (range 0.750..0.900)"


def test_gpu_wheels_carry_the_dependency_trees_packages_that_the_gpu_image_lacks():
    """benchmarks/gpu_wheels.py: what travels to a lent GPU machine is ddpmrepro[dev]'s installed
    tree (the lock's versions) less what the machine's image holds, and that set is closed: every
    requirement of a carried package is carried, in the image, or left out on purpose."""
    import gpu_wheels
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    tree = gpu_wheels.dependency_tree()
    image = gpu_wheels.device_packages()
    carry = gpu_wheels.to_carry(tree, image)
    lock = dict(line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    lock = {canonicalize_name(k): v.strip() for k, v in lock.items()}
    frozen = {k: v for k, v in tree.items() if k not in ("pip", "setuptools", "wheel")}  # pip freeze omits these
    assert {k: lock.get(k) for k in frozen} == frozen  # the pinned versions, nothing outside the lock
    # what on_gpu.sh's parts import beyond torch: the loop's log, the benchmarks' references, the tests' imports
    assert {"dvc", "dvclive", "snakemake", "greenlet", "improved-diffusion-for-smlm", "diffusers", "ema-pytorch",
            "torch-fidelity", "mlxtend"} <= set(carry)
    assert {"torch", "torchvision", "numpy", "pandas", "pytest"} <= image and not set(carry) & image
    assert "pulp" in tree and "pulp" not in carry
    assert set(tree) == set(carry) | (set(tree) & image) | (set(tree) & gpu_wheels.LEFT_OUT)
    import importlib.metadata as md
    for name in carry:
        for text in md.distribution(name).requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({**gpu_wheels.MARKER_ENV, "extra": ""}):
                assert canonicalize_name(req.name) in set(carry) | image | gpu_wheels.LEFT_OUT, (name, text)
    # the markers are read for the machine's Python 3.12, not this one's
    assert not Requirement('x; python_version < "3.12"').marker.evaluate(gpu_wheels.MARKER_ENV)


def test_op_counter_counts_each_dispatched_operation_under_its_region():
    import op_count

    counter = op_count.OpCounter()
    with counter:
        x = torch.ones(3)
        x.add_(1).mul(2)
        counter.region = None  # not counted (a replayed graph's operations)
        x.sub(1)
        counter.region = "microbatch"
        x.mul(3).sum()
    assert dict(counter.counts["rest"]) == {"ones": 1, "add_": 1, "mul": 1}
    assert dict(counter.counts["microbatch"]) == {"mul": 1, "sum": 1}
    assert op_count.per_step(counter.counts, 1)["ops_per_step"] == 5


@pytest.mark.slow
def test_op_count_benchmark_counts_each_loops_step_and_leaves_replays_out(tmp_path):
    """The count of a block is the same in the next block (nothing timing-dependent); the graphed
    loop dispatches, outside its replays, what the eager loop dispatches outside the microbatch
    function, plus the copies into and out of the graph's static buffers and the in-place zeroing."""
    out = tmp_path / "ops.json"
    text = run("op_count.py", "--preset", "tiny", "--model-channels", "0", "--image-size", "8", "--channels", "1",
               "--batch", "4", "--steps", "2", "--modes", "plain,ddpmrepro,ddpmrepro+graphs", "--out", str(out))
    r = json.loads(out.read_text())
    c = r["contenders"]
    assert all(v["same_in_both_blocks"] for v in c.values())
    assert set(c["plain"]["regions"]) == {"rest"} and set(c["ddpmrepro"]["regions"]) == {"microbatch", "rest"}
    assert set(c["ddpmrepro+graphs"]["regions"]) == {"rest"}  # every microbatch of the block was a replay
    eager, graphed = c["ddpmrepro"]["regions"], c["ddpmrepro+graphs"]["regions"]
    assert 0 < graphed["rest"] - eager["rest"] <= 16, (graphed, eager)
    # the forward and backward passes are most of a step, and the same model's in both loops
    assert eager["microbatch"] > 0.6 * c["plain"]["ops_per_step"]
    assert c["ddpmrepro"]["vs_plain"] == pytest.approx(c["ddpmrepro"]["ops_per_step"] / c["plain"]["ops_per_step"])
    assert "x1.000 of plain" in text and "--steps 2" in r["command"]


@pytest.mark.slow
def test_reader_contention_benchmark_pairs_each_arrangement_with_rows_only(tmp_path):
    out = tmp_path / "rc.json"
    run("reader_contention.py", "--batch", "16", "--image", "1x8x8", "--steps", "2", "--rounds", "3", "--out", str(out))
    r = json.loads(out.read_text())
    names = {"rows", "draws-reader", "draws-main", "idle"}
    check_paired(r["timing"], names, 3, "rows", threads=1)
    wall = {n: r["timing"]["wall_s"][n]["per_round"] for n in names}
    assert set(r["extra_ms_per_step_vs_rows"]) == names and r["extra_ms_per_step_vs_rows"]["rows"]["median"] == 0
    for n in names:  # the extra time is the paired difference per step, in ms
        assert r["extra_ms_per_step_vs_rows"][n]["median"] == pytest.approx(
            statistics.median([1e3 * (w - b) / 2 for w, b in zip(wall[n], wall["rows"])]))
    saved = [1 - (a - b) / (m - b) for a, m, b in zip(wall["draws-reader"], wall["draws-main"], wall["rows"]) if m > b]
    if saved:
        assert r["share_of_draws_cost_saved_by_the_reader"]["median"] == pytest.approx(statistics.median(saved))
    assert r["draws_cpu_ms_on_the_calling_thread"]["median"] > 0 and r["image"] == [1, 8, 8]


# --- benchmarks/on_gpu.sh: the prepared GPU check, rehearsed on the CPU -------------------------

ON_GPU = ROOT / "benchmarks" / "on_gpu.sh"


def on_gpu_parts() -> list[str]:
    import re

    return re.findall(r"^part \d+ ([\w-]+) ", ON_GPU.read_text(), flags=re.M)


def test_on_gpu_parts_named_in_its_instructions_exist():
    """The header's `PARTS="..."` batches are what the next GPU session types: each name a part."""
    import re

    parts = set(on_gpu_parts())
    named = {p for batch in re.findall(r'PARTS="([^"]*)"', ON_GPU.read_text()) for p in batch.split()}
    named |= set(re.search(r"PARTS=\$\{PARTS:-([^}]*)\}; fi", ON_GPU.read_text()).group(1).split())
    assert len(parts) == len(set(on_gpu_parts())) >= 17
    assert named - {"..."} <= parts, named - parts


@pytest.mark.slow
def test_on_gpu_script_runs_each_benchmark_part_at_toy_size_on_the_cpu(tmp_path):
    """REHEARSE=1: the card's command lines, toy overrides appended. A part whose options the code no
    longer accepts exits non-zero here instead of in a lent card's minutes. Every benchmark script is
    covered; the parts left out add only torch.compile on the CPU (minutes) to what is run."""
    parts = ["host-profile", "train-step", "train-cl", "sample-cl", "sample-graphs-1000", "growth", "mfu",
             "mfu-best", "op-count", "graphs"]
    assert set(parts) <= set(on_gpu_parts())
    env = {**os.environ, "REHEARSE": "1", "PARTS": " ".join(parts), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", str(ON_GPU), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    log = out.stdout + out.stderr
    exits = {}
    for line in log.splitlines():
        if line.startswith("=== ") and ": exit " in line:
            name, rest = line[4:].split(": exit ")
            exits[name] = int(rest.split()[0])
    assert exits == {p: 0 for p in parts}, log[-4000:]
    written = {p.name for p in tmp_path.glob("*.json")}
    assert written == {"train_step-bf16.json", "train_step-bf16-cl.json", "sample_speed-ddim50-graphs-bf16-cl.json",
                       "sample_speed-ddim50-graphs-b1000.json", "growth-bf16.json", "mfu-bf16.json",
                       "mfu-bf16-graphs-compile.json", "op_count-bf16.json", "graph_step-bf16.json"}, written
    # the toy options came after the card's: each JSON says it ran on the CPU
    for name in written:
        record = json.loads((tmp_path / name).read_text())
        assert "cpu" in json.dumps(record.get("device", record.get("command"))).lower(), (name, record.get("device"))
