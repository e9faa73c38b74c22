"""Turns `ddpmrepro train` into the right process layout.

- already inside torchrun or a SLURM step that set the rendezvous variables: run here;
- one process: run here (no launcher needed);
- several processes on one node: re-exec under `torchrun --standalone`;
- a multi-node SLURM allocation: `srun torchrun` with the rendezvous taken from SLURM;
- already started by srun once per node: this node's torchrun, same rendezvous (never srun again);
- several nodes without SLURM (`--nnodes N --node-rank K --rdzv HOST:PORT`): this node's torchrun
  with torchrun's static rendezvous.

"torchrun" is `python -m ddpmrepro.runtime.torchrun`: torchrun whose workers die with it and whose failures
are one line (see torchrun.py). `run_launcher` ties it to this process in turn.

`launch_train` and `launch_sample` are the policy that picks among these cases (and the threads
per process, and the GPUs or cores this job takes); the CLI only parses its options and calls them.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def launch_train(device: str, nproc: int, argv: list[str], *, max_restarts: int = 0, nnodes: int = 1,
                 node_rank: int | None = None, rdzv: str | None = None, precision: str = "fp32") -> int | None:
    """Starts the processes `ddpmrepro train` needs and returns the launcher's exit code, or None
    when this process is the one to train (one process, or a worker that torchrun already started).

    :param device: train.device ("auto", "cuda" or "cpu").
    :param nproc: processes (GPUs) per node.
    :param argv: this process's CLI arguments (`sys.argv[1:]`); the workers get them without the
        launcher's own options (`worker_args`).
    :param nnodes: the nodes the run is on (train.nodes); on SLURM the allocation must have as many.
    :param node_rank, rdzv: a multi-node run without SLURM (checked by the caller).
    :param precision: train.precision, noted where this machine has no fast path for it (once, here).
    :raises LaunchError: a launch that cannot work as started (one line).
    """
    from .distributed import in_launch

    if in_launch():
        return None
    args = worker_args(argv)
    if nnodes > 1 and rdzv is not None:  # several nodes without SLURM: this node's torchrun
        cmd = static_torchrun_command(nproc, args, nnodes, node_rank, rdzv, max_restarts=max_restarts)
        if check_devices(device, nproc, claim=False):
            os.environ["OMP_NUM_THREADS"] = str(node_threads(dict(os.environ), nproc))
        return run_launcher(cmd)
    os.environ.update(slurm_allocation(os.environ))  # Snakemake's SLURM job step drops the node list
    role = srun_role(dict(os.environ))  # raises when srun started one copy per GPU
    check_node_count(nnodes, role, dict(os.environ))
    multinode = role == "per-node" or slurm_nodes() > 1
    # On several nodes SLURM hands out the nodes: no machine-wide slots to claim on this one.
    on_cpu = check_devices(device, nproc, claim=not multinode)
    if on_cpu:
        note_slow_here(precision, "cpu", "train.precision")
    if multinode and on_cpu:  # each node's processes get the threads a one-node run would give them
        os.environ["OMP_NUM_THREADS"] = str(node_threads(dict(os.environ), nproc))
    if role == "per-node":
        return run_launcher(node_torchrun_command(nproc, args, dict(os.environ), max_restarts=max_restarts))
    if slurm_nodes() > 1:
        return run_launcher(srun_torchrun_command(nproc, args, dict(os.environ), max_restarts=max_restarts), srun=True)
    if nproc > 1:
        return run_launcher(torchrun_command(nproc, args, max_restarts=max_restarts))
    return None


def launch_sample(nproc: int, argv: list[str], precision: str = "fp32", check_first=None) -> int | None:
    """Starts the processes `ddpmrepro sample` needs (one node: the images are sharded over its
    ranks) and returns the launcher's exit code, or None when this process samples. `check_first()`
    runs before any wait for cores or GPUs (a wrong --model said at once: found from outside)."""
    from .distributed import in_launch

    if in_launch():
        return None
    if srun_role(dict(os.environ)) != "once":
        raise LaunchError("ddpmrepro sample runs on one node: start it once, not with srun on several nodes")
    if check_first is not None:
        check_first()
    if check_devices("auto", nproc, key="sample.nproc"):
        note_slow_here(precision, "cpu", "sample.precision")
    if nproc > 1:
        return run_launcher(torchrun_command(nproc, worker_args(argv)))
    return None


def note_slow_here(precision: str, device, key: str) -> None:
    from .autocast_network import note_slow_here as note  # torch: only where a run is launched

    note(precision, device, key)


def check_devices(device: str, nproc: int, *, key: str = "train.nproc", claim: bool = True) -> bool:
    """On GPUs: fails when nproc is more than the visible GPUs, and (claim) takes GPUs that no
    concurrent ddpmrepro job on this machine uses (gpu_slots narrows CUDA_VISIBLE_DEVICES).
    On CPU: (claim) takes this job's cores (cpu_slots). True when the run is on CPU."""
    import torch

    from . import cpu_slots, gpu_slots

    # device_count() asks NVML and leaves CUDA uninitialised (is_available() would initialise it),
    # so the CUDA_VISIBLE_DEVICES set by gpu_slots still applies to a run in this very process.
    have = torch.cuda.device_count()
    if device == "cpu" or (device == "auto" and have == 0):
        if claim:
            cpu_slots.claim(nproc)
        return True
    if device == "cuda" and have == 0:  # the key to change is the device, not the process count
        raise LaunchError(f"{key.split('.')[0]}.device: cuda, but no CUDA device is visible here; set it to auto "
                          "(a GPU where there is one) or cpu, or run on a GPU machine")
    if nproc > have:
        raise LaunchError(f"{key}={nproc} processes need {nproc} GPUs but {have} are visible; "
                          f"lower {key} or set CUDA_VISIBLE_DEVICES")
    if claim:
        gpu_slots.claim(nproc, device_count=have)
    return False


def slurm_nodes(env=None) -> int:
    env = os.environ if env is None else env
    return int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))


def in_slurm_job(env) -> bool:
    return "SLURM_JOB_ID" in env


def check_node_count(nodes: int, role: str, env: dict) -> None:
    """A run is on the nodes train.nodes names, not on whatever the allocation has: the node count
    is part of the run (the global batch), and DVC, which compares params, must see it (found from
    outside: a one-node `dvc repro` handed back a two-node run's weights as up to date)."""
    if role == "per-node":
        have, what = int(env.get("SLURM_STEP_NUM_NODES", "1")), "srun step"
    else:
        have, what = slurm_nodes(env), "SLURM allocation"
    if have != nodes and (in_slurm_job(env) or role == "per-node"):
        raise LaunchError(f"train.nodes={nodes}, but this {what} has {have} node(s): set train.nodes: {have} in "
                          f"params.yaml (the node count is part of the run, which DVC must see), or ask SLURM for "
                          f"{nodes} node(s)")
    if have != nodes:  # outside SLURM: only the static rendezvous (--node-rank, --rdzv) runs on several
        raise LaunchError(f"train.nodes={nodes} runs on {nodes} nodes: in a SLURM allocation of {nodes} nodes, or "
                          "with `ddpmrepro train --node-rank K --rdzv HOST:PORT` on each node (docs/CLUSTER.md)")


LAUNCHER_OPTIONS = ("--nproc", "--max-restarts", "--nnodes", "--node-rank", "--rdzv")


def worker_args(argv: list[str]) -> list[str]:
    """The CLI arguments for the workers, without the launcher's options (`--nproc N`,
    `--max-restarts N`, `--nnodes N`, `--node-rank K`, `--rdzv HOST:PORT`: consumed by the
    launcher; torchrun's argparse would take some of them for its own options)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in LAUNCHER_OPTIONS:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in LAUNCHER_OPTIONS)):
            out.append(a)
    return out


def _restartable(max_restarts: int) -> list[str]:
    """By default torchrun shares its rendezvous store with the workers, and a restarted group
    can read the failed attempt's addresses and never connect (pytorch/pytorch#135712): with
    restarts on, every attempt gets a store of its own."""
    return ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] if max_restarts else []


def torchrun_command(nproc: int, worker_args: list[str], *, max_restarts: int = 0) -> list[str]:
    """torchrun for one node; `--standalone` picks a free port and a fresh rendezvous id,
    so concurrent jobs on one host never collide."""
    return [
        *_restartable(max_restarts), sys.executable, "-m", "ddpmrepro.runtime.torchrun",
        "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
        "-m", "ddpmrepro.cli", *worker_args,
    ]


def srun_torchrun_command(nproc: int, worker_args: list[str], env: dict, *, port: int | None = None,
                          max_restarts: int = 0, scontrol: str = "scontrol") -> list[str]:
    """One torchrun per node through srun; the first node of the allocation hosts the
    c10d rendezvous, and the job id names it so two jobs never join each other.

    `--kill-on-bad-exit=0 --wait=60`, not `--kill-on-bad-exit=1`: at a preemption (or a
    `--signal=TERM@N` before the time limit) every node's torchrun saves and exits 130 ("stopped,
    rerun to resume"), but a few hundred ms apart (each agent polls its workers every 0.1 s). With
    kill-on-bad-exit=1 the first 130 made srun kill the other node's task, and srun returned 143,
    so workflow/scripts/dvc_stage.sh saw a failure and did not requeue the job. With 0, srun waits
    for every task and returns 130. The ranks leave the stop checkpoint through one barrier, so
    their exits are close; `--wait=60` still ends a peer that hangs 60 s after the first task
    ended (a crash elsewhere: gloo's own timeout would be 30 minutes)."""
    nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    head = node_address(first_slurm_host(env["SLURM_JOB_NODELIST"]), scontrol)
    port = rendezvous_port(env) if port is None else port
    return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--wait={PEER_WAIT_S}",
            *_rendezvous_torchrun(nproc, worker_args, nodes, head, env, port, max_restarts)]


def node_torchrun_command(nproc: int, worker_args: list[str], env: dict, *, port: int | None = None,
                          max_restarts: int = 0, scontrol: str = "scontrol") -> list[str]:
    """This node's torchrun when srun already started one `ddpmrepro train` per node: the
    same rendezvous as `srun_torchrun_command`, taken from the step's nodes."""
    nodes = int(env["SLURM_STEP_NUM_NODES"])
    head = node_address(first_slurm_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]), scontrol)
    port = rendezvous_port(env, step=True) if port is None else port
    return _rendezvous_torchrun(nproc, worker_args, nodes, head, env, port, max_restarts)


PEER_WAIT_S = 60  # srun --wait: how long a task may outlive the first task that ended (see srun_torchrun_command)
PORT_BASE, PORT_SPAN = 20000, 10000  # rendezvous ports 20000-29999, below Linux's ephemeral ports (32768-)


def rendezvous_port(env: dict, *, step: bool = False) -> int:
    """The c10d rendezvous port of this job: the first of the step's reserved ports where SLURM
    reserves some (`MpiParams=ports=`; only a process inside the srun step that runs the
    torchruns, `step`, knows them), else 20000 + job id mod 10000. A fixed port (29500) let a
    second job whose first node was the first job's join that job's store: it could not bind the
    port and torch then silently became a client of the store that held it. Two jobs that share a
    node now collide only if their ids differ by a multiple of 10000."""
    if step:
        m = re.match(r"(\d+)", env.get("SLURM_STEP_RESV_PORTS", ""))
        if m:
            return int(m.group(1))
    job = env.get("SLURM_JOB_ID", "")
    return PORT_BASE + int(job) % PORT_SPAN if job.isdigit() else 29500


def node_address(node: str, scontrol: str = "scontrol") -> str:
    """Where the other nodes reach `node`: its NodeAddr (`scontrol show node`), which is what SLURM
    itself uses; a NodeName need not resolve as a hostname. The name when scontrol cannot tell."""
    try:
        out = subprocess.run([scontrol, "show", "node", "-o", node], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return node
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", out)
    return m.group(1) if m and m.group(1) != "(null)" else node


def node_threads(env: dict, nproc: int, cores: int | None = None) -> int:
    """Threads per process on a node of a multi-node run, by the rule of the single-node run
    (cpu_slots.claim): the node's share, OMP_NUM_THREADS when set (Snakemake sets it to the job's
    threads) else the CPUs SLURM gave the job on this node (SLURM_CPUS_ON_NODE) else the usable
    cores, split over the node's nproc processes. torch's CPU results depend on the thread count,
    so 2 nodes x 1 process equal 1 node x 2 processes only with the same threads per process."""
    from . import cpu_slots

    if cores is None:
        cores = int(env.get("SLURM_CPUS_ON_NODE") or 0) or len(cpu_slots.usable_cores())
    return max(1, cpu_slots.share(env, cores) // nproc)


def _rendezvous_torchrun(nproc, worker_args, nodes, head, env, port, max_restarts) -> list[str]:
    return [
        *_restartable(max_restarts), sys.executable, "-m", "ddpmrepro.runtime.torchrun",
        f"--nnodes={nodes}", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint={head}:{port}", f"--rdzv_id={env.get('SLURM_JOB_ID', 'ddpmrepro')}",
        "-m", "ddpmrepro.cli", *worker_args,
    ]


def static_torchrun_command(nproc: int, worker_args: list[str], nnodes: int, node_rank: int, rdzv: str, *,
                            max_restarts: int = 0) -> list[str]:
    """This node's torchrun in a multi-node run without SLURM, as the two-machine
    `torch.distributed.launch --nnodes --node_rank --master_addr --master_port` recipe: every node
    runs it with its own rank, and node 0, at HOST, hosts the rendezvous store on PORT. A static
    rendezvous: the ranks follow the node ranks, so the same command lines give the same run."""
    host, port = parse_rdzv(rdzv)
    return [
        *_restartable(max_restarts), sys.executable, "-m", "ddpmrepro.runtime.torchrun",
        f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
        f"--master_addr={host}", f"--master_port={port}", "-m", "ddpmrepro.cli", *worker_args,
    ]


def parse_rdzv(value: str) -> tuple[str, int]:
    """'HOST:PORT' -> (HOST, PORT); LaunchError (one line) otherwise."""
    host, _, port = (value or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--rdzv {value!r} is not HOST:PORT (e.g. node1:29400): the first node's address and a free port")
    return host.strip("[]"), int(port)


class LaunchError(RuntimeError):
    """A launch that cannot work as started (one line for the user)."""


def srun_role(env: dict) -> str:
    """How this process was started with respect to srun, so that it never launches twice.

    'once': not one of several tasks of an srun step (a shell, a batch script, `salloc`, `srun -n1`,
        Snakemake's job step): this process starts everything, `srun torchrun` included.
    'per-node': srun started one task on each node (`srun --ntasks-per-node=1 ddpmrepro train`):
        this task runs torchrun for its own node and joins the others; calling srun again would
        start nodes x nodes launchers.
    Several tasks on a node (one per GPU, the habit of `srun python train.py` scripts) raise
    LaunchError: the launcher starts one process per GPU itself.
    """
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))  # set by srun in each task, not by sbatch
    if tasks <= 1:
        return "once"
    nodes = int(env.get("SLURM_STEP_NUM_NODES", "1"))
    if tasks == nodes:
        return "per-node"
    raise LaunchError(f"srun started {tasks} copies of ddpmrepro on {nodes} node(s), but it starts one process "
                      "per GPU itself: run it once per allocation (without srun), or with `srun --ntasks-per-node=1`")


def slurm_allocation(env, scontrol: str = "scontrol") -> dict:
    """SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST when a SLURM job's environment lacks them, from
    `scontrol show job`; {} when they are there or outside SLURM.

    Snakemake's SLURM job step (snakemake-executor-plugin-slurm-jobstep 0.6) removes every SLURM_*
    variable but the job id from the job's environment, so a multi-node job would otherwise look
    like one node and train on the first node alone.
    """
    if not env.get("SLURM_JOB_ID") or env.get("SLURM_JOB_NODELIST"):
        return {}
    try:
        out = subprocess.run([scontrol, "show", "job", "-o", env["SLURM_JOB_ID"]], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}  # no scontrol here: a single-node run
    nodes, nodelist = re.search(r"(?:^|\s)NumNodes=(\d+)", out), re.search(r"(?:^|\s)NodeList=(\S+)", out)
    if not (nodes and nodelist) or nodelist.group(1) == "(null)":
        return {}
    return {"SLURM_JOB_NUM_NODES": nodes.group(1), "SLURM_JOB_NODELIST": nodelist.group(1)}


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist, e.g. 'gpu[03-05,07],cpu1' -> 'gpu03' (what
    `scontrol show hostnames | head -1` prints, without needing scontrol on the node)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM nodelist {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def run_launcher(cmd: list[str], *, srun: bool = False) -> int:
    """Runs torchrun (or `srun torchrun`) and returns its exit code.

    - With this package's source first on PYTHONPATH, so workers import exactly the code DVC
      hashed (matters for queued experiments in temp clones).
    - It dies with this process, whatever kills it (a parent-death signal checked against our pid):
      torchrun by SIGKILL, and its workers with it; srun by SIGTERM, which ends its job step in order.
    - It inherits our GPU-slot locks (flock belongs to the open file): the GPUs stay claimed until
      the last process that could use them is gone.
    - Stop signals reach it through us. torchrun runs in a session of its own (as its workers do),
      so each SIGINT/SIGTERM of our process group (Ctrl-C, `kill -- -PGID`) or of this process
      alone is relayed to it once, and its workers save a checkpoint and exit (130). A second Ctrl-C
      is relayed too and ends everything at once ("Aborted!"). srun stays in our process group:
      Ctrl-C reaches it from the terminal, so only SIGTERM/SIGHUP are relayed.
    - A SIGTERM that came while this process started, ignored then (under SLURM's dvc_stage.sh:
      runtime/stop_file.py), returns 130 ("stopped, rerun to resume") before anything is started.
    """
    from .gpu_slots import held_fds
    from .torchrun import parent_death_signal
    from . import stop_file

    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # src/, above the package
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    log.debug("+ %s", shlex.join(cmd))
    launcher, death = os.getpid(), signal.SIGTERM if srun else signal.SIGKILL

    def die_with_launcher():  # in the child, before exec
        if not parent_death_signal(death, launcher):
            os._exit(1)

    relay = {signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}
    if not srun:
        relay[signal.SIGINT] = signal.SIGINT
    proc, received = None, []

    def forward(signum, frame):
        received.append(signum)
        if signum in relay and proc is not None and proc.poll() is None:
            os.kill(proc.pid, relay[signum])
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        if stop_file.signalled_before():  # a SIGTERM while this process started: nothing has run yet
            print("SIGTERM came while ddpmrepro was starting: stopped before its workers started. "
                  "Rerun the same command (or `dvc repro`) to resume.", file=sys.stderr)
            return 130
        proc = subprocess.Popen(cmd, env=env, pass_fds=held_fds(), preexec_fn=die_with_launcher,
                                start_new_session=not srun)
        if received:  # a signal came while it started
            forward(received.pop(), None)
        code = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if received.count(signal.SIGINT) > 1:
        raise KeyboardInterrupt  # Ctrl-C twice: "Aborted!", as a single process says it
    if code < 0:  # torchrun or srun killed by a signal we did not send it
        print(f"Error: {'srun' if srun else 'torchrun'} (pid {proc.pid}) was killed by {signal.Signals(-code).name}; "
              "its workers died with it", file=sys.stderr)
        return 128 - code
    return code
