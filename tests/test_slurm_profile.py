"""profiles/slurm on a GPU cluster: what the real one-node cluster of test_slurm_cluster.py cannot show.

That cluster has no GPUs and one node, so the sbatch lines of GPU stages (--gpus, --cpus-per-gpu,
--mem-per-cpu), the 2-node recipe of docs/CLUSTER.md and the refusal of more GPUs than a node has
are checked here against stand-ins: real Snakemake runs the real Snakefile, profile and plugin
in a temporary git + DVC repo, while `sbatch` (records its arguments, then fails), `sinfo` (two
partitions: 2 nodes with 64 CPUs, 512 GB and 8 GPUs each; CPU nodes), `scontrol show config`
and `sacctmgr` are stand-ins. The expected values come from dvc.yaml's `meta.snakemake` and
params.yaml, read here with plain YAML. Nothing is submitted or run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from project_copy import copy_project

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
SBATCH = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["FAKE_SBATCH_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit("sbatch: error: a stand-in, not a cluster")
"""
SINFO = """#!/bin/sh
printf '%s\\n' 'gpu01|gpu*|64|512000|gpu:a100:8(S:0-1)' 'gpu02|gpu*|64|512000|gpu:a100:8(S:0-1)' 'cpu01|cpu|32|128000|(null)' 'cpu02|cpu|32|128000|(null)'
"""
SCONTROL = """#!/bin/sh
printf '%s\\n' 'AccountingStorageType   = accounting_storage/slurmdbd' 'MinJobAge               = 300 sec'
"""
ACCOUNT = ["slurm_account=your_account", "slurm_partition=gpu"]  # what a user adds to the profile
MULTI_NODE = ["train:nodes=2", "train:tasks=2", "train:mpi=srun", "train:gres=gpu:4", "train:gpu=0",
              "train:tasks_per_gpu=0"]  # the docs/CLUSTER.md recipe for 2 nodes x 4 GPUs

pytestmark = pytest.mark.slow


def run(repo: Path, *cmd: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(repo / "src"),
           "DVC_NO_ANALYTICS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The project with every stage's outputs present and recorded, so that changing a param makes
    exactly the stages that read it runnable (placeholders: no stage ever runs here)."""
    repo = tmp_path_factory.mktemp("slurm")
    copy_project(repo, extra=("params.yaml",))
    run(repo, "git", "init", "-q", "-b", "main")
    run(repo, "dvc", "init", "-q")
    place_outputs(repo)
    run(repo, sys.executable, "-m", "ddpmrepro.cli", "check-params")  # real: the Snakefile refreshes them too
    run(repo, "dvc", "commit", "-f", "-q")
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "placeholders")
    stubs = repo.parent / f"{repo.name}-bin"
    stubs.mkdir()
    (stubs / "sbatch").write_text(SBATCH)
    (stubs / "sacctmgr").write_text("#!/bin/sh\necho your_account\n")
    (stubs / "sinfo").write_text(SINFO)
    (stubs / "scontrol").write_text(SCONTROL)
    for f in stubs.iterdir():
        f.chmod(0o755)
    return repo


def place_outputs(repo: Path) -> None:
    """The same placeholder for every stage output, every time (so DVC sees them unchanged).
    Not for check_params: its outputs are the resolved params, which the Snakefile rewrites while
    it parses (and the check runs locally, never through sbatch)."""
    for name, stage in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].items():
        if name == "check_params":
            continue
        dirs = set(stage.get("meta", {}).get("snakemake", {}).get("directories", []))
        for kind in ("outs", "metrics", "plots"):
            for out in stage.get(kind, []):
                path = repo / (out if isinstance(out, str) else next(iter(out)))
                if path.relative_to(repo).as_posix() in dirs:
                    path.mkdir(parents=True, exist_ok=True)
                    (path / "placeholder").write_text("x")
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("{}")


def submit(repo: Path, changes: dict, *extra: str, refused: bool = False, output: list | None = None
           ) -> dict[str, list[str]]:
    """sbatch's arguments per rule, for a Snakemake run after `changes` to params.yaml (the
    Snakemake output instead when `refused`: the Snakefile stopped it before any sbatch; appended
    to `output` when given)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split(".")
        params[section][name] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(repo / ".snakemake", ignore_errors=True)
    place_outputs(repo)  # Snakemake deleted the outputs of the jobs it submitted last time
    log = repo.parent / f"{repo.name}-sbatch.jsonl"
    log.unlink(missing_ok=True)
    stubs = repo.parent / f"{repo.name}-bin"
    proc = run(repo, "snakemake", "--workflow-profile", "profiles/slurm", "--default-resources", *ACCOUNT,
               "--retries", "0", "--latency-wait", "0", "--slurm-init-seconds-before-status-checks", "1", *extra,
               check=False,
               env={"FAKE_SBATCH_LOG": str(log), "PATH": f"{stubs}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}"})
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    if refused:
        assert proc.returncode != 0 and not log.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout + proc.stderr
    assert "SLURM sbatch failed" in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return {args[args.index("--comment") + 1].removeprefix("rule_"): args for args in calls}


def opt(args: list[str], name: str) -> str | None:
    """The value of `-t 60` / `--mem 4000` / `--gpus=2` style options in an sbatch call."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def expected(stage: str) -> dict:
    """Resources from the stage's meta in dvc.yaml and the account and partition given; threads from the meta."""
    meta = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["meta"]["snakemake"]
    given = dict(a.split("=") for a in ACCOUNT)
    return {**given, **meta.get("resources", {}), "threads": meta.get("threads", 1)}


def check_common(args: list[str], want: dict) -> None:
    assert opt(args, "-A") == want["slurm_account"] and opt(args, "-p") == want["slurm_partition"]
    assert opt(args, "-t") == str(want["runtime"])
    assert "--requeue" in args  # preempted jobs go back to the queue and resume from their checkpoint


def check_single_node_gpu(args: list[str], want: dict, gpus: int) -> None:
    check_common(args, want)
    assert opt(args, "--gpus") == str(gpus)
    assert opt(args, "--cpus-per-gpu") == str(want["cpus_per_gpu"])
    assert opt(args, "--mem-per-cpu") == str(want["mem_mb_per_cpu"]) and opt(args, "--mem") is None
    # One task that runs torchrun --standalone: no task geometry (--ntasks-per-gpu would start one copy per GPU).
    assert not [a for a in args if a.startswith(("--ntasks", "--cpus-per-task", "--nodes", "--gres"))]


def test_train_asks_for_train_nproc_gpus(repo):
    calls = submit(repo, {"train.nproc": 2})
    assert set(calls) == {"train"}  # what the param change made runnable
    check_single_node_gpu(calls["train"], expected("train"), gpus=2)
    assert "--target-jobs 'train:'" in calls["train"][-1]
    assert "--signal=TERM@300" in calls["train"]  # the SIGTERM that checkpoints and requeues before the limit


def test_more_gpus_than_a_node_has_is_refused_before_any_submission(repo):
    out = submit(repo, {"train.nproc": 16}, refused=True)
    assert "Error: stage 'train' asks for 16 GPUs (gpu) but the largest node of partition 'gpu' has 8" in out


def test_sample_asks_for_sample_nproc_gpus(repo):
    calls = submit(repo, {"sample.nproc": 3})
    assert set(calls) == {"sample"}
    check_single_node_gpu(calls["sample"], expected("sample"), gpus=3)


@pytest.mark.parametrize("recipe", [[], MULTI_NODE])
def test_train_nodes_gives_one_task_per_node(repo, recipe):
    """train.nodes: 2 asks for what docs/CLUSTER.md's --set-resources recipe asked by hand (which,
    agreeing with it, still gives the same request)."""
    calls = submit(repo, {"train.nproc": 4, "train.nodes": 2}, *(["--set-resources", *recipe] if recipe else []))
    args = calls["train"]
    check_common(args, expected("train"))
    assert opt(args, "--nodes") == "2" and opt(args, "--ntasks") == "2" and opt(args, "--gres") == "gpu:4"
    assert opt(args, "--cpus-per-gpu") == str(expected("train")["cpus_per_gpu"])
    assert opt(args, "--gpus") is None and opt(args, "--ntasks-per-gpu") is None


def test_a_node_count_in_set_resources_other_than_train_nodes_is_refused_before_submission(repo):
    """DVC compares params, not Snakemake's resources: a two-node run by `--set-resources
    train:nodes=2` under train.nodes: 1 was recorded as the one-node run, and `dvc repro` on one
    node then handed its weights back as up to date (found from outside)."""
    out = submit(repo, {"train.nproc": 4}, "--set-resources", *MULTI_NODE, refused=True)
    errors = [line for line in out.splitlines() if line.startswith("Error: ")]
    assert errors == ["Error: --set-resources train:nodes=2 differs from train.nodes=1: the node count is part of the "
                      "run, so it is set in params.yaml (train.nodes: 2); Snakemake then asks for the nodes itself"], out


def test_multi_node_on_a_partition_without_gpus_counts_the_nodes(repo):
    """The recipe on CPU nodes (as on tests/test_multinode_cluster.py's cluster): each node runs
    train.nproc processes on the CPUs of its own task, and the notice says so per node."""
    output = []
    calls = submit(repo, {"train.nproc": 2, "train.nodes": 2}, "--set-resources", "train:slurm_partition=cpu",
                   output=output)
    args = calls["train"]
    assert opt(args, "--nodes") == "2" and opt(args, "--ntasks") == "2"
    per_node = int(opt(args, "--cpus-per-task"))  # one task (one torchrun) per node
    assert per_node >= 2  # at least a CPU per process
    assert f"train: partition 'cpu' has no GPUs: its 2 process(es) run on {per_node} CPUs on each of 2 nodes" in output[0]
