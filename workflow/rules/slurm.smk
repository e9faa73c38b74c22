# SLURM: each stage's threads and resources fitted to its partition, and every job checked
# against the partition's nodes before the first submission (src/ddpmrepro/pipeline/slurm.py).
# Elsewhere (local runs, dry runs) the stages keep the values from dvc.yaml.
#
# The fitting runs where the job's resources are evaluated: in this process when it submits
# (executor slurm) and again inside the job (Snakemake's job step re-parses this file), so both
# ask sinfo and agree on what the job has; the partition comes from --set-resources or
# --default-resources, which Snakemake passes on to the job.
import functools
import os
import sys
import time
from pathlib import Path

from ddpmrepro.pipeline import slurm

SLURM_EXECUTORS = {"slurm", "slurm-jobstep"}


def on_slurm():
    plugin = workflow.executor_plugin
    if plugin is not None and plugin.name in SLURM_EXECUTORS:
        return True
    return not workflow.is_main_process and "SLURM_JOB_ID" in os.environ  # a job's inner Snakemake


@functools.cache
def slurm_cluster():
    return slurm.read_cluster() if on_slurm() else None


def slurm_partition(rule):
    """--set-resources RULE:slurm_partition=... or --default-resources slurm_partition=... (None: the default)."""
    settings = workflow.resource_settings
    for resources in (settings.overwrite_resources.get(rule) or {}, settings.default_resources or {}):
        value = dict(resources.items()).get("slurm_partition")
        if value is not None and value.raw is not None:
            return str(value.raw).strip("'\"")
    return None


def stage_device(st):
    return str((config.get(st.name) or {}).get("device", "auto"))  # train.device; other stages: auto


def stage_nodes(st):
    """train.nodes for the training (one torchrun of train.nproc processes per node); 1 elsewhere."""
    return int((config.get("train") or {}).get("nodes", 1)) if st.name == "train" else 1


@functools.cache
def fitted(name):
    st = next(s for s in STAGES if s.name == name)
    resources = dict(st.resources)
    override = workflow.resource_settings.overwrite_resources.get(st.rule) or {}
    if "mem_mb" in override and "mem_mb_per_cpu" not in override:
        resources["mem_mb_per_cpu"] = 0  # --set-resources RULE:mem_mb=N: the plugin would prefer --mem-per-cpu
    cluster = slurm_cluster()
    if cluster is None or st.local:  # a local rule runs where Snakemake runs, never on a node
        return st.threads, resources
    threads, resources = slurm.fit(st.threads, resources, cluster.partition(slurm_partition(st.rule)), stage_device(st))
    return threads, slurm.across_nodes(resources, stage_nodes(st))


def fitted_threads(st):
    return lambda wildcards, attempt: fitted(st.name)[0]


def fitted_resources(st):
    """Callables, evaluated once the executor is known; cpus_per_task/cpus_per_gpu 0 (gres "") mean unset."""
    keys = set(st.resources) | ({"cpus_per_task", "cpus_per_gpu"} if "gpu" in st.resources else set())
    if stage_nodes(st) > 1:
        keys |= set(slurm.MULTI_NODE_KEYS)
    unset = {"gres": ""}  # the plugin looks for "gpu" in it: a string
    return {k: (lambda k: lambda wildcards, attempt: fitted(st.name)[1].get(k, unset.get(k, 0)))(k) for k in sorted(keys)}


RUN_STARTED = time.time()


def say_slurm_job_errors():
    """The first `Error:` line of each stage log a SLURM job wrote during this run, on stderr."""
    plugin = workflow.executor_plugin
    if plugin is None or plugin.name != "slurm":
        return
    for st in STAGES:
        if st.local:  # run here: dvc_stage.sh said it on this Snakemake's stderr already
            continue
        log = Path(stage_log(st))
        if not log.is_file() or log.stat().st_mtime < RUN_STARTED:
            continue
        errors = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("Error: ")]
        if errors:
            print(f"{errors[0]}   (job {st.rule}: {log})", file=sys.stderr)


def check_slurm_jobs():
    """Stops the run before the first submission if a job could never start or never be seen to end."""
    plugin = workflow.executor_plugin
    if plugin is None or plugin.name != "slurm":
        return
    cluster = slurm_cluster()
    if cluster is None:
        raise SystemExit("Error: sinfo and scontrol do not answer here: submit from a SLURM login node")
    settings = workflow.executor_settings
    problem = slurm.check_status_source(settings.status_command, cluster, settings.init_seconds_before_status_checks)
    by_name = {st.rule: st for st in STAGES}
    problems = [problem] if problem else []
    for job in workflow.dag.needrun_jobs():
        st = by_name.get(job.rule.name)
        if st is None or st.local:
            continue
        resources = {k: v for k, v in job.resources.items() if not k.startswith("_")}
        override = workflow.resource_settings.overwrite_resources.get(st.rule) or {}
        if st.name == "train" and "nodes" in override and int(resources.get("nodes") or 1) != stage_nodes(st):
            # DVC compares params, not Snakemake's resources: the node count must be one (found from
            # outside: a one-node run was handed a two-node run's weights as up to date).
            problems.append(f"--set-resources {st.rule}:nodes={resources.get('nodes')} differs from train.nodes="
                            f"{stage_nodes(st)}: the node count is part of the run, so it is set in params.yaml "
                            f"(train.nodes: {resources.get('nodes')}); Snakemake then asks for the nodes itself")
            continue
        req = slurm.request(resources, job.threads)
        problems.append(slurm.check(st.rule, req, resources.get("slurm_partition"), cluster, stage_device(st)))
        if st.resources.get("gpu") and fitted(st.name)[1].get("gpu") == 0 and not resources.get("gpu"):
            # req.cpus counts every task's CPUs: across nodes, one task (one torchrun) per node
            where = f"{req.cpus} CPUs" if req.nodes == 1 else f"{req.cpus // req.nodes} CPUs on each of {req.nodes} nodes"
            print(f"{st.rule}: partition '{resources.get('slurm_partition') or cluster.default_partition}' has no GPUs: "
                  f"its {st.resources['gpu']} process(es) run on {where}", file=sys.stderr)
    problems = [p for p in problems if p]
    if problems:
        raise SystemExit("\n".join(f"Error: {p}" for p in problems))
