"""ddpmrepro.pipeline.slurm: fitting stages to a partition and refusing what no node can run.

No cluster needed: sinfo/scontrol text is given. `request` is checked against the sbatch line
that the real snakemake-executor-plugin-slurm builds for the same resources, read the way SLURM
reads it (CPUs per GPU x GPUs, CPUs per task x tasks, memory per CPU x CPUs).
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from ddpmrepro.pipeline import slurm

SINFO = """\
cpu01|cpu*|2|24105|(null)
cpu02|cpu*|8|64000|(null)
gpu01|gpu|64|512000|gpu:a100:4(S:0-1)
gpu02|gpu|32|1024000+|gpu:v100:2,gpu:t4:1
"""
CONFIG = """\
AccountingStorageType   = accounting_storage/none
MinJobAge               = 3600 sec
"""


@pytest.fixture()
def cluster() -> slurm.Cluster:
    nodes, default = slurm.parse_sinfo(SINFO)
    return slurm.Cluster(tuple(nodes), default, *slurm.parse_config(CONFIG))


def test_sinfo_and_config_are_parsed(cluster):
    assert cluster.default_partition == "cpu" and cluster.partitions == ["cpu", "gpu"]
    assert [(n.name, n.cpus, n.mem_mb, n.gpus) for n in cluster.partition("gpu")] == [
        ("gpu01", 64, 512000, 4), ("gpu02", 32, 1024000, 3)]
    assert cluster.partition(None) == cluster.partition("cpu")
    assert (cluster.accounting, cluster.min_job_age_s) == (False, 3600)
    assert slurm.parse_config("AccountingStorageType = accounting_storage/slurmdbd\nMinJobAge = 300 sec") == (True, 300)
    assert [slurm.gpu_count(g) for g in ("(null)", "gpu", "gpu:2", "gpu:a100:4(S:0-1)", "gpu:a:1,gpu:b:2", "shard:8")] == [
        0, 0, 2, 4, 3, 0]


# --- fit: the same stage on different partitions -------------------------------------------------
TRAIN = {"gpu": 2, "cpus_per_gpu": 8, "mem_mb_per_cpu": 2000, "runtime": 1440}


def test_gpu_stage_on_a_gpu_partition_keeps_its_request(cluster):
    threads, res = slurm.fit(2, TRAIN, cluster.partition("gpu"))
    assert (threads, res) == (2, TRAIN)
    req = slurm.request(res, threads)
    assert (req.gpus, req.cpus, req.mem_mb) == (2, 16, 32000)


def test_gpu_stage_on_a_cpu_partition_runs_its_processes_on_cpus(cluster):
    # 2 processes x 2 threads fit the 8-CPU node: --cpus-per-task=4, no --gpus
    threads, res = slurm.fit(2, TRAIN, cluster.partition("cpu"))
    assert threads == 2 and res["gpu"] == 0 and res["cpus_per_task"] == 4 and res["cpus_per_gpu"] == 0
    req = slurm.request(res, threads)
    assert (req.gpus, req.cpus, req.mem_mb) == (0, 4, 8000)
    assert slurm.check("train", req, "cpu", cluster) is None
    # on 2-CPU nodes only: one thread per process
    small = [n for n in cluster.nodes if n.name == "cpu01"]
    threads, res = slurm.fit(2, TRAIN, small)
    assert (threads, res["cpus_per_task"]) == (1, 2)


def test_more_processes_than_cpus_are_refused_not_squeezed(cluster):
    threads, res = slurm.fit(2, {**TRAIN, "gpu": 16}, cluster.partition("cpu"))
    assert threads == 1 and res["cpus_per_task"] == 16
    msg = slurm.check("train", slurm.request(res, threads), "cpu", cluster)
    assert msg.startswith("stage 'train' asks for 16 CPUs (cpus_per_task) but the largest node of partition 'cpu' has 8")


def test_device_cuda_keeps_the_gpu_request_and_is_refused_on_a_cpu_partition(cluster):
    threads, res = slurm.fit(2, TRAIN, cluster.partition("cpu"), device="cuda")
    assert res == TRAIN
    msg = slurm.check("train", slurm.request(res, threads), None, cluster, device="cuda")
    assert "asks for 2 GPU(s) but partition 'cpu' has no GPUs; train.device is 'cuda'" in msg


def test_a_gpu_request_typed_by_hand_on_a_cpu_partition_says_to_drop_it_not_to_set_device_auto(cluster):
    """With train.device: auto the GPUs come from --set-resources (found from outside: the line said
    `set train.device: auto`, which it already was)."""
    msg = slurm.check("train", slurm.request({**TRAIN, "gpu": 0, "gres": "gpu:4"}, 1), "cpu", cluster)
    assert msg.endswith("has no GPUs: choose a GPU partition (--default-resources slurm_partition=NAME) or drop the "
                        "GPU request (--set-resources train:gres=..., gpu or gpus)"), msg


@pytest.mark.parametrize("gpus", [0, 4])
def test_train_nodes_spread_the_fitted_request_over_the_nodes_as_the_recipe_did(cluster, gpus):
    """slurm.across_nodes gives what docs/CLUSTER.md's --set-resources recipe typed by hand: one task
    (a torchrun) per node, the command in the batch script (mpi), GPUs per node as gres; the request
    then checks against the partition per node, as the recipe's did."""
    partition = "gpu" if gpus else "cpu"
    threads, fitted = slurm.fit(2, {**TRAIN, "gpu": gpus or 2}, cluster.partition(partition))
    assert slurm.across_nodes(fitted, 1) == fitted
    spread = slurm.across_nodes(fitted, 2)
    assert {k: spread[k] for k in ("nodes", "tasks", "mpi", "tasks_per_gpu", "gpu")} == \
        {"nodes": 2, "tasks": 2, "mpi": "srun", "tasks_per_gpu": 0, "gpu": 0}
    assert spread.get("gres") == (f"gpu:{gpus}" if gpus else None)
    req = slurm.request(spread, threads)
    assert (req.nodes, req.gpus) == (2, gpus)
    assert slurm.check("train", req, partition, cluster) is None


def test_threads_beyond_the_largest_node_are_scaled_down_like_local_cores(cluster):
    evaluate = {"runtime": 240, "mem_mb": 6000}
    assert slurm.fit(8, evaluate, cluster.partition("cpu"))[0] == 8
    assert slurm.fit(8, evaluate, [cluster.partition("cpu")[0]])[0] == 2
    assert slurm.fit(8, evaluate, [])[0] == 8  # not on SLURM: untouched


# --- check: requests no node can ever run --------------------------------------------------------
@pytest.mark.parametrize("resources, threads, partition, words", [
    ({"mem_mb": 100000}, 1, "cpu", "asks for 100000 MB of memory (mem_mb) but the largest node of partition 'cpu' has 64000"),
    ({"cpus_per_task": 12}, 1, "cpu", "asks for 12 CPUs (cpus_per_task)"),
    ({"gpu": 8, "cpus_per_gpu": 4}, 1, "gpu", "asks for 8 GPUs (gpu) but the largest node of partition 'gpu' has 4"),
    ({"gpu": 1}, 1, "cpu", "asks for 1 GPU(s) but partition 'cpu' has no GPUs"),
    # each alone fits some node, together none: 4 GPUs only on gpu01, 600 GB only on gpu02
    ({"gpu": 4, "mem_mb": 600000}, 1, "gpu", "asks for 4 GPUs, 1 CPUs, 600000 MB of memory on one node, and no node"),
    ({"nodes": 3, "gres": "gpu:2", "tasks": 3, "mpi": "srun"}, 1, "gpu", "asks for 3 nodes but partition 'gpu' has 2"),
    ({"mem_mb": 1000}, 1, "bigmem", "goes to partition 'bigmem', which sinfo does not list (partitions: cpu, gpu)"),
])
def test_impossible_requests_name_the_stage_and_the_resource(cluster, resources, threads, partition, words):
    msg = slurm.check("evaluate", slurm.request(resources, threads), partition, cluster)
    assert msg and msg.startswith("stage 'evaluate' ") and words in msg, msg


@pytest.mark.parametrize("resources, threads, partition", [
    ({"mem_mb": 64000}, 8, "cpu"),
    ({"gpu": 4, "cpus_per_gpu": 16, "mem_mb_per_cpu": 8000}, 1, "gpu"),
    ({"nodes": 2, "gres": "gpu:2", "tasks": 2, "mpi": "srun", "gpu": 0}, 1, "gpu"),  # the 2-node recipe
])
def test_requests_some_node_can_run_pass(cluster, resources, threads, partition):
    assert slurm.check("train", slurm.request(resources, threads), partition, cluster) is None


# --- request: what sbatch is asked for, against the plugin's own sbatch line ---------------------
class Resources(dict):
    __getattr__ = dict.__getitem__


def plugin_sbatch(resources: dict, threads: int) -> str:
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    job = SimpleNamespace(resources=Resources(resources), threads=threads, name="x", is_group=lambda: False)
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "", "partition": "", "workdir": "/w"}
    return get_submit_command(job, params) + set_gres_string(job)


def slurm_reading(call: str) -> tuple[int, int, int]:
    """(CPUs, MB, GPUs) of one node as SLURM reads these sbatch options."""
    def opt(name):
        m = re.search(rf"{name}[= ](\d+)", call)
        return int(m.group(1)) if m else None
    gpus = opt("--gpus") or 0
    if opt("--cpus-per-gpu"):
        cpus = opt("--cpus-per-gpu") * gpus
    else:
        tasks = opt("--ntasks") or (opt("--ntasks-per-gpu") or 0) * gpus or 1
        cpus = (opt("--cpus-per-task") or 1) * tasks
    mem = opt("--mem-per-cpu") * cpus if opt("--mem-per-cpu") else opt("--mem") or 0
    return cpus, mem, gpus


@pytest.mark.parametrize("resources, threads", [
    (TRAIN, 2),
    ({**TRAIN, "gpu": 0, "cpus_per_gpu": 0, "cpus_per_task": 4}, 2),  # a CPU run of train
    ({"gpu": 3, "mem_mb": 9000}, 5),                                 # GPUs without cpus_per_gpu
    ({"gpu": 2, "tasks_per_gpu": 1, "cpus_per_task": 4, "mem_mb": 100}, 1),
    ({"mem_mb": 6000}, 8),
    ({"tasks": 3, "cpus_per_task": 2, "mem_mb_per_cpu": 500}, 1),
    ({"mem_mb": 4000, "cpus_per_task": 0, "cpus_per_gpu": 0, "gpu": 0}, 2),  # the "unset" zeros
])
def test_request_is_what_the_plugins_sbatch_line_asks_for(resources, threads):
    req = slurm.request(resources, threads)
    assert (req.cpus, req.mem_mb, req.gpus) == slurm_reading(plugin_sbatch(resources, threads))


# --- where job status comes from -----------------------------------------------------------------
def test_status_source_that_never_sees_a_job_end_is_refused():
    def cl(accounting, age):
        return slurm.Cluster((), None, accounting, age)
    assert "use --slurm-status-command squeue" in slurm.check_status_source("sacct", cl(False, 3600), 10)
    assert slurm.check_status_source("squeue", cl(False, 3600), 10) is None
    assert slurm.check_status_source("sacct", cl(True, 300), 40) is None
    assert "MinJobAge=60s" in slurm.check_status_source("squeue", cl(False, 60), 10)
    # the plugin itself switches to sacct when MinJobAge < 3 x its first wait and accounting is there
    assert slurm.check_status_source("squeue", cl(True, 60), 40) is None
    assert "MinJobAge=200s" in slurm.check_status_source("squeue", cl(True, 200), 10)
