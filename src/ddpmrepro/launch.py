"""Turns `ddpmrepro train` into the right process layout.

- already inside torchrun or a SLURM step that set the rendezvous variables: run here;
- one process: run here (no launcher needed);
- several processes on one node: re-exec under `torchrun --standalone`;
- a multi-node SLURM allocation: `srun torchrun` with the rendezvous taken from SLURM.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys


def slurm_nodes() -> int:
    return int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))


def worker_args(argv: list[str]) -> list[str]:
    """The CLI arguments for the workers, without `--nproc N` (consumed by the launcher, and
    torchrun's argparse would take it as an abbreviation of its own --nproc-per-node)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def torchrun_command(nproc: int, worker_args: list[str], *, max_restarts: int = 0) -> list[str]:
    """torchrun for one node; `--standalone` picks a free port and a fresh rendezvous id,
    so concurrent jobs on one host never collide."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
        "-m", "ddpmrepro.cli", *worker_args,
    ]


def srun_torchrun_command(nproc: int, worker_args: list[str], env: dict, *, port: int = 29500,
                          max_restarts: int = 0) -> list[str]:
    """One torchrun per node through srun; the first node of the allocation hosts the
    c10d rendezvous, and the job id names it so two jobs never join each other."""
    nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    head = first_slurm_host(env["SLURM_JOB_NODELIST"])
    return [
        "srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nodes}", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint={head}:{port}", f"--rdzv_id={env.get('SLURM_JOB_ID', 'ddpmrepro')}",
        "-m", "ddpmrepro.cli", *worker_args,
    ]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist, e.g. 'gpu[03-05,07],cpu1' -> 'gpu03' (what
    `scontrol show hostnames | head -1` prints, without needing scontrol on the node)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM nodelist {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def run_launcher(cmd: list[str]) -> int:
    """Runs the launcher with this package's source first on PYTHONPATH, so workers import
    exactly the code DVC hashed (matters for queued experiments in temp clones)."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)
