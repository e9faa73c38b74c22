"""A 4-run CPU sweep four ways, and `dvc exp show` with 20 experiments in the repo.

    PYTHONPATH=src python benchmarks/sweep.py --workdir /tmp/sweep-bench

Builds a git + DVC repo of the pipeline on short params in --workdir, runs the baseline, then
the same sweep (4 values of train.seed; each mode its own seeds, so no run-cache hits) as:

- sequential:  `dvc exp run -S ...` four times (each job: every core);
- sequential_1_thread: the same with OMP_NUM_THREADS=1;
- queue_turns: `dvc exp run --queue ...` x4, `dvc queue start -j 2` (each job: every core, so
  cpu_slots makes their CPU stages take turns);
- queue_side_by_side: the same with OMP_NUM_THREADS=1 (each job: 1 core, 2 jobs side by side).

Then it queues cheap experiments (report.top_k: only check_params and report rerun) until the
repo holds --experiments, and times `dvc exp show` (cold: -f re-collects; warm: DVC's exp cache).
Records wall times, the load average before and after each mode (others' work on a shared
machine shows there), and writes benchmarks/results/sweep.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from project_copy import copy_project  # noqa: E402
from results_io import command_line, write_result  # noqa: E402

SHORT = {
    "train": {"steps": 100, "batch_per_proc": 64, "warmup_steps": 10, "checkpoint_every": 50, "log_every": 25},
    "introspect": {"every": 25},
    "sample": {"per_class": 10, "respacing": "ddim20"},
    "evaluator": {"epochs": 2},
    "evaluate": {"bpd_images": 16},
}
MODES = {  # name: (how, OMP_NUM_THREADS, first seed)
    "sequential": ("exp run", None, 1),
    "sequential_1_thread": ("exp run", "1", 11),
    "queue_turns": ("queue -j 2", None, 21),
    "queue_side_by_side": ("queue -j 2", "1", 31),
}


def sh(repo: Path, *cmd: str, env: dict) -> str:
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def wait_for_queue(repo: Path, env: dict) -> None:
    while True:
        time.sleep(3)
        status = subprocess.run(["dvc", "queue", "status"], cwd=repo, env=env, capture_output=True, text=True).stdout
        if "Running" not in status and "Queued" not in status:
            if "Failed" in status:
                sys.exit(f"a queued experiment failed:\n{status}")
            return


def make_repo(workdir: Path, env: dict) -> Path:
    repo = workdir / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    copy_project(repo)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in SHORT.items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q", "-b", "main"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "short params"], ["dvc", "repro"], ["git", "add", "-A"],
                ["git", "commit", "-qm", "baseline"]):
        sh(repo, *cmd, env=env)
    return repo


def run_mode(repo: Path, how: str, omp: str | None, first_seed: int, env: dict) -> dict:
    env = {**env, **({"OMP_NUM_THREADS": omp} if omp else {})}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    seeds = range(first_seed, first_seed + 4)
    if how == "exp run":
        for s in seeds:
            sh(repo, "dvc", "exp", "run", "-S", f"train.seed={s}", env=env)
    else:
        for s in seeds:
            sh(repo, "dvc", "exp", "run", "--queue", "-S", f"train.seed={s}", env=env)
        sh(repo, "dvc", "queue", "start", "-j", "2", env=env)
        wait_for_queue(repo, env)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "omp_num_threads": omp, "load_before": load_before, "load_after": os.getloadavg()}


def time_exp_show(repo: Path, env: dict, repeats: int) -> dict:
    out = {}
    for name, extra in (("cold (-f)", ["-f"]), ("warm", [])):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sh(repo, "dvc", "exp", "show", "--no-pager", *extra, env=env)
            times.append(time.perf_counter() - t0)
        out[name] = {"median_s": statistics.median(times), "all_s": times}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--experiments", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sweep.json")
    a = ap.parse_args()
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "DDPMREPRO_CPU_SLOTS")}
    env.update(PATH=bindir + os.pathsep + os.environ["PATH"], DVC_NO_ANALYTICS="1",
               DDPMREPRO_CPU_LOCK_DIR=str(a.workdir / "cpu-locks"))
    repo = make_repo(a.workdir, env)
    modes = {}
    for name, (how, omp, seed) in MODES.items():
        modes[name] = run_mode(repo, how, omp, seed, env)
        print(f"{name:20} {modes[name]['wall_s']:7.1f} s  (load {modes[name]['load_before'][0]:.1f} -> "
              f"{modes[name]['load_after'][0]:.1f})", flush=True)
    n = len(sh(repo, "dvc", "exp", "ls", "--name-only", env=env).split())
    for k in range(max(0, a.experiments - n)):
        sh(repo, "dvc", "exp", "run", "--queue", "-S", f"report.top_k={k + 2}", env=env)
    if a.experiments > n:
        sh(repo, "dvc", "queue", "start", "-j", "2", env=env)
        wait_for_queue(repo, env)
    n = len(sh(repo, "dvc", "exp", "ls", "--name-only", env=env).split())
    show = time_exp_show(repo, env, a.repeats)
    for name, r in show.items():
        print(f"dvc exp show, {n} experiments, {name}: {r['median_s']:.2f} s (median of {a.repeats})", flush=True)
    write_result({"command": command_line("sweep.py", a, skip=("out",)), "cpu_count": os.cpu_count(),
                  "short_params": SHORT, "modes": modes, "exp_show": {"experiments": n, **show}}, a.out)


if __name__ == "__main__":
    main()
