"""Fault injection: SIGKILL `ddpmrepro train` at random moments until it finishes, then check
that the result is bitwise identical to an uninterrupted run and that no checkpoint was ever
left corrupt.

    PYTHONPATH=src python scripts/kill_train.py --kills 10 --nproc 1 --json benchmarks/results/kill_train.json
    PYTHONPATH=src python scripts/kill_train.py --stage sample --kills 10 --nproc 1
    PYTHONPATH=src python scripts/kill_train.py --kill group --kills 5 --nproc 2

`--kill tree` (the default) SIGKILLs the launcher and every process under it at once, as a batch
system's cgroup kill does. `--kill group` SIGKILLs the launcher's process group only (`setsid
ddpmrepro train`, then `kill -9 -- -PGID`): torchrun starts its workers in sessions of their own,
so they must die of their parent's death; every process that was under the launcher must be gone
within 5 s (`survivors` counts those that were not, and the run lock must be free again).

Checkpoints are written every step, so many kills land during a write. After every kill each
complete checkpoint (data file + sha256 sidecar) must verify and load; a data file without a
sidecar (a kill between the two writes) must be ignored by the resume.

`--stage sample` kills `ddpmrepro sample` instead (every other kill just after it began writing
its output): after each kill the output directory must hold the earlier output, the complete new
one, or nothing, never a partial one; the final rerun must equal an uninterrupted run bitwise.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from ddpmrepro.files import load_weights  # noqa: E402

from ddpmrepro.training.checkpoint import list_checkpoints, load_checkpoint
from ddpmrepro.data import prepare  # noqa: E402
from ddpmrepro.params import DataParams  # noqa: E402

PARAMS = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16},
    "diffusion": {"timesteps": 10},
    "train": {"steps": 40, "batch_per_proc": 16, "warmup_steps": 2, "checkpoint_every": 1, "keep_checkpoints": 3,
              "log_every": 5, "timestep_sampler": "loss-second-moment", "ema_rates": [0.99]},
    "introspect": {"every": 5},
    "sample": {"respacing": ""},  # the default ddim50 cannot respace 10 timesteps (sample_main sets its own)
}


def command(run: Path, data: Path, params: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "ddpmrepro.cli", "train", "--params", str(params), "--data", str(data),
            "--out", str(run / "model"), "--live", str(run / "live"), "--introspect", str(run / "introspect"),
            "--checkpoints", str(run / "ckpt"), "--nproc", str(nproc)]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def verify_checkpoints(run: Path) -> list[int]:
    """Every complete checkpoint loads (raises otherwise); returns their steps."""
    steps = []
    for d in (run / "ckpt").glob("*/*"):  # <params+data hash>/<code version>
        for path in list_checkpoints(d):
            steps.append(load_checkpoint(path)["step"])
    return sorted(steps)


def kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL the launcher and every descendant at once, as a batch system's cgroup kill does
    (torchrun's workers may run in their own process groups and would outlive the launcher)."""
    import psutil

    family = psutil.Process(proc.pid).children(recursive=True)
    for p in [psutil.Process(proc.pid), *family]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)
    return 0


def still_running(procs: list, timeout: float) -> list:
    """The processes of `procs` still running after `timeout` seconds (a zombie is not running:
    where nothing reaps orphans, a killed one stays a zombie)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        running = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    running.append(p)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen) -> int:
    """SIGKILL the launcher's process group only (`kill -9 -- -PGID`; the launcher leads it); returns
    how many of the processes that were under it still run 5 s later (then kills them). Workers die
    of their parent's death at once: 5 s is only slack for a loaded machine."""
    import psutil

    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    alive = still_running(family, timeout=5)
    for p in alive:  # orphans: report them, then clean up so that the next launch is not disturbed
        p.kill()
    psutil.wait_procs(alive, timeout=30)
    return len(alive)


KILLS = {"tree": kill_tree, "group": kill_group}


def lock_free(run: Path, timeout: float = 5.0) -> bool:
    """No process holds the run lock of any run directory within `timeout` s of a kill (a killed
    process releases its files as its last thread exits, a moment after it looks dead)."""
    from ddpmrepro.files import CheckpointError
    from ddpmrepro.training.checkpoint import RunLock

    deadline = time.monotonic() + timeout
    for d in (run / "ckpt").glob("*/*"):
        while True:
            try:
                with RunLock(d):
                    break
            except CheckpointError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    return True


def newest_step(run: Path) -> int:
    """The newest complete checkpoint's step, from file names only (no loading)."""
    steps = [int(p.stem.split("_")[1]) for p in (run / "ckpt").glob("*/*/step_*.sha256")]
    return max(steps, default=0)


def run_with_kills(run: Path, data: Path, params: Path, nproc: int, targets: list[int], rng: random.Random,
                   kill: str = "tree") -> dict:
    """Launch after launch, SIGKILLs the launcher's processes once training has passed the next
    target step plus a random 0-0.2 s (checkpoints are written every step, so the kill often
    lands inside a write); then verifies the checkpoints and launches again."""
    kills, launches, at_kill, survivors, locked = 0, 0, [], 0, 0
    for target in targets + [None]:
        launches += 1
        proc = subprocess.Popen(command(run, data, params, nproc), env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        if target is not None:
            while proc.poll() is None and newest_step(run) < target:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.2))
            if proc.poll() is None:
                survivors += KILLS[kill](proc)
                locked += not lock_free(run)
                kills += 1
                steps = verify_checkpoints(run)
                at_kill.append(steps[-1] if steps else 0)
                continue
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"training failed after {kills} kills: {err.decode()[-2000:]}")
        if (run / "model" / "model.safetensors").exists():
            break
    return {"kills": kills, "launches": launches, "last_checkpoint_at_each_kill": at_kill, "kill": kill,
            "survivors": survivors, "lock_held_5s_after_kill": locked,
            "temp_files_left": sorted(f.name for f in run.glob("ckpt/*/*/.*.tmp.*"))}


def same_result(a: Path, b: Path) -> bool:
    for name in ("model.safetensors", "ema_0.99.safetensors"):
        wa, wb = load_weights(a / "model" / name), load_weights(b / "model" / name)
        if wa.keys() != wb.keys() or not all(torch.equal(wa[k], wb[k]) for k in wa):
            return False
    return True


def _workdir_with_data(workdir: Path | None, prefix: str) -> tuple[Path, Path]:
    """The work directory (a new temp one by default) and the prepared digits inside it."""
    root = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    data = root / "data"
    if not data.exists():
        prepare(DataParams(), data)
    return root, data


def main(kills: int = 10, nproc: int = 1, seed: int = 0, workdir: Path | None = None, kill: str = "tree") -> dict:
    rng = random.Random(seed)
    root, data = _workdir_with_data(workdir, "kill_train_")
    raw = {k: dict(v) for k, v in PARAMS.items()}
    raw["train"].update(nproc=nproc, batch_per_proc=16 // nproc)
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    t0 = time.time()
    subprocess.run(command(root / "straight", data, params, nproc), env=env(), check=True, capture_output=True)
    steps = raw["train"]["steps"]
    targets = sorted(rng.sample(range(1, steps - 1), kills))
    killed = run_with_kills(root / "killed", data, params, nproc, targets, rng, kill)
    result = {**killed, "nproc": nproc, "kill_after_steps": targets, "steps": steps,
              "checkpoints_after": verify_checkpoints(root / "killed"),
              "bitwise_identical": same_result(root / "straight", root / "killed"),
              "seconds": round(time.time() - t0, 1)}
    return result


# --- sampling --------------------------------------------------------------------------------------

SAMPLE = {"ema_rate": 0.99, "per_class": 50, "respacing": "", "batch_size": 100}  # 500 images, 10 steps


def sample_command(root: Path, out: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "ddpmrepro.cli", "sample", "--params", str(root / "params.yaml"),
            "--model", str(root / "trained" / "model"), "--out", str(out), "--nproc", str(nproc)]


def comparable(out: Path) -> dict:
    """The output's files; samples.npz as its arrays (the zip records write times). Raises when
    samples.npz is unreadable, i.e. half-written."""
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    with np.load(io.BytesIO(files.pop("samples.npz"))) as z:
        files.update({f"samples.npz:{k}": (z[k].dtype.str, z[k].shape, z[k].tobytes()) for k in z.files})
    return files


def output_state(out: Path, earlier: dict[str, bytes], complete: dict) -> str:
    """What a reader finds in the output directory: 'absent', 'earlier' or 'complete'; anything
    else (a partial or mixed output) raises."""
    if not out.exists():
        return "absent"
    if {f.name: f.read_bytes() for f in out.iterdir()} == earlier:
        return "earlier"
    try:
        if comparable(out) == complete:
            return "complete"
    except Exception as e:  # a missing or truncated samples.npz
        raise AssertionError(f"{out}: a half-written output ({type(e).__name__}: {e})") from None
    raise AssertionError(f"{out}: neither the earlier output nor the complete new one: {sorted(os.listdir(out))}")


def kill_sampling(root: Path, out: Path, nproc: int, kills: int, full_seconds: float, rng: random.Random,
                  earlier: dict, complete: dict, kill: str = "tree") -> dict:
    """Launch after launch, SIGKILLs `ddpmrepro sample`: every other kill just after it began
    writing its output (the temp directory beside OUT appears), the others at a random moment of
    its run; after each kill, checks what the output directory holds."""
    tmp = out.with_name(f".{out.name}.tmp")
    moments, states, launches, survivors = [], [], 0, 0
    while len(moments) < kills and launches < 3 * kills:
        launches += 1
        started = time.time()
        proc = subprocess.Popen(sample_command(root, out, nproc), env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        if len(moments) % 2 == 0:  # a temp dir left by an earlier kill is older than this launch
            while proc.poll() is None and not (tmp.exists() and tmp.stat().st_mtime >= started):
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.01))  # the whole write takes milliseconds
        else:
            time.sleep(rng.uniform(0.0, full_seconds))
        if proc.poll() is None:
            moment, writing = time.time() - started, tmp.exists() and tmp.stat().st_mtime >= started
            survivors += KILLS[kill](proc)
            moments.append(f"{moment:.2f}s{' (writing)' if writing else ''}")
        elif proc.returncode != 0:
            raise RuntimeError(f"sampling failed (exit {proc.returncode}) after {len(moments)} kills")
        states.append(output_state(out, earlier, complete))  # after a kill, or a run that ended first
    return {"kills": len(moments), "launches": launches + 1, "kill_moments": moments, "kill": kill,
            "survivors": survivors, "output_after_each_launch": states}


def train_in_process(raw: dict, data: Path, run: Path) -> None:
    """The model to sample from (in this process: it only has to exist, and a launch costs seconds)."""
    from ddpmrepro.params import from_dict
    from ddpmrepro.training.loop import TrainPaths, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only spin
    try:
        train(from_dict(raw), TrainPaths(data, run / "model", run / "live", run / "introspect", run / "ckpt"))
    finally:
        torch.set_num_threads(threads)


def sample_main(kills: int = 10, nproc: int = 1, seed: int = 0, workdir: Path | None = None,
                kill: str = "tree") -> dict:
    rng = random.Random(seed)
    root, data = _workdir_with_data(workdir, "kill_sample_")
    raw = {k: dict(v) for k, v in PARAMS.items()}
    raw["train"].update(steps=3)
    raw["sample"] = {**SAMPLE, "nproc": nproc}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    train_in_process(raw, data, root / "trained")
    t0 = time.time()
    subprocess.run(sample_command(root, root / "straight", nproc), env=env(), check=True, capture_output=True)
    full_seconds = time.time() - t0
    # An earlier output in place, as a rerun after changed params finds it.
    out = root / "killed" / "samples"
    out.mkdir(parents=True)
    for name in ("samples.npz", "grid.png", "params.yaml"):
        (out / name).write_bytes(f"an earlier {name}".encode())
    earlier, complete = {f.name: f.read_bytes() for f in out.iterdir()}, comparable(root / "straight")
    killed = kill_sampling(root, out, nproc, kills, full_seconds, rng, earlier, complete, kill)
    subprocess.run(sample_command(root, out, nproc), env=env(), check=True, capture_output=True)
    return {**killed, "nproc": nproc, "uninterrupted_seconds": round(full_seconds, 1),
            "final": output_state(out, earlier, complete), "bitwise_identical": comparable(out) == complete,
            "seconds": round(time.time() - t0, 1)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("train", "sample"), default="train")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--kill", choices=sorted(KILLS), default="tree",
                    help="tree: the launcher and all under it at once; group: its process group only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    load = os.getloadavg()
    res = (main if args.stage == "train" else sample_main)(args.kills, args.nproc, args.seed, kill=args.kill)
    res["load_average_before_and_after"] = [round(load[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    sys.exit(0 if res["bitwise_identical"] and not res["survivors"] else 1)
