"""Where a training step waits on the host: torch.profiler over ddpmrepro's loop and the plain loop.

    PYTHONPATH=src python benchmarks/step_host_profile.py --device cuda --preset tiny --batch 128
    PYTHONPATH=src python benchmarks/step_host_profile.py --device cuda --preset ddpm-cifar10 --image-size 32 --channels 3 --precision bf16

On a GPU a step is short (tens of ms), so what the loop does on the CPU between kernel launches,
and every point where it waits for the GPU (`.item()`, `.cpu()`, a host copy), can set its speed.
For each contender this prints ms/step (wall, after a synchronize), the number of host-device
synchronisations per step and the Python lines that cause them, and the ops with the most CPU time.
"""
from __future__ import annotations

import argparse
import collections
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ddpmrepro import params as P
from ddpmrepro.data import prepare
from train_step import DdpmreproLoop, PlainLoop, bench_params, cuda_sync, train_paths  # benchmarks/ is on sys.path

SYNC_OPS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def profile_loop(name, loop, a, sync) -> None:
    for _ in range(a.warmup):
        loop.run(1)
    sync()
    t0 = time.perf_counter()
    loop.run(a.steps)
    sync()
    wall_ms = (time.perf_counter() - t0) / a.steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        loop.run(a.steps)
        sync()
    events = prof.key_averages()
    print(f"\n=== {name}: {wall_ms:.1f} ms/step unprofiled ({a.steps} steps)")
    for op in SYNC_OPS:
        n = sum(e.count for e in events if e.key == op)
        if n:
            print(f"  {op}: {n / a.steps:.1f} per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=50))
    if a.device == "cuda":
        for where, n in synchronising_lines(loop, a.steps).most_common(15):
            print(f"  synchronises x{n / a.steps:.1f}/step at {where}")


def synchronising_lines(loop, steps: int, debug_mode=None) -> collections.Counter:
    """The Python lines (outside torch) of every call that waits for the GPU, from CUDA's
    synchronisation debug mode, which warns at each one (`debug_mode`: its setter, for the tests)."""
    debug_mode = debug_mode or torch.cuda.set_sync_debug_mode
    where = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename]
        where[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:][::-1])] += 1

    with warnings.catch_warnings():  # restores the filters and showwarning after
        warnings.simplefilter("always")
        warnings.showwarning = record
        debug_mode("warn")
        try:
            loop.run(steps)
        finally:
            debug_mode("default")
    return where


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model-channels", type=int, default=0)
    ap.add_argument("--image-size", type=int, default=8)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="profiled steps (and as many timed before)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--modes", default="ddpmrepro,plain")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    sync = cuda_sync(a.device)
    total = a.warmup + 3 * a.steps
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data_dir = tmp / "prepared"
        prepare(P.DataParams(image_size=a.image_size, channels=a.channels), data_dir)
        for mode in a.modes.split(","):
            if mode.startswith("ddpmrepro"):
                loop = DdpmreproLoop(bench_params(a, "loss-second-moment" if "+is" in mode else "uniform", total),
                                     train_paths(tmp, data_dir))
            else:
                loop = PlainLoop(a, bench_params(a, "uniform", total).train, data_dir, mode, total)
            profile_loop(mode, loop, a, sync)
            if mode.startswith("ddpmrepro"):
                loop.finish()


if __name__ == "__main__":
    main()
