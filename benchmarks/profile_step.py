"""Where a training step's time goes, statement by statement: ddpmrepro's loop next to the plain loop.

    pip install py-spy==0.4.3      # a sampling profiler (not a dependency of the project)
    PYTHONPATH=src python benchmarks/profile_step.py --threads 1
    PYTHONPATH=src python benchmarks/profile_step.py --threads 2

Each contender of benchmarks/train_step.py (same model, batch and optimizer settings) is built and
warmed up, then py-spy samples the main thread for --steps steps (in a separate process per
contender, so the two never share the cores). Each sample is charged to the statement of the
loop that was running (the line of `train()` in ddpmrepro/train.py, or of `PlainLoop.step`),
which separates the work both loops do (forward, backward, optimizer) from what only ddpmrepro
does per step (per-example draws, timestep sampler, loss statistics, logging). Prints the share
of each statement and ms/step (wall and process CPU); with --out, writes the table as JSON.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ddpmrepro import params as P
from ddpmrepro.data import prepare
import ddpmrepro.training.loop as ddpm_train
import train_step  # benchmarks/ is on sys.path
from train_step import DdpmreproLoop, PlainLoop, bench_params, train_paths

LOOP_FRAMES = {"ddpmrepro": "train (ddpmrepro/train.py:", "plain": "PlainLoop.step (train_step.py:"}
SOURCES = {"ddpmrepro": Path(ddpm_train.__file__), "plain": Path(train_step.__file__)}


def statement_shares(raw: Path, loop_frame: str, source: Path) -> dict[str, float]:
    """py-spy's raw (collapsed) stacks -> share of samples per loop statement (with its source text)."""
    lines = source.read_text().splitlines()
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        mine = [i for i, f in enumerate(frames) if f.startswith(loop_frame)]
        if not mine:
            counts["(outside the loop)"] += int(n)
            continue
        i = mine[-1]
        lineno = int(frames[i].rsplit(":", 1)[1].rstrip(")"))
        counts[f"{source.name}:{lineno}  {lines[lineno - 1].strip()[:70]}"] += int(n)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.most_common()}


def profile_one(a, mode: str, raw: Path) -> dict:
    """Runs in its own process: build, warm up, sample --steps steps."""
    torch.set_num_threads(a.threads)
    cfg = SimpleNamespace(image_size=8, channels=1, preset="tiny", batch=a.batch, steps=a.steps, device="cpu",
                          precision="fp32")
    total = a.warmup + a.steps
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepare(P.DataParams(), tmp / "data")
        if mode == "plain":
            loop = PlainLoop(cfg, bench_params(cfg, "uniform", total).train, tmp / "data", "plain", total)
        else:
            loop = DdpmreproLoop(bench_params(cfg, "uniform", total), train_paths(tmp, tmp / "data"))
        loop.run(a.warmup)
        spy = subprocess.Popen([a.py_spy, "record", "--pid", str(os.getpid()), "--rate", str(a.rate),
                                "--nonblocking", "--format", "raw", "--output", str(raw)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(2)  # py-spy attaches
        t0, c0 = time.perf_counter(), time.process_time()
        loop.run(a.steps)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
        if mode != "plain":
            loop.finish()
    if not raw.exists():
        raise SystemExit(f"Error: py-spy wrote no profile: {err.strip()[-500:]}")
    return {"ms_per_step_wall": 1e3 * wall / a.steps, "ms_per_step_cpu": 1e3 * cpu / a.steps,
            "load_avg": list(os.getloadavg()), "shares": statement_shares(raw, LOOP_FRAMES[mode], SOURCES[mode])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60, help="sampled steps")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rate", type=int, default=250, help="samples per second")
    ap.add_argument("--top", type=int, default=12, help="statements shown per contender")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--one", choices=list(LOOP_FRAMES), help=argparse.SUPPRESS)  # the per-contender child
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(profile_one(a, a.one, Path(tempfile.mkdtemp()) / "raw.txt")))
        return
    if not shutil.which(a.py_spy):
        raise SystemExit("Error: py-spy not found; `pip install py-spy==0.4.3` (any venv) or pass --py-spy PATH")
    results = {}
    for mode in LOOP_FRAMES:
        child = subprocess.run([sys.executable, __file__, "--one", mode, *sys.argv[1:]], capture_output=True,
                               text=True, timeout=1800)
        if child.returncode:
            raise SystemExit(child.stderr[-2000:])
        results[mode] = r = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{mode}: {r['ms_per_step_wall']:.1f} ms/step wall, {r['ms_per_step_cpu']:.1f} ms/step process CPU, "
              f"{a.threads} threads, load {r['load_avg'][0]:.2f}")
        for k, v in list(r["shares"].items())[:a.top]:
            print(f"  {100 * v:6.2f}%  {k}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"threads": a.threads, "batch": a.batch, "steps": a.steps, **results}, indent=2))


if __name__ == "__main__":
    main()
