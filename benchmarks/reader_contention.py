"""Does the read-ahead thread's work slow a launch-bound main thread? (issue 38, item 1)

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/reader_contention.py

On a GPU the training step of ddpm-cifar10 at batch 128 is bound by the host: the main thread
dispatches about 2,500 operations a step, a few microseconds each, and the card waits for them.
Issue 38 moved each microbatch's per-example draws (128 seeded generators: label drop, flip, the
timestep's uniform, the noise) from the main thread to the read-ahead thread, which took 5.6 ms of
CPU a microbatch off the main thread (benchmarks/main_thread.py). But both threads run Python under
one interpreter lock: while the reader runs Python, the main thread cannot dispatch. This measures
how much of the draws' cost the main thread still pays, on a CPU, with a stand-in for a GPU's
launch-bound step: the ddpm-cifar10 UNet's layers at width 32 on one 8x8 image, forward and
backward on one thread (about 1,900 operations of a few microseconds each, ~16 ms).

Contenders, each a block of `--steps` steps of (the microbatch the loop gets, then that step):
  rows           the read-ahead thread reads the uint8 rows only; no draws anywhere (the reference)
  draws-reader   today's loop: the reader thread reads and draws
  draws-main     the draws on the main thread, the reader reading rows (where they were before)
  idle           no reader at all (the step alone)
Reported: each contender's extra time per step over `rows`, per round (paired rounds,
benchmarks/timing.py), and the share of the draws' cost that the reader thread saves:
1 - (draws-reader - rows) / (draws-main - rows).
Writes benchmarks/results/reader_contention-threads<N>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ddpmrepro import params as P
from ddpmrepro.model.unet import build_unet
from ddpmrepro.params import SuperresParams
from ddpmrepro.training.batches import TrainBatches, TrainExamples
from ddpmrepro.training.timestep_sampler import LossSecondMomentSampler
from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import paired_rounds, spread


def launch_bound_step(width: int):
    """A step whose cost is the host's dispatch of each operation, as a GPU's launch-bound step's is."""
    model = build_unet(P.ModelParams(preset="ddpm-cifar10", channels=width), image_size=8, in_channels=3,
                       num_classes=10, learn_sigma=False)
    x, t, y = torch.randn(1, 3, 8, 8), torch.randint(0, 1000, (1,)), torch.randint(0, 10, (1,))

    def step():
        out = model(x, t, y)
        (out - x).pow(2).mean().backward()
    return step


class Arrangement:
    """One contender: `get(m)` gives microbatch m as the loop would, from a reader kept running
    across blocks (its thread reads ahead while the block is not being timed, as in training)."""

    def __init__(self, name: str, images: np.ndarray, labels: torch.Tensor, batch: int, stack: contextlib.ExitStack):
        examples = TrainExamples(labels, seed=0, rank=0, world=1, num_classes=10, label_dropout=0.1, hflip=True,
                                 superres=SuperresParams())
        sampler = LossSecondMomentSampler(1000)
        self.m = 0
        if name == "idle":
            self.get = lambda m: None
            return
        batches = stack.enter_context(TrainBatches(images, batch_size=batch, world=1, rank=0, seed=0,
                                                   prepare=examples.draws if name == "draws-reader" else None))
        if name == "draws-reader":
            self.get = lambda m: examples.microbatch(batches.get(m), sampler)
        elif name == "draws-main":
            self.get = lambda m: examples.microbatch(examples.draws(m, *batches.get(m)), sampler)
        else:  # rows
            self.get = batches.get

    def block(self, steps: int, step) -> None:
        for _ in range(steps):
            self.get(self.m)
            step()
            self.m += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image", default="3x32x32", help="CxHxW of the training images")
    ap.add_argument("--width", type=int, default=32, help="the stand-in step's UNet width")
    ap.add_argument("--steps", type=int, default=40, help="steps per block")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shape = tuple(int(s) for s in a.image.split("x"))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (max(4096, 2 * a.batch), *shape), dtype=np.uint8)
    labels = torch.from_numpy(rng.integers(0, 10, len(images)))
    step = launch_bound_step(a.width)
    names = ("rows", "draws-reader", "draws-main", "idle")
    with contextlib.ExitStack() as stack:
        arrangements = {n: Arrangement(n, images, labels, a.batch, stack) for n in names}
        # the draws' own cost on the calling thread, for scale
        draws_ms = []
        for _ in range(20):
            c0 = time.thread_time()
            arrangements["draws-main"].get(arrangements["draws-main"].m)
            draws_ms.append(1e3 * (time.thread_time() - c0))
            arrangements["draws-main"].m += 1
        timing = paired_rounds({n: (lambda arr=arr: arr.block(a.steps, step)) for n, arr in arrangements.items()},
                               "rows", a.rounds, warmup=1, cpu_clock=time.thread_time)
    wall = {n: timing["wall_s"][n]["per_round"] for n in names}
    extra = {n: spread([1e3 * (w - r) / a.steps for w, r in zip(wall[n], wall["rows"])]) for n in names}
    saved = [1 - (d_r - r) / (d_m - r) for d_r, d_m, r in zip(wall["draws-reader"], wall["draws-main"], wall["rows"])
             if d_m > r]
    result = {
        "command": command_line("reader_contention.py", a), "machine": platform.machine(),
        "processor": platform.processor(), "torch": torch.__version__, "threads": a.threads, "batch": a.batch,
        "image": list(shape), "step_ms": {n: 1e3 * timing["wall_s"][n]["median"] / a.steps for n in names},
        "draws_cpu_ms_on_the_calling_thread": spread(draws_ms),
        "extra_ms_per_step_vs_rows": extra, "share_of_draws_cost_saved_by_the_reader": spread(saved) if saved else None,
        "timing": timing,
    }
    write_result(result, a.out or Path(f"benchmarks/results/reader_contention-threads{a.threads}.json"))
    load = timing["before"]["load_avg"][0], timing["after"]["load_avg"][0]
    print(f"batch {a.batch} of {a.image}; stand-in step {result['step_ms']['rows']:.1f} ms; the draws "
          f"{statistics.median(draws_ms):.2f} ms of CPU on the calling thread; {a.rounds} rounds of {a.steps} steps, "
          f"load {load[0]:.2f} -> {load[1]:.2f}")
    for n in names:
        e = extra[n]
        ci = e["median_ci95"] or (e["min"], e["max"])
        print(f"  {n:13} {result['step_ms'][n]:6.2f} ms/step   extra over rows {e['median']:+.2f} ms "
              f"[CI {ci[0]:+.2f}..{ci[1]:+.2f}]")
    if saved:
        s = result["share_of_draws_cost_saved_by_the_reader"]
        print(f"  the reader thread saves {s['median']:.0%} of the draws' cost to the main thread "
              f"(range {s['min']:.0%}..{s['max']:.0%})")


if __name__ == "__main__":
    main()
