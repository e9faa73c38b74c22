"""Overhead of gradient introspection on a CPU training step, and memory over many recorded steps.

    PYTHONPATH=src python benchmarks/introspect_overhead.py            # full: batch 128, 2000-step memory run
    PYTHONPATH=src python benchmarks/introspect_overhead.py --quick    # a minute or two

Both the wall time and the main thread's CPU time of each step are measured; with --threads 1
(default) the CPU time is the whole step's work and is robust to other processes on the machine.
Modes, timed in rounds (one short block of each mode, in random order) and compared by the median
over rounds of the ratio to `none` in the same round:
  none    the same model with the activation hooks removed
  off     recorders attached but never armed (the cost on steps that are not logged)
  params  ParamGradRecorder + TableWriter every step (target <= 3 % over `none`)
  params_noratio  the same without the update-ratio snapshot (introspect.update_ratio: false)
  acts    ActivationGradRecorder on the default module set + TableWriter every step (target <= 10 %)
  both    both every step
Then the memory run: `both` every step for --mem-steps steps; peak RSS growth after warm-up
(target <= 50 MB). Writes benchmarks/results/introspect_overhead.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from ddpmrepro.training.introspect import ActivationGradRecorder, ParamGradRecorder, TableWriter
from ddpmrepro.params import IntrospectParams, ModelParams

MODES = ("none", "off", "params", "params_noratio", "acts", "both")


def build_model(num_classes: int):
    from ddpmrepro.model.unet import build_unet
    return build_unet(ModelParams(preset="tiny"), image_size=8, in_channels=1, num_classes=num_classes,
                      learn_sigma=False)


class Harness:
    """One model, optimizer and (for recording modes) recorders + writer; `step()` is one training step."""

    def __init__(self, batch: int, num_classes: int, out_dir: Path, seed: int = 0):
        torch.manual_seed(seed)
        self.model = build_model(num_classes)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(batch, 1, 8, 8, generator=g)
        self.noise = torch.randn(batch, 1, 8, 8, generator=g)
        self.t = torch.randint(0, 1000, (batch,), generator=g)
        self.y = torch.randint(0, num_classes, (batch,), generator=g)
        self.ip = ip = IntrospectParams()
        self.prm = ParamGradRecorder(self.model.named_parameters(), ip.params)
        self.prm_noratio = ParamGradRecorder(self.model.named_parameters(), ip.params, update_ratio=False)
        self.act = ActivationGradRecorder(self.model, ip.modules, histogram_bins=ip.histogram_bins)
        self.hooked = True
        self.writers = {m: TableWriter(out_dir / m, start_step=0) for m in ("params", "params_noratio", "acts", "both")}
        self.n = 0

    def set_hooks(self, on: bool) -> None:
        """`none` runs the same model with the activation recorder's hooks removed."""
        if on and not self.hooked:
            self.act = ActivationGradRecorder(self.model, self.ip.modules, histogram_bins=self.ip.histogram_bins)
        elif not on and self.hooked:
            self.act.close()
        self.hooked = on

    def step(self, mode: str) -> None:
        params = mode in ("params", "params_noratio", "both")
        acts = mode in ("acts", "both")
        prm = self.prm_noratio if mode == "params_noratio" else self.prm
        if acts:
            self.act.arm(self.n)
        loss = F.mse_loss(self.model(self.x, self.t, self.y), self.noise)
        loss.backward()
        if params:
            prm.capture(self.n)
        total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if params or acts:
            rows, summary = prm.finish(total_norm=total, clip_threshold=1.0) if params else (None, None)
            self.writers[mode].add(self.n, params=rows, summary=summary, activations=self.act.collect() if acts else None)
        self.n += 1

    def close(self) -> None:
        self.act.close()
        for w in self.writers.values():
            w.close()


def time_modes(batch: int, steps: int, repeats: int, warmup: int, tmp: Path) -> dict:
    h = Harness(batch, 10, tmp / "timing")
    times: dict[str, list[float]] = {m: [] for m in MODES}  # wall seconds per step
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # this thread's CPU seconds per step
    for m in MODES:
        h.set_hooks(m != "none")
        for _ in range(warmup):
            h.step(m)
    # Short blocks, every mode once per round in a fresh random order, and the overhead as the
    # median over rounds of (mode / none) within the round: this VM's speed drifts by 10-20% over
    # minutes, which per-mode medians of long blocks mistook for overhead.
    rng = random.Random(0)
    rounds: list[dict[str, tuple[float, float]]] = []
    for _ in range(repeats):
        order = list(MODES)
        rng.shuffle(order)
        block = {}
        for m in order:
            h.set_hooks(m != "none")
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                h.step(m)
            block[m] = ((time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps)
            times[m].append(block[m][0])
            cpu[m].append(block[m][1])
        rounds.append(block)
    h.close()

    def paired(m: str, i: int) -> float:
        return 100 * (statistics.median(r[m][i] / r["none"][i] for r in rounds) - 1)

    return {m: {"median_ms": 1e3 * statistics.median(v), "overhead_pct": paired(m, 0),
                "cpu_median_ms": 1e3 * statistics.median(cpu[m]), "cpu_overhead_pct": paired(m, 1),
                "overhead_pct_iqr": _iqr([100 * (r[m][0] / r["none"][0] - 1) for r in rounds]),
                "steps": steps * len(v)} for m, v in times.items()}


def _iqr(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def memory_run(batch: int, steps: int, warmup: int, tmp: Path) -> dict:
    h = Harness(batch, 10, tmp / "mem")
    proc = psutil.Process()
    for _ in range(warmup):
        h.step("both")
    rss0 = proc.memory_info().rss
    peak = rss0
    samples = []
    for i in range(steps):
        h.step("both")
        if i % 25 == 0 or i == steps - 1:
            rss = proc.memory_info().rss
            peak = max(peak, rss)
            samples.append((i, (rss - rss0) / 2**20))
    h.close()
    return {"batch": batch, "steps": steps, "warmup": warmup, "rss_start_mb": rss0 / 2**20,
            "peak_growth_mb": (peak - rss0) / 2**20, "end_growth_mb": samples[-1][1],
            "growth_samples_mb": samples[:: max(1, len(samples) // 20)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 32, fewer steps, 300-step memory run at batch 16")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=40, help="rounds (one block of every mode, random order)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mem-steps", type=int, default=2000)
    ap.add_argument("--mem-batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (0: torch default). With 1, the per-step CPU time of the main "
                         "thread is the whole step's work, which stays comparable on a busy machine")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/introspect_overhead.json"))
    a = ap.parse_args()
    if a.quick:
        a.batch, a.steps, a.repeats, a.mem_steps, a.mem_batch = 32, 2, 10, 300, 16
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        timing = time_modes(a.batch, a.steps, a.repeats, a.warmup, Path(d))
        memory = memory_run(a.mem_batch, a.mem_steps, 20, Path(d)) if a.mem_steps else None
    n_params = sum(p.numel() for p in build_model(10).parameters())
    result = {
        "model": "ddpmrepro.model.unet.build_unet preset tiny, 1x8x8, 10 classes", "model_params": n_params,
        "batch": a.batch, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpu_count": psutil.cpu_count(),
        "load_avg_at_end": list(psutil.getloadavg()), "quick": a.quick,
        "module_patterns": IntrospectParams().modules, "timing": timing, "memory": memory,
        "targets": {"params_pct": 3, "acts_pct": 10, "rss_growth_mb": 50},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['model']} ({n_params / 1e6:.2f}M params), batch {a.batch}, {result['threads']} threads")
    print(f"{'mode':8} {'wall ms':>9} {'overhead':>9} {'cpu ms':>9} {'overhead':>9} {'steps':>6}")
    for m, r in timing.items():
        print(f"{m:8} {r['median_ms']:9.1f} {r['overhead_pct']:+8.1f}% {r['cpu_median_ms']:9.1f} "
              f"{r['cpu_overhead_pct']:+8.1f}% {r['steps']:6d}")
    if memory:
        print(f"memory: {memory['steps']} recorded steps at batch {memory['batch']}: peak RSS growth "
              f"{memory['peak_growth_mb']:.1f} MB, at end {memory['end_growth_mb']:.1f} MB")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
