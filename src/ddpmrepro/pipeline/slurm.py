"""What the SLURM cluster can give each stage, asked of `sinfo` before anything is submitted.

snakemake-executor-plugin-slurm turns a rule's resources into sbatch options without looking at
the cluster, and SLURM queues some requests that no node can ever run: `--cpus-per-task=8` on
2-CPU nodes stays PENDING for ever, and Snakemake waits in silence. So the Snakefile

- `fit`s each stage to the partition it goes to: threads beyond the largest node are scaled
  down (as local runs scale them down to --cores), and a GPU stage (`gpu: ${train.nproc}` in
  dvc.yaml) sent to a partition without GPUs runs its processes on CPUs instead of asking
  sbatch for `--gpus` (refused there), unless its params say `device: cuda`;
- `check`s, before the first submission, every job against the nodes of its partition and
  stops with one line naming the stage and the resource no node has;
- `check_status_source`: without accounting `sacct` knows no finished job, and with a short
  MinJobAge `squeue` forgets it before Snakemake looks again: either way Snakemake would wait
  for ever.

`request` mirrors how the plugin (2.8) builds sbatch options from resources, so that the check
looks at what sbatch will be asked for. Multi-node requests (`nodes` > 1) are checked for the
node count and GPUs per node only: how SLURM spreads their CPUs is up to the job's options.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

# The plugin polls at most every 180 s (max_sleep_time in its check_active_jobs): squeue must
# keep a finished job at least that long, with a margin for a slow poll.
PLUGIN_MAX_POLL_S = 180


@dataclass(frozen=True)
class Node:
    name: str
    partition: str
    cpus: int
    mem_mb: int
    gpus: int


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    default_partition: str | None
    accounting: bool
    min_job_age_s: int | None

    def partition(self, name: str | None) -> list[Node]:
        return [n for n in self.nodes if n.partition == (name or self.default_partition)]

    @property
    def partitions(self) -> list[str]:
        return sorted({n.partition for n in self.nodes})


@dataclass(frozen=True)
class Request:
    """What one job asks sbatch for: CPUs, memory and GPUs on each node, and how many nodes."""
    cpus: int
    cpus_from: str  # which resource the CPUs come from, for the message
    mem_mb: int
    mem_from: str
    gpus: int
    nodes: int


def gpu_count(gres: str) -> int:
    """GPUs in a sinfo %G / sbatch --gres string: 'gpu:a100:4(S:0-1),gpu:v100:2' -> 6, '(null)' -> 0."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,()]+)*?:(\d+)", gres or ""))


def parse_sinfo(text: str) -> tuple[list[Node], str | None]:
    """Lines of `sinfo -h -N -o '%N|%P|%c|%m|%G'` (one per node and partition; '*' marks the default)."""
    nodes, default = [], None
    for line in text.splitlines():
        if not line.strip():
            continue
        name, partition, cpus, mem, gres = line.split("|", 4)
        if partition.endswith("*"):
            partition = default = partition.rstrip("*")
        nodes.append(Node(name, partition, int(cpus.rstrip("+")), int(mem.rstrip("+")), gpu_count(gres)))
    return nodes, default


def parse_config(text: str) -> tuple[bool, int | None]:
    """(accounting on, MinJobAge in seconds) from `scontrol show config`."""
    storage = re.search(r"^AccountingStorageType\s*=\s*(\S+)", text, re.M)
    age = re.search(r"^MinJobAge\s*=\s*(\d+)", text, re.M)
    accounting = bool(storage) and not storage.group(1).endswith("/none")
    return accounting, int(age.group(1)) if age else None


def read_cluster(timeout: float = 30) -> Cluster | None:
    """The cluster as `sinfo` and `scontrol` see it from here; None where they do not answer."""
    try:
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"], capture_output=True, text=True,
                               timeout=timeout, check=True).stdout
        config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                                timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    nodes, default = parse_sinfo(sinfo)
    return Cluster(tuple(nodes), default, *parse_config(config)) if nodes else None


def fit(threads: int, resources: dict, nodes: list[Node], device: str = "auto") -> tuple[int, dict]:
    """A stage's threads and resources fitted to the nodes of its partition (unchanged without nodes).

    `gpu` counts processes (one per GPU). On a partition without GPUs they become CPU processes
    with `threads` CPUs each (`--cpus-per-task = gpu x threads`, no `--gpus`), as few threads as
    it takes to fit the largest node. `device: cuda` keeps the GPU request, for `check` to refuse.
    """
    if not nodes:
        return threads, dict(resources)
    fitted = dict(resources)
    most_cpus = max(n.cpus for n in nodes)
    procs = int(fitted.get("gpu") or 0)
    if procs and not any(n.gpus for n in nodes) and device != "cuda":
        threads = max(1, min(threads, most_cpus // procs))
        fitted.update(gpu=0, cpus_per_gpu=0, cpus_per_task=procs * threads)
    elif not fitted.get("cpus_per_task"):
        threads = max(1, min(threads, most_cpus))
    return threads, fitted


MULTI_NODE_KEYS = ("nodes", "tasks", "mpi", "gres", "tasks_per_gpu")


def across_nodes(resources: dict, nodes: int) -> dict:
    """A fitted request spread over `nodes` nodes (train.nodes), as docs/CLUSTER.md's recipe asks by
    hand: one task (one torchrun) per node, the command run in the batch script (`mpi`, so that
    `ddpmrepro train` starts srun itself), and the GPUs per node as `gres` (`--gpus` would be the
    job's total). One node: unchanged."""
    if nodes == 1:
        return dict(resources)
    out = dict(resources, nodes=nodes, tasks=nodes, mpi="srun", tasks_per_gpu=0)
    gpus = int(out.get("gpu") or 0)
    if gpus:
        out.update(gres=f"gpu:{gpus}", gpu=0)
    return out


def request(resources: dict, threads: int) -> Request:
    """The per-node request sbatch gets for these resources (the plugin's rules: submit_string.py)."""
    r = resources
    gpus = int(r.get("gpu") or r.get("gpus") or 0) or gpu_count(str(r.get("gres") or ""))
    cpus_per_task = int(r.get("cpus_per_task") or 0)
    if gpus:
        per_gpu = r.get("tasks_per_gpu") if r.get("tasks_per_gpu") is not None else r.get("tasks")
        tasks = int(per_gpu or 0) * gpus or 1  # --ntasks-per-gpu, else one task
        if cpus_per_task:
            cpus, cpus_from = cpus_per_task * tasks, "cpus_per_task"
        elif r.get("cpus_per_gpu"):
            cpus, cpus_from = int(r["cpus_per_gpu"]) * gpus, "cpus_per_gpu x gpu"
        else:
            cpus, cpus_from = threads * tasks, "threads"
    else:
        tasks = int(r.get("tasks") or 1)
        cpus, cpus_from = (cpus_per_task or threads) * tasks, "cpus_per_task" if cpus_per_task else "threads"
    if r.get("mem_mb_per_cpu"):
        mem, mem_from = int(r["mem_mb_per_cpu"]) * cpus, "mem_mb_per_cpu x CPUs"
    else:
        mem, mem_from = int(r.get("mem_mb") or 0), "mem_mb"
    return Request(cpus, cpus_from, mem, mem_from, gpus, int(r.get("nodes") or 1))


def check(stage: str, req: Request, partition: str | None, cluster: Cluster, device: str = "auto") -> str | None:
    """Why no node of the partition can ever run this request (None when one can)."""
    name = partition or cluster.default_partition
    nodes = cluster.partition(partition)
    fix = f"lower it (--set-resources {stage}:KEY=N) or choose another partition (--default-resources slurm_partition=NAME)"
    if not nodes:
        return (f"stage '{stage}' goes to partition '{name}', which sinfo does not list "
                f"(partitions: {', '.join(cluster.partitions)}); set --default-resources slurm_partition=NAME")
    if req.nodes > len(nodes):
        return f"stage '{stage}' asks for {req.nodes} nodes but partition '{name}' has {len(nodes)}; {fix}"
    if req.gpus and not any(n.gpus for n in nodes):
        if device == "cuda":
            fix_gpus = f"set {stage}.device: auto"
        else:  # the GPUs come from --set-resources (found from outside: it said device: auto, which it was)
            fix_gpus = f"drop the GPU request (--set-resources {stage}:gres=..., gpu or gpus)"
        why = f"; {stage}.device is 'cuda'" if device == "cuda" else ""
        return (f"stage '{stage}' asks for {req.gpus} GPU(s) but partition '{name}' has no GPUs{why}: "
                f"choose a GPU partition (--default-resources slurm_partition=NAME) or {fix_gpus}")
    wants = [("GPUs", req.gpus, "gpu", lambda n: n.gpus)]
    if req.nodes == 1:
        wants += [("CPUs", req.cpus, req.cpus_from, lambda n: n.cpus),
                  ("MB of memory", req.mem_mb, req.mem_from, lambda n: n.mem_mb)]
    for what, amount, source, have in wants:
        if amount > max(have(n) for n in nodes):
            return (f"stage '{stage}' asks for {amount} {what} ({source}) but the largest node of partition "
                    f"'{name}' has {max(have(n) for n in nodes)}; {fix}")
    if not any(all(amount <= have(n) for _, amount, _, have in wants) for n in nodes):
        asked = ", ".join(f"{amount} {what}" for what, amount, _, _ in wants if amount)
        return f"stage '{stage}' asks for {asked} on one node, and no node of partition '{name}' has all of them; {fix}"
    return None


def check_status_source(status_command: str | None, cluster: Cluster, init_wait_s: int) -> str | None:
    """Why the plugin could never see a job finish (None when it can)."""
    if status_command == "sacct" and not cluster.accounting:
        return ("this cluster keeps no accounting (AccountingStorageType=none), so sacct never reports a job as "
                "finished: use --slurm-status-command squeue (profiles/slurm sets it)")
    # The plugin itself falls back to sacct when MinJobAge < 3x its first wait.
    squeue = status_command == "squeue" and not (cluster.accounting and (cluster.min_job_age_s or 0) < 3 * init_wait_s)
    if squeue and (cluster.min_job_age_s or 0) < PLUGIN_MAX_POLL_S + 60:
        return (f"squeue forgets a finished job after MinJobAge={cluster.min_job_age_s}s, before Snakemake's next look "
                f"(up to {PLUGIN_MAX_POLL_S}s apart): use --slurm-status-command sacct where the cluster keeps "
                f"accounting, or ask for MinJobAge >= {PLUGIN_MAX_POLL_S + 60}")
    return None
