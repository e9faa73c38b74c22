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

Sections of their own, each with the loop's real instruments (`NoiseScale`, `Introspection`) on the
real diffusion loss, timed with benchmarks/timing.py's paired rounds (process CPU time, 1 thread):

    --section defaults   what every instrument at its default costs the default run (tiny, batch 128):
                         one unrecorded, recorded and noise-level step against a step with no
                         instrument, and the default run's total from its counts of each step
                         (target <= 5 %), for several `introspect.noise_levels_every`
    --section gns        the noise scale's hooks on steps that record nothing (grad_accum 2, batch
                         64 per microbatch): on against off (target <= 2 %), --presets tiny,tiny96
                         (tiny at 96 channels: 4.1M parameters), --nprocs 1,2 (gloo, DDP)
    --section vjp        the noise-level buckets' extra backward passes: one autograd.grad per
                         bucket half (the instrument) against one batched vector-Jacobian product
                         (is_grads_batched, vmap over the backward), and their largest difference
"""
from __future__ import annotations

import argparse
import dataclasses
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

from ddpmrepro.training.introspect import ActivationGradRecorder, ParamGradRecorder, TableWriter, is_record_step
from ddpmrepro.params import IntrospectParams, ModelParams
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import machine_state, spread

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


# --- the loop's instruments as the loop drives them (--section defaults, gns, vjp) -------------

def _model_params(preset: str) -> ModelParams:
    """`tiny`, or `tiny96`: tiny at 96 channels (4.1M parameters, 9x the FLOPs)."""
    return ModelParams(preset="tiny", channels=96) if preset == "tiny96" else ModelParams(preset=preset)


class LoopStep:
    """One model with the loop's instruments (`ip`; None: none at all) and `step(done)`: one update as
    training/loop.py makes it (microbatches, the real diffusion loss, unscale-free fp32, clip, AdamW)."""

    def __init__(self, ip: IntrospectParams | None, *, preset: str, micro: int, grad_accum: int, last_step: int,
                 tmp: Path, world: int = 1, seed: int = 0):
        from ddpmrepro.model.diffusion import GaussianDiffusion, get_beta_schedule
        from ddpmrepro.model.unet import build_unet
        from ddpmrepro.training.noise_scale import NoiseScale
        from ddpmrepro.training.recording import Introspection
        from ddpmrepro.training.stats import RunningStats

        torch.manual_seed(seed)
        self.raw = build_unet(_model_params(preset), image_size=8, in_channels=1, num_classes=10, learn_sigma=False)
        self.model = torch.nn.parallel.DistributedDataParallel(self.raw) if world > 1 else self.raw
        self.opt = torch.optim.AdamW(self.raw.parameters(), lr=1e-4, foreach=True)
        self.diffusion = GaussianDiffusion(get_beta_schedule("cosine", 1000))
        self.grad_accum, self.world = grad_accum, world
        self.stats = RunningStats({"loss": 1, "gns_small_sq": 1, "gns_big_sq": 1, "gns_g2": 1, "gns_trace": 1},
                                  torch.device("cpu"))
        g = torch.Generator().manual_seed(seed + 1)
        self.micro = [(torch.rand(micro, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 1000, (micro,), generator=g),
                       torch.randint(0, 10, (micro,), generator=g), torch.randn(micro, 1, 8, 8, generator=g))
                      for _ in range(grad_accum)]
        self.ns = self.intro = None
        self.instrument_s = 0.0  # the NoiseScale's own calls, process CPU seconds
        if ip is not None:
            self.ns = NoiseScale(self.raw, enabled=ip.noise_scale, micro_batch=micro, grad_accum=grad_accum,
                                 world=world, halflife_steps=ip.noise_scale_halflife)
            self.intro = Introspection(self.raw, ip, last_step=last_step, alphas_cumprod=self.diffusion.alphas_cumprod,
                                       batch_per_step=micro * grad_accum * world, noise_scale=self.ns,
                                       stats=self.stats, device=torch.device("cpu"))
            self.intro.open_tables(tmp, 0)
            self.intro.__enter__()

    def step(self, done: int) -> None:
        import contextlib

        if self.intro is not None:
            self.intro.begin(done, 1.0)
        for k, (x0, t, y, noise) in enumerate(self.micro):
            last = k == self.grad_accum - 1
            with contextlib.nullcontext() if last or self.world == 1 else self.model.no_sync():
                losses = self.diffusion.training_losses(lambda x, tt: self.model(x, tt, y), x0, t, noise=noise)
                weighted = losses["loss"]
                if self.intro is not None:
                    self.intro.measure(weighted, t, grad_multiplier=1 / self.grad_accum, loss_scale=1.0)
                (weighted.mean() / self.grad_accum).backward()
            if self.ns is not None:
                c0 = time.process_time()
                self.ns.after_backward(self.ns.microbatch_sums(), float(self.grad_accum))
                self.instrument_s += time.process_time() - c0
            self.stats.report("loss", losses["loss"])
        if self.intro is not None:
            self.intro.capture(done)
        total = torch.nn.utils.clip_grad_norm_(self.raw.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ns is not None:
            c0 = time.process_time()
            gns = self.ns.after_step(self.stats, total, recorded=self.intro.recording)
            self.instrument_s += time.process_time() - c0
            self.intro.end(done, gns, total_norm=total, clip_threshold=1.0, skipped=False, loss_scale=1.0, lr=1e-4)

    def close(self) -> None:
        if self.intro is not None:
            self.intro.__exit__(None, None, None)
            self.intro.close()
            self.ns.close()


def default_run_counts(steps: int, ip: IntrospectParams, levels_every: int) -> dict:
    """How many of a run's steps are unrecorded, recorded without the buckets, and with them."""
    rec = lev = 0
    for s in range(1, steps + 1):
        if is_record_step(s, ip.every, [*ip.steps, *ip.dump_steps], last=steps):
            rec += 1
            lev += is_record_step(s, levels_every, ip.steps, last=steps)
    return {"steps": steps, "recorded": rec, "noise_levels": lev}


def section_defaults(a, tmp: Path) -> dict:
    """Item 9 of issue 40: every instrument at its default, on the default run (params.yaml: tiny,
    batch 128, 1 process, 1500 steps)."""
    from timing import paired_rounds

    ip = IntrospectParams()
    steps, every, lev = a.run_steps, ip.every, ip.noise_levels_every
    # A step number of each kind under the defaults (none of them the last).
    kinds = {"unrecorded": every + 1, "recorded": every if every % lev else 2 * every, "noise_levels": lev}
    assert not is_record_step(kinds["unrecorded"], every, ip.steps) and kinds["noise_levels"] % every == 0
    harness = {"none": LoopStep(None, preset="tiny", micro=a.batch, grad_accum=1, last_step=steps, tmp=tmp / "none")}
    harness |= {k: LoopStep(ip, preset="tiny", micro=a.batch, grad_accum=1, last_step=steps, tmp=tmp / k)
                for k in kinds}
    blocks = {"none": lambda: [harness["none"].step(kinds["unrecorded"]) for _ in range(a.steps)]}
    blocks |= {k: (lambda k=k: [harness[k].step(kinds[k]) for _ in range(a.steps)]) for k in kinds}
    result = paired_rounds(blocks, "none", a.rounds, warmup=a.warmup)
    for h in harness.values():
        h.close()
    cpu = result["cpu_s"]
    per_round = [{k: cpu[k]["per_round"][r] / cpu["none"]["per_round"][r] for k in cpu} for r in range(a.rounds)]
    projections = {}
    for every_k in sorted({1, every, 2 * every, 4 * every, 5 * every, 10 * every, lev}):
        n = default_run_counts(steps, ip, every_k)
        plain, rec_only = n["steps"] - n["recorded"], n["recorded"] - n["noise_levels"]
        # The run's CPU time against the same run without any instrument, round by round.
        totals = [100 * ((plain * r["unrecorded"] + rec_only * r["recorded"] + n["noise_levels"] * r["noise_levels"])
                         / n["steps"] - 1) for r in per_round]
        projections[str(every_k)] = {**n, "overhead_pct": spread(totals)}
    return {"section": "defaults", "preset": "tiny", "batch": a.batch, "run_steps": steps, "steps_per_block": a.steps,
            "step_of_each_kind": kinds, "introspect_defaults": dataclasses.asdict(ip),
            "timing": result, "default_noise_levels_every": lev, "projected_by_noise_levels_every": projections,
            "target_pct": 5}


def _gns_worker(rank: int, world: int, port: int, a, tmp: str, out: str) -> None:
    import os

    from ddpmrepro.runtime import distributed as D
    from timing import paired_rounds

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        D.init("cpu")
    results = {}
    for preset in a.presets.split(","):
        harness = {name: LoopStep(IntrospectParams(every=0, steps=[], noise_buckets=0, noise_scale=on),
                                  preset=preset, micro=a.gns_micro, grad_accum=2, last_step=10**6, world=world,
                                  tmp=Path(tmp) / f"{preset}-{name}-{rank}")
                   for name, on in (("off", False), ("on", True))}
        blocks = {n: (lambda n=n: [harness[n].step(2) for _ in range(a.steps)]) for n in harness}
        rounds = a.gns_rounds if preset == "tiny" else max(6, a.gns_rounds // 3)
        timing = paired_rounds(blocks, "off", rounds, warmup=a.warmup)
        on = harness["on"]
        steps_on = a.steps * (rounds + a.warmup)
        results[preset] = {"params": sum(p.numel() for p in on.raw.parameters()),
                           "param_tensors": len(list(on.raw.parameters())), "hooks_on": on.ns.enabled,
                           "instrument_calls_ms_per_step": 1e3 * on.instrument_s / steps_on,
                           "ratio_cpu": timing["ratio_cpu"]["on"], "timing": timing}
        for h in harness.values():
            h.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    if world > 1:
        D.cleanup()


def section_gns(a, tmp: Path) -> dict:
    """Item 8 of issue 40: the noise scale on steps that record nothing (grad_accum 2)."""
    import socket

    import torch.multiprocessing as mp

    by_nproc = {}
    for world in map(int, a.nprocs.split(",")):
        out = tmp / f"gns-{world}.json"
        if world == 1:
            _gns_worker(0, 1, 0, a, str(tmp), str(out))
        else:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            mp.spawn(_gns_worker, args=(world, port, a, str(tmp), str(out)), nprocs=world, join=True)
        by_nproc[str(world)] = json.loads(out.read_text())
    return {"section": "gns", "grad_accum": 2, "batch_per_microbatch": a.gns_micro, "steps_per_block": a.steps,
            "by_nproc": by_nproc,
            "target_pct": 2}


def section_vjp(a, tmp: Path) -> dict:
    """The buckets' extra passes: the instrument's loop of autograd.grad against one batched VJP."""
    from types import SimpleNamespace

    from ddpmrepro.training.noise_levels import NoiseLevelGradients
    from timing import paired_rounds

    h = LoopStep(None, preset="tiny", micro=a.batch, grad_accum=1, last_step=1, tmp=tmp)
    x0, t, y, noise = h.micro[0]
    levels = NoiseLevelGradients(h.raw, h.diffusion.alphas_cumprod, SimpleNamespace(
        noise_buckets=4, noise_bucket_edges=[], noise_bucket_space="t"), batch_per_step=a.batch, device="cpu")

    def losses():
        return h.diffusion.training_losses(lambda x, tt: h.raw(x, tt, y), x0, t, noise=noise)["loss"]

    def loop():
        levels.measure(losses(), t, grad_multiplier=1.0, loss_scale=1.0, batch=a.batch)
        return levels._acc.clone()

    def batched():
        rows = levels.bucket_of_t[t] * 2 + torch.arange(a.batch) % 2
        one_hot = F.one_hot(rows, 2 * levels.count).T.float() / a.batch  # (2K, B): one cotangent per bucket half
        grads = torch.autograd.grad(losses(), levels.params, grad_outputs=one_hot, is_grads_batched=True)
        return torch.cat([g.reshape(2 * levels.count, -1) for g in grads], 1)

    reference = loop()
    levels._acc.zero_()
    diff = float((batched() - reference).abs().max() / reference.abs().max())
    blocks = {"forward_only": lambda: losses(), "loop": lambda: (loop(), levels._acc.zero_()), "batched": batched}
    timing = paired_rounds(blocks, "forward_only", a.rounds, warmup=a.warmup)
    return {"section": "vjp", "preset": "tiny", "batch": a.batch, "buckets": 4, "max_rel_difference": diff,
            "timing": timing}


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
    ap.add_argument("--section", choices=("recorders", "defaults", "gns", "vjp"), default="recorders",
                    help="recorders: the modes above and the memory run; the others: see above")
    ap.add_argument("--rounds", type=int, default=20, help="paired rounds of --section defaults and vjp")
    ap.add_argument("--run-steps", type=int, default=1500, help="--section defaults: the run's length (params.yaml's)")
    ap.add_argument("--presets", default="tiny,tiny96", help="--section gns: models")
    ap.add_argument("--nprocs", default="1,2", help="--section gns: process counts (gloo, DDP)")
    ap.add_argument("--gns-micro", type=int, default=64, help="--section gns: examples per microbatch")
    ap.add_argument("--gns-rounds", type=int, default=30, help="--section gns: paired rounds on tiny (a third "
                                                                "on larger models, at least 6)")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/introspect_overhead"
                                                           "[-SECTION].json")
    a = ap.parse_args()
    if a.section != "recorders":
        return run_section(a)
    a.out = a.out or Path("benchmarks/results/introspect_overhead.json")
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


def run_section(a) -> None:
    if a.quick:
        a.batch, a.rounds, a.gns_rounds, a.gns_micro, a.presets, a.run_steps = 16, 3, 3, 8, "tiny", 100
    torch.set_num_threads(a.threads or torch.get_num_threads())
    out = a.out or Path(f"benchmarks/results/introspect_overhead-{a.section}.json")
    with tempfile.TemporaryDirectory() as d:
        result = {"defaults": section_defaults, "gns": section_gns, "vjp": section_vjp}[a.section](a, Path(d))
    result = {"command": command_line("introspect_overhead.py", a, skip=("out", "quick")), "quick": a.quick,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "machine_state": machine_state(), **result}
    write_result(result, out)
    print(json.dumps(summary(result), indent=1))


def summary(r: dict) -> dict:
    """The numbers to read, without the per-round times."""
    if r["section"] == "defaults":
        t = r["timing"]["ratio_cpu"]
        return {"cpu_ratio_vs_none": {k: [t[k]["median"], t[k]["min"], t[k]["max"]] for k in t},
                "projected_pct": {k: [v["recorded"], v["noise_levels"], v["overhead_pct"]["median"],
                                      v["overhead_pct"]["min"], v["overhead_pct"]["max"]]
                                  for k, v in r["projected_by_noise_levels_every"].items()}}
    if r["section"] == "gns":
        return {n: {p: {"params": v["params"], "instrument_ms": v["instrument_calls_ms_per_step"],
                        "ratio": [v["ratio_cpu"][k] for k in ("median", "min", "max", "median_ci95")],
                        "off_step_cpu_s": v["timing"]["cpu_s"]["off"]["median"] / r["steps_per_block"]}
                    for p, v in by.items()} for n, by in r["by_nproc"].items()}
    t = r["timing"]["ratio_cpu"]
    return {"max_rel_difference": r["max_rel_difference"], **{k: [t[k]["median"], t[k]["min"], t[k]["max"]] for k in t}}


if __name__ == "__main__":
    main()
