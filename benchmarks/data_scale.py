"""Data at scale: prepare, verify, load and train on synthetic image folders of growing size.

    PYTHONPATH=src python benchmarks/data_scale.py --root /big/disk/data_scale              # 10k, 100k, 1M
    PYTHONPATH=src python benchmarks/data_scale.py --root /tmp/ds --sizes 10000,100000 --rounds 3

For each N the script (1) writes N deterministic 32x32 RGB PNGs in 10 class folders under
ROOT/raw-N (kept and reused by later runs: ~4 GB for 1M), then measures, each step in a fresh process:
  prepare     `ddpmrepro prepare` on that folder: images/s and peak RSS (VmHWM) of the main process
              and of each decode worker, and the peak of the tree's summed PSS (shared pages counted once)
  load        `load_prepared` + the first training batch: cold (no verification stamp: every shard is
              hashed) and warm (stamps valid); sha256 throughput, extrapolated to 16 GB; time to gather
              128 random rows
  train       `ddpmrepro train`, 50 steps of batch 128 with the tiny preset: peak RSS
  step time   the same training loop with rows read from the shards (background thread, pread)
              against rows indexed from the whole split held in memory (the previous code's path),
              in interleaved rounds with a random order in each: per round the ratio of median step
              times, wall clock and main-thread CPU (with --threads 1 the latter is all of a step's
              work and ignores other processes), the median and spread of the ratios, and the CPU
              time of the read-ahead thread
  dvc         the prepared output in a fresh DVC repo with the project's .dvc/config: `dvc add` time,
              `dvc status` time, and the bytes on disk of workspace + cache (hard links count once)
The load average is recorded before and after each N. Targets (issue 14): peak RSS of prepare and of
train at 1M within 1.5x of 10k, step time within 5% of in-memory, prepare of 1M under 15 minutes on
2 cores. Writes benchmarks/results/data_scale.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from results_io import command_line, write_result  # benchmarks/ (the script's directory) is on sys.path
from timing import fmt_ratio, machine_state, spread, verdict

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 10
SIZE = 32
GEN_VERSION = 1  # bump when the generated images change


# --- deterministic synthetic image folders ---------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _class_field(c: int) -> np.ndarray:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    return np.stack([np.sin(2 * np.pi * (xx * (c + 1) / 3 + k / 3)) * np.cos(2 * np.pi * yy * (k + 1) / 2)
                     for k in range(3)], -1)


def _image(i: int) -> np.ndarray:
    """Image i (class i % 10): a smooth colour field per class plus noise seeded by i; (32, 32, 3) uint8."""
    rng = np.random.default_rng([GEN_VERSION, i])
    base = _class_field(i % CLASSES)
    phase = rng.uniform(-0.3, 0.3, 3)
    img = 127.5 + 90 * np.roll(base, rng.integers(0, SIZE, 2), (0, 1)) + 40 * phase + rng.normal(0, 12, base.shape)
    return img.clip(0, 255).astype(np.uint8)


def _write_images(args) -> None:
    from PIL import Image

    folder, start, stop = args
    for i in range(start, stop):
        Image.fromarray(_image(i)).save(folder / f"{i % CLASSES:02d}" / f"{i:07d}.png", compress_level=6)


def generate(folder: Path, n: int, workers: int) -> dict:
    """ROOT/raw-N/<class>/<i>.png, reused when a complete one is there."""
    marker = folder / ".complete"
    spec = {"n": n, "size": SIZE, "classes": CLASSES, "version": GEN_VERSION}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return {"reused": True}
    shutil.rmtree(folder, ignore_errors=True)
    for c in range(CLASSES):
        (folder / f"{c:02d}").mkdir(parents=True)
    t0 = time.perf_counter()
    step = 2000
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_write_images, [(folder, s, min(n, s + step)) for s in range(0, n, step)], chunksize=1)
    seconds = time.perf_counter() - t0
    marker.write_text(json.dumps(spec))
    return {"reused": False, "seconds": seconds, "images_per_s": n / seconds, "bytes_on_disk": _du(folder)}


def _du(path: Path) -> int:
    """Bytes allocated on disk under path, each inode once (what `du` reports)."""
    return int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True)
               .stdout.split()[0]) * 1024


# --- processes, watched -------------------------------------------------------------------------------


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_watched(cmd: list[str], env: dict, cwd: Path | None = None, interval: float = 0.1) -> dict:
    """Runs cmd; samples the high-water RSS (VmHWM) of it and of every descendant, and the tree's PSS."""
    import psutil

    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    main_hwm, child_hwm, tree_pss = 0, {}, 0
    done = threading.Event()

    def watch():
        nonlocal main_hwm, tree_pss
        while not done.is_set():
            try:
                kids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                kids = []
            main_hwm = max(main_hwm, _status_kb(proc.pid, "VmHWM"))
            for k in kids:
                child_hwm[k] = max(child_hwm.get(k, 0), _status_kb(k, "VmHWM"))
            tree_pss = max(tree_pss, sum(_pss_kb(p) for p in [proc.pid, *kids]))
            done.wait(interval)

    t0 = time.perf_counter()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    done.set()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"seconds": seconds, "peak_rss_mb_main": main_hwm / 1024,
            "peak_rss_mb_worker": max(child_hwm.values(), default=0) / 1024, "processes": 1 + len(child_hwm),
            "peak_pss_mb_tree": tree_pss / 1024, "stdout": out}


def _env(cache: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "XDG_CACHE_HOME": str(cache), "DVC_NO_ANALYTICS": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# --- what is measured ---------------------------------------------------------------------------------


def train_params(a, steps: int, log_every: int) -> dict:
    return {
        "model": {"preset": "tiny"},
        "train": {"steps": steps, "batch_per_proc": a.batch, "warmup_steps": 0, "log_every": log_every,
                  "checkpoint_every": steps, "keep_checkpoints": 1},
        "introspect": {"every": 0, "steps": []},
    }


LOAD_PROBE = r"""
import json, sys, time, numpy as np
t0 = time.perf_counter()
from ddpmrepro.data import load_prepared
from ddpmrepro.training.batches import TrainBatches
from ddpmrepro.data.verify import Verifier
from ddpmrepro.files import sha256
t_import = time.perf_counter()
v = Verifier()
d = load_prepared(sys.argv[1], verifier=v)
t_load = time.perf_counter()
with TrainBatches(d.train_images, batch_size=int(sys.argv[2]), world=1, rank=0, seed=0) as b:
    b.get(0)
    t_first = time.perf_counter()
    rng = np.random.default_rng(0)
    out = np.empty((int(sys.argv[2]), *d.train_images.shape[1:]), np.uint8)
    times = []
    for _ in range(200):
        idx = rng.choice(len(d.train_images), len(out), replace=False)
        s = time.perf_counter()
        b.reader.gather(idx, out)
        times.append(time.perf_counter() - s)
shard = sorted(d.manifest["files"])[0]
s = time.perf_counter()
sha256(f"{sys.argv[1]}/{shard}")
one = time.perf_counter() - s
size = __import__("os").path.getsize(f"{sys.argv[1]}/{shard}")
print(json.dumps({"import_s": t_import - t0, "load_prepared_s": t_load - t_import, "first_batch_s": t_first - t_load,
                  "hashed_bytes": v.hashed_bytes, "verify_threads": v.threads,
                  "sha256_one_thread_gb_per_s": size / one / 1e9,
                  "gather_us_median": 1e6 * float(np.median(times)), "gather_us_p90": 1e6 * float(np.quantile(times, 0.9))}))
"""


def measure_load(a, prepared: Path, cache: Path) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    out = {}
    for name in ("cold", "warm"):  # cold: no stamp, every shard hashed; warm: the stamps of the cold run
        r = run_watched([sys.executable, "-c", LOAD_PROBE, str(prepared), str(a.batch)], _env(cache, a.threads))
        out[name] = {**json.loads(r["stdout"]), "peak_rss_mb": r["peak_rss_mb_main"]}
    data_bytes = sum(f.stat().st_size for f in prepared.glob("*.npy"))
    cold = out["cold"]
    gbps = cold["hashed_bytes"] / cold["load_prepared_s"] / 1e9  # the whole load: a lower bound on hashing speed
    out.update({"data_bytes": data_bytes, "verify_gb_per_s": gbps, "verify_16gb_s_at_this_rate": 16 / gbps,
                "verify_16gb_s_one_thread": 16 / cold["sha256_one_thread_gb_per_s"]})
    return out


class StepClock:
    """Wall and main-thread CPU time at each microbatch request: the time between two requests is one
    training step (here grad_accum is 1). Main-thread CPU time does not count other processes' work, so
    it resolves small differences on a busy machine; it is all of a step's work with --threads 1."""

    def __init__(self):
        self.marks: list[tuple[float, float]] = []
        self.reader_cpu: list[float] = []  # CPU seconds of each read-ahead thread

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), time.thread_time()))

    def steps(self, last: int) -> tuple[list[float], list[float]]:
        m = self.marks[-(last + 1):]
        return [b[0] - a[0] for a, b in zip(m, m[1:])], [b[1] - a[1] for a, b in zip(m, m[1:])]


CLOCK = StepClock()


def _timed_shards():
    from ddpmrepro.training.batches import TrainBatches

    class TimedBatches(TrainBatches):
        """The library's read-ahead, with the clock marks and the thread's own CPU time."""

        def get(self, micro):
            CLOCK.mark()
            return super().get(micro)

        def _read_ahead(self, micro):
            t0 = time.thread_time()
            try:
                super()._read_ahead(micro)
            finally:
                CLOCK.reader_cpu.append(time.thread_time() - t0)

    return TimedBatches


class InMemoryBatches:
    """The previous code's path: the whole split as one in-memory tensor, `images[idx]` when asked (and
    the examples' draws on the asking thread)."""

    images = None  # set once per N, outside the timed blocks

    def __init__(self, images, *, batch_size, world, rank, seed, device=None, prepare=None):
        from ddpmrepro.training.batches import epoch_order

        self.prepare = prepare  # the examples' draws: made here, on the training thread, as the previous code did
        self.order, self.batch_size, self.n, self.seed = epoch_order, batch_size, len(images), seed
        self.per_epoch = (self.n // world) // batch_size
        self.world, self.rank, self.cache = world, rank, None

    def get(self, micro):
        CLOCK.mark()
        epoch, pos = divmod(micro, self.per_epoch)
        if self.cache is None or self.cache[0] != epoch:
            self.cache = (epoch, self.order(self.n, self.world, self.rank, self.seed, epoch))
        idx = self.cache[1][pos * self.batch_size:(pos + 1) * self.batch_size]
        rows = InMemoryBatches.images[idx]
        return (idx, rows) if self.prepare is None else self.prepare(micro, idx, rows)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def paired_step_time(a, prepared: Path, work: Path) -> dict:
    """Step times of the last `pair_steps` of 2 x pair_steps + 1 steps, shards vs memory, in interleaved
    rounds (random order in each): per round the ratio of the median step times, wall and main-thread CPU."""
    import torch

    from ddpmrepro import params as P
    from ddpmrepro.training import loop as T
    from ddpmrepro.data import load_prepared

    if a.threads:
        torch.set_num_threads(a.threads)
    library = T.TrainBatches
    modes = {"shards": _timed_shards(), "memory": InMemoryBatches}
    InMemoryBatches.images = torch.as_tensor(np.asarray(load_prepared(prepared).train_images))
    # One step more than measured: the interval between requests m and m + 1 is step m.
    params = P.from_dict(train_params(a, 2 * a.pair_steps + 1, a.pair_steps))
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for r in range(a.rounds):
            for mode in random.Random(r).sample(list(modes), 2):
                T.TrainBatches = modes[mode]
                run = Path(tempfile.mkdtemp(dir=work))
                CLOCK.marks.clear()
                T.train(params, T.TrainPaths(prepared, run / "model", run / "live", run / "introspect", run / "ckpt"),
                        restart=True)
                w, c = CLOCK.steps(a.pair_steps)
                wall[mode].append(statistics.median(w))
                cpu[mode].append(statistics.median(c))
                shutil.rmtree(run)
            print(f"  round {r + 1}/{a.rounds}: step time shards {wall['shards'][-1]:.3f} s "
                  f"(CPU {cpu['shards'][-1]:.3f}), memory {wall['memory'][-1]:.3f} s (CPU {cpu['memory'][-1]:.3f})",
                  flush=True)
    finally:
        T.TrainBatches, InMemoryBatches.images = library, None
    out = {"rounds": a.rounds, "steps_per_block": a.pair_steps, "threads": torch.get_num_threads(),
           "step_s_median_per_round": wall, "main_thread_cpu_s_median_per_round": cpu,
           "reader_thread_cpu_s_per_run": CLOCK.reader_cpu}
    for name, t in (("step_time", wall), ("cpu_time", cpu)):
        ratios = [s / m for s, m in zip(t["shards"], t["memory"])]
        summary = spread(ratios)  # median, min-max, IQR and the 95% interval that resolves the target or cannot
        out.update({f"{name}_ratio_per_round": ratios, f"{name}_ratio": summary,
                    f"{name}_target_1.05": verdict(summary, 1.05)})
        print(f"  {name} shards / memory: {fmt_ratio(summary)}: {verdict(summary, 1.05)}", flush=True)
    out["machine_after"] = machine_state()
    return out


def measure_dvc(prepared: Path, work: Path) -> dict:
    """`dvc add` and `dvc status` on the prepared output in a fresh repo with the project's cache config."""
    repo = work / "dvc-repo"
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "data" / "prepared").mkdir(parents=True)
    for f in prepared.iterdir():  # hard links: the benchmark's copy and the repo's share the bytes
        os.link(f, repo / "data" / "prepared" / f.name)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}

    def sh(*cmd):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True, text=True)
        return time.perf_counter() - t0

    sh("git", "init", "-q")
    sh("dvc", "init", "-q")
    shutil.copy2(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    add = sh("dvc", "add", "-q", "data/prepared")
    status = [sh("dvc", "status", "-q") for _ in range(3)]
    links = {f.stat().st_nlink for f in (repo / "data" / "prepared").iterdir()}
    out = {"add_s": add, "status_s": status, "status_s_median": statistics.median(status),
           "files": len(list(prepared.iterdir())), "data_bytes": _du(prepared),
           "repo_bytes_on_disk": _du(repo), "link_counts": sorted(links)}
    shutil.rmtree(repo)
    return out


def one_size(a, n: int) -> dict:
    root = a.root
    raw, prepared, cache, work = root / f"raw-{n}", root / f"prepared-{n}", root / f"cache-{n}", root / f"work-{n}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res: dict = {"n": n, "load_avg_before": list(os.getloadavg())}
    print(f"N = {n}: generating", flush=True)
    res["generate"] = generate(raw, n, a.workers or len(os.sched_getaffinity(0)))

    print(f"N = {n}: prepare", flush=True)
    data = {"data": {"source": "image_folder", "root": str(raw), "image_size": SIZE, "channels": 3,
                     "test_fraction": a.test_fraction}}
    (work / "prepare.yaml").write_text(json.dumps(data))
    cmd = [sys.executable, "-m", "ddpmrepro.cli", "prepare", "--params", str(work / "prepare.yaml"),
           "--out", str(prepared)] + (["--workers", str(a.workers)] if a.workers else [])
    r = run_watched(cmd, _env(cache, a.threads))
    manifest = json.loads((prepared / "manifest.json").read_text())
    res["prepare"] = {k: v for k, v in r.items() if k != "stdout"}
    res["prepare"].update({"images_per_s": n / r["seconds"], "shards": len(manifest["files"]) // 2,
                           "bytes": sum(f.stat().st_size for f in prepared.glob("*.npy")),
                           "workers": a.workers or len(os.sched_getaffinity(0))})
    res["n_train"] = manifest["splits"]["train"]["count"]

    print(f"N = {n}: load", flush=True)
    res["load"] = measure_load(a, prepared, cache)

    print(f"N = {n}: train {a.train_steps} steps", flush=True)
    (work / "train.yaml").write_text(json.dumps({**data, **train_params(a, a.train_steps, a.train_steps)}))
    r = run_watched([sys.executable, "-m", "ddpmrepro.cli", "train", "--params", str(work / "train.yaml"),
                     "--data", str(prepared), "--out", str(work / "model"), "--live", str(work / "live"),
                     "--introspect", str(work / "introspect"), "--checkpoints", str(work / "ckpt"), "--restart"],
                    _env(cache, a.threads))
    res["train"] = {"steps": a.train_steps, "batch": a.batch, "seconds": r["seconds"],
                    "peak_rss_mb": r["peak_rss_mb_main"]}

    if a.rounds:
        print(f"N = {n}: step time, shards vs memory", flush=True)
        res["step_time"] = paired_step_time(a, prepared, work)
    if a.dvc:
        print(f"N = {n}: dvc", flush=True)
        res["dvc"] = measure_dvc(prepared, work)
    res["load_avg_after"] = list(os.getloadavg())
    shutil.rmtree(work, ignore_errors=True)
    if not a.keep:
        shutil.rmtree(prepared, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="work directory on a disk with room (~5 GB per 1M)")
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=50, help="steps of the training run whose RSS is measured")
    ap.add_argument("--pair-steps", type=int, default=10, help="measured steps per block of the step-time pairs")
    ap.add_argument("--rounds", type=int, default=5, help="step-time rounds (0: skip)")
    ap.add_argument("--workers", type=int, default=0, help="decode workers (0: prepare's default, the CPUs allowed)")
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: torch's default)")
    ap.add_argument("--test-fraction", type=float, default=0.02)
    ap.add_argument("--dvc", type=int, default=1, help="1: measure dvc add/status on each prepared output")
    ap.add_argument("--keep", type=int, default=0, help="1: keep the prepared outputs under ROOT")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/data_scale.json"))
    a = ap.parse_args()
    a.root = a.root.resolve()
    sizes = [int(s) for s in a.sizes.split(",")]
    results = [one_size(a, n) for n in sizes]
    lo, hi = results[0], results[-1]
    summary = {
        "prepare_peak_rss_ratio_largest_vs_smallest": hi["prepare"]["peak_rss_mb_main"] / lo["prepare"]["peak_rss_mb_main"],
        "prepare_peak_pss_tree_ratio": hi["prepare"]["peak_pss_mb_tree"] / lo["prepare"]["peak_pss_mb_tree"],
        "train_peak_rss_ratio_largest_vs_smallest": hi["train"]["peak_rss_mb"] / lo["train"]["peak_rss_mb"],
        "prepare_minutes_largest": hi["prepare"]["seconds"] / 60,
        "step_time_ratio_medians": {r["n"]: r["step_time"]["step_time_ratio"]["median"] for r in results
                                    if "step_time" in r},
        "main_thread_cpu_ratio_medians": {r["n"]: r["step_time"]["cpu_time_ratio"]["median"] for r in results
                                          if "step_time" in r},
    }
    result = {
        "command": command_line("data_scale.py", a, skip=("out",)),
        "machine": {"platform": platform.platform(), "cpus_allowed": len(os.sched_getaffinity(0)),
                    "python": platform.python_version(), "numpy": np.__version__},
        "targets": "prepare and train peak RSS at the largest N <= 1.5x the smallest; step time shards / memory "
                   "<= 1.05; prepare of 1M images < 15 min on 2 cores",
        "summary": summary, "sizes": results,
    }
    write_result(result, a.out)
    for r in results:
        p, ld, t = r["prepare"], r["load"], r["train"]
        st = r.get("step_time", {})
        print(f"N={r['n']:>8}: prepare {p['images_per_s']:7.0f} img/s, RSS main {p['peak_rss_mb_main']:6.0f} MB "
              f"(workers {p['peak_rss_mb_worker']:5.0f} MB, tree PSS {p['peak_pss_mb_tree']:6.0f} MB); load cold "
              f"{ld['cold']['load_prepared_s']:.2f} s, warm {ld['warm']['load_prepared_s']:.2f} s; train RSS "
              f"{t['peak_rss_mb']:6.0f} MB; step time shards/memory {st['step_time_ratio']['median'] if st else float('nan'):.3f}")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
