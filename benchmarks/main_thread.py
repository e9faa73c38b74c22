"""The host work on the training step's critical path: the main thread's CPU time to have the next
microbatch ready on the device.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/main_thread.py
    # the same for another version of the code, e.g. before a change:
    git worktree add /tmp/before <commit> && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/before/src python benchmarks/main_thread.py

On a GPU the main thread only launches kernels, so whatever else it does per microbatch (the
per-example seeded draws, conversions, copies) delays the next launch, while the read-ahead
thread's work runs beside it. On a CPU the main thread also runs the model (about 180 ms a step of
the default run), which hides a few milliseconds in its spread; so this times the microbatch alone,
as the loop gets it on the host (`training/loop.py`: the rows, the draws, t from the sampler),
with `time.thread_time()` of the calling thread: the reader thread's work is not counted, whether
it reads rows only (the code before the draws moved) or draws too. Between calls the thread
sleeps as long as a step of the model would take (`--step-ms`), so the reader is ahead, as in
training. Not counted: `.to(device)`, the copies' launches (and, on a GPU, the uint8-to-float
conversion the code now leaves to the device, about 3 small kernels; before, that conversion was
host work inside the timed call). Shapes: the default digits (1x8x8) and CIFAR-10's (3x32x32),
batch 128.
Writes benchmarks/results/main_thread-threads<N>.json.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import ddpmrepro
from ddpmrepro.params import SuperresParams
from ddpmrepro.training.batches import TrainBatches, TrainExamples
from ddpmrepro.training.timestep_sampler import LossSecondMomentSampler

from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path



def microbatch_source(images: np.ndarray, labels: torch.Tensor, batch: int):
    """(a context manager, get(m) -> the microbatch m on the host as the training loop builds it),
    for the code on sys.path: with `TrainExamples.draws` (draws on the reader thread) or without
    (draws on the calling thread)."""
    sampler = LossSecondMomentSampler(1000)
    kw = dict(seed=0, rank=0, world=1, num_classes=10, label_dropout=0.1, hflip=True, superres=SuperresParams())
    if hasattr(TrainExamples, "draws"):
        examples = TrainExamples(labels, **kw)
        batches = TrainBatches(images, batch_size=batch, world=1, rank=0, seed=0, prepare=examples.draws)
        return batches, lambda m: examples.microbatch(batches.get(m), sampler)
    batches = TrainBatches(images, batch_size=batch, world=1, rank=0, seed=0)
    examples = TrainExamples(batches, labels, **kw)
    return batches, lambda m: examples.microbatch(m, sampler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=60, help="timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=20.0, help="sleep between microbatches (the model's step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    shapes = {"1x8x8": (1, 8, 8), "3x32x32": (3, 32, 32)}
    results = {}
    for name, shape in shapes.items():
        images = rng.integers(0, 256, (4096, *shape), dtype=np.uint8)
        labels = torch.from_numpy(rng.integers(0, 10, 4096))
        per_round = []
        batches, get = microbatch_source(images, labels, a.batch)
        with batches:
            m = 0
            for _ in range(3):  # warm-up
                get(m)
                m += 1
            for r in range(a.rounds):
                spent = 0.0
                for _ in range(a.microbatches):
                    time.sleep(a.step_ms / 1e3)
                    c0 = time.thread_time()
                    get(m)
                    spent += time.thread_time() - c0
                    m += 1
                per_round.append(spent / a.microbatches)
        results[name] = {"median_ms": 1e3 * statistics.median(per_round), "min_ms": 1e3 * min(per_round),
                         "max_ms": 1e3 * max(per_round), "per_round_ms": [1e3 * x for x in per_round]}
        print(f"{name}: main thread {results[name]['median_ms']:.2f} ms CPU per microbatch of {a.batch} "
              f"[{results[name]['min_ms']:.2f}-{results[name]['max_ms']:.2f}]", flush=True)
    result = {
        "command": command_line("main_thread.py", a), "code": str(Path(ddpmrepro.__file__).parent),
        "draws_on_reader_thread": hasattr(TrainExamples, "draws"), "machine": platform.machine(),
        "processor": platform.processor(), "torch": torch.__version__, "threads": a.threads, "batch": a.batch,
        "shapes": results,
    }
    tag = "" if hasattr(TrainExamples, "draws") else "-draws_on_main"
    write_result(result, a.out or Path(f"benchmarks/results/main_thread{tag}-threads{a.threads}.json"))


if __name__ == "__main__":
    main()
