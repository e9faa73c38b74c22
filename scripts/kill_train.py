"""Fault injection: SIGKILL `ddpmrepro train` at random moments until it finishes, then check
that the result is bitwise identical to an uninterrupted run and that no checkpoint was ever
left corrupt.

    PYTHONPATH=src python scripts/kill_train.py --kills 10 --nproc 1 --json benchmarks/results/kill_train.json

Checkpoints are written every step, so many kills land during a write. After every kill each
complete checkpoint (data file + sha256 sidecar) must verify and load; a data file without a
sidecar (a kill between the two writes) must be ignored by the resume.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from ddpmrepro.checkpoint import list_checkpoints, load_checkpoint, load_weights  # noqa: E402
from ddpmrepro.data import prepare  # noqa: E402
from ddpmrepro.params import DataParams  # noqa: E402

PARAMS = {
    "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
              "num_head_channels": 16},
    "diffusion": {"timesteps": 10},
    "train": {"steps": 40, "batch_per_proc": 16, "warmup_steps": 2, "checkpoint_every": 1, "keep_checkpoints": 3,
              "log_every": 5, "timestep_sampler": "loss-second-moment", "ema_rates": [0.99]},
    "introspect": {"every": 5},
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


def kill_tree(proc: subprocess.Popen) -> None:
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


def newest_step(run: Path) -> int:
    """The newest complete checkpoint's step, from file names only (no loading)."""
    steps = [int(p.stem.split("_")[1]) for p in (run / "ckpt").glob("*/*/step_*.sha256")]
    return max(steps, default=0)


def run_with_kills(run: Path, data: Path, params: Path, nproc: int, targets: list[int], rng: random.Random) -> dict:
    """Launch after launch, SIGKILLs the whole process group once training has passed the next
    target step plus a random 0-0.2 s (checkpoints are written every step, so the kill often
    lands inside a write); then verifies the checkpoints and launches again."""
    kills, launches, at_kill = 0, 0, []
    for target in targets + [None]:
        launches += 1
        proc = subprocess.Popen(command(run, data, params, nproc), env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        if target is not None:
            while proc.poll() is None and newest_step(run) < target:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.2))
            if proc.poll() is None:
                kill_tree(proc)
                kills += 1
                steps = verify_checkpoints(run)
                at_kill.append(steps[-1] if steps else 0)
                continue
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"training failed after {kills} kills: {err.decode()[-2000:]}")
        if (run / "model" / "model.safetensors").exists():
            break
    return {"kills": kills, "launches": launches, "last_checkpoint_at_each_kill": at_kill}


def same_result(a: Path, b: Path) -> bool:
    for name in ("model.safetensors", "ema_0.99.safetensors"):
        wa, wb = load_weights(a / "model" / name), load_weights(b / "model" / name)
        if wa.keys() != wb.keys() or not all(torch.equal(wa[k], wb[k]) for k in wa):
            return False
    return True


def main(kills: int = 10, nproc: int = 1, seed: int = 0, workdir: Path | None = None) -> dict:
    rng = random.Random(seed)
    root = Path(workdir or tempfile.mkdtemp(prefix="kill_train_"))
    data = root / "data"
    if not data.exists():
        prepare(DataParams(), data)
    raw = {k: dict(v) for k, v in PARAMS.items()}
    raw["train"].update(nproc=nproc, batch_per_proc=16 // nproc)
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    t0 = time.time()
    subprocess.run(command(root / "straight", data, params, nproc), env=env(), check=True, capture_output=True)
    steps = raw["train"]["steps"]
    targets = sorted(rng.sample(range(1, steps - 1), kills))
    killed = run_with_kills(root / "killed", data, params, nproc, targets, rng)
    result = {**killed, "nproc": nproc, "kill_after_steps": targets, "steps": steps,
              "checkpoints_after": verify_checkpoints(root / "killed"),
              "bitwise_identical": same_result(root / "straight", root / "killed"),
              "seconds": round(time.time() - t0, 1)}
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = main(args.kills, args.nproc, args.seed)
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    sys.exit(0 if res["bitwise_identical"] else 1)
