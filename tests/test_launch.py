"""The torchrun / srun command lines built for each launch case."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmrepro.runtime import launch


def test_single_node_uses_torchrun_standalone():
    cmd = launch.torchrun_command(4, ["train", "--params", "p.yaml"])
    assert cmd[:3] == [sys.executable, "-m", "ddpmrepro.runtime.torchrun"]  # torchrun, tied to its launcher (torchrun.py)
    assert "--standalone" in cmd and "--nproc_per_node=4" in cmd
    assert cmd[-5:] == ["-m", "ddpmrepro.cli", "train", "--params", "p.yaml"]


NO_SCONTROL = "/nonexistent/scontrol"  # node addresses fall back to the node names


def test_multi_node_uses_srun_with_rendezvous_from_slurm():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "777"}
    cmd = launch.srun_torchrun_command(8, ["train"], env, scontrol=NO_SCONTROL)
    assert cmd[0] == "srun" and "--nodes=2" in cmd and "--ntasks-per-node=1" in cmd
    assert "--nnodes=2" in cmd and "--nproc_per_node=8" in cmd
    assert "--rdzv_endpoint=gpu03:20777" in cmd and "--rdzv_id=777" in cmd and "--rdzv_backend=c10d" in cmd
    assert "--standalone" not in cmd


def test_a_stop_on_every_node_keeps_its_exit_code_130_through_srun():
    """kill-on-bad-exit=1 made srun kill the second node's torchrun when the first exited 130 a
    moment earlier, and return 143: dvc_stage.sh then did not requeue the preempted job. srun now
    waits for every task (and ends a task that outlives the first one by PEER_WAIT_S)."""
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "5"}
    srun = launch.srun_torchrun_command(1, ["train"], env, scontrol=NO_SCONTROL)
    srun = srun[:srun.index(sys.executable)]
    assert "--kill-on-bad-exit=0" in srun and "--kill-on-bad-exit=1" not in srun
    assert f"--wait={launch.PEER_WAIT_S}" in srun and 10 <= launch.PEER_WAIT_S <= 300


def test_each_job_has_its_own_rendezvous_port():
    """Two jobs whose first node is the same must not share a port: the second could not bind it
    and joined the first job's store (torch's fallback). Ports are the job's reserved ones where
    SLURM reserves some for the step, else from the job id, below the ephemeral ports."""
    ports = {launch.rendezvous_port({"SLURM_JOB_ID": str(job)}) for job in range(100, 120)}
    assert len(ports) == 20 and all(20000 <= p < 30000 for p in ports)
    assert launch.rendezvous_port({"SLURM_JOB_ID": "123456"}) == 20000 + 3456
    step = {"SLURM_JOB_ID": "8", "SLURM_STEP_RESV_PORTS": "12011-12012"}
    assert launch.rendezvous_port(step, step=True) == 12011  # inside the step that runs the torchruns
    assert launch.rendezvous_port(step) == 20008  # before srun: that step's ports are not known yet
    assert launch.rendezvous_port({}) == 29500  # not a SLURM job: torch's default
    env = {"SLURM_JOB_ID": "8", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "a[1-2]", **step}
    assert "--rdzv_endpoint=a1:12011" in launch.node_torchrun_command(1, ["train"], env, scontrol=NO_SCONTROL)


def test_the_rendezvous_host_is_the_first_nodes_address(tmp_path):
    """NodeAddr from scontrol: a NodeName need not resolve as a hostname."""
    scontrol = tmp_path / "scontrol"
    line = "NodeName=gpu03 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.2.3 NodeHostName=gpu03 Version=22.05.8"
    scontrol.write_text(f"#!/bin/sh\n[ \"$*\" = 'show node -o gpu03' ] && echo '{line}'\n")
    scontrol.chmod(0o755)
    assert launch.node_address("gpu03", str(scontrol)) == "10.1.2.3"
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "777"}
    assert "--rdzv_endpoint=10.1.2.3:20777" in launch.srun_torchrun_command(8, ["train"], env, scontrol=str(scontrol))
    assert launch.node_address("gpu04", str(scontrol)) == "gpu04"  # scontrol failed: the name
    assert launch.node_address("gpu03", NO_SCONTROL) == "gpu03"


@pytest.mark.parametrize(("omp", "nproc"), [(None, 1), (None, 2), ("1", 1), ("1", 2), ("2", 2), ("8", 1)])
def test_threads_per_process_on_each_node_are_the_one_node_runs(tmp_path, omp, nproc):
    """On one node cpu_slots.claim sets OMP_NUM_THREADS for the workers; a node of a multi-node run
    gives them exactly as many (torch's CPU results depend on the thread count): here the same
    cores, this process's."""
    cores = len(os.sched_getaffinity(0))
    env = {"DDPMREPRO_CPU_SLOTS": "1", "DDPMREPRO_CPU_LOCK_DIR": str(tmp_path), "DDPMREPRO_CPU_WAIT": "60",
           **({"OMP_NUM_THREADS": omp} if omp else {})}
    code = ("import os, sys; from ddpmrepro.runtime import cpu_slots; env = dict(os.environ); "
            f"cpu_slots.claim({nproc}, env=env, set_torch=False); print(env['OMP_NUM_THREADS'])")
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    one_node = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                              check=True).stdout.strip()
    assert str(launch.node_threads(env, nproc, cores)) == one_node
    # in a SLURM job, the node's CPUs come from SLURM (no CPU binding: the affinity is the whole machine)
    assert launch.node_threads({"SLURM_CPUS_ON_NODE": str(cores), **env}, nproc) == int(one_node)


def test_threads_from_slurms_cpus_on_the_node():
    assert launch.node_threads({"SLURM_CPUS_ON_NODE": "1"}, 1) == 1  # not the machine's cores
    assert launch.node_threads({"SLURM_CPUS_ON_NODE": "8"}, 2) == 4
    assert launch.node_threads({"SLURM_CPUS_ON_NODE": "8", "OMP_NUM_THREADS": "2"}, 2) == 1  # Snakemake's threads
    assert launch.node_threads({"SLURM_CPUS_ON_NODE": "1"}, 4) == 1  # never 0


def test_several_nodes_without_slurm_use_torchruns_static_rendezvous():
    cmd = launch.static_torchrun_command(2, ["train", "--out", "m"], 3, 1, "node1:29400")
    assert cmd[:3] == [sys.executable, "-m", "ddpmrepro.runtime.torchrun"]
    assert {"--nnodes=3", "--node_rank=1", "--nproc_per_node=2", "--master_addr=node1", "--master_port=29400"} <= set(cmd)
    assert cmd[-5:] == ["-m", "ddpmrepro.cli", "train", "--out", "m"]
    assert launch.worker_args(["train", "--nnodes", "2", "--node-rank=1", "--rdzv", "h:1", "--out", "m"]) == \
        ["train", "--out", "m"]
    for bad in ("node1", "node1:", ":29400", "node1:port", "node1:70000"):
        with pytest.raises(launch.LaunchError, match=r"is not HOST:PORT"):
            launch.static_torchrun_command(1, ["train"], 2, 0, bad)


def test_cli_refuses_nnodes_without_node_rank_and_rdzv(tmp_path):
    from click.testing import CliRunner

    from ddpmrepro.cli import main

    (tmp_path / "params.yaml").write_text("{}\n")
    for extra in (["--nnodes", "2", "--rdzv", "h:1"], ["--nnodes", "2", "--node-rank", "2", "--rdzv", "h:1"],
                  ["--nnodes", "2", "--node-rank", "0"]):
        result = CliRunner().invoke(main, ["train", "--params", str(tmp_path / "params.yaml"), *extra],
                                    env={"SLURM_JOB_ID": None})
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines()[-1] == (
            "Error: --nnodes 2 needs --node-rank K (0 to 1, a different one on each node) and --rdzv HOST:PORT "
            "(node 0's address and a free port), or a SLURM allocation of 2 nodes")
    (tmp_path / "params.yaml").write_text("train: {nodes: 3}\n")  # the params' node count, outside SLURM
    result = CliRunner().invoke(main, ["train", "--params", str(tmp_path / "params.yaml")], env={"SLURM_JOB_ID": None})
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == (
        "Error: train.nodes=3 needs --node-rank K (0 to 2, a different one on each node) and --rdzv HOST:PORT "
        "(node 0's address and a free port), or a SLURM allocation of 3 nodes"), result.output
    # On one node, --node-rank 1 and --rdzv were ignored without a word (found from outside: the
    # training ran, or a finished one was exported again)
    (tmp_path / "params.yaml").write_text("{}\n")
    for extra, flags in ((["--node-rank", "1"], "--node-rank"), (["--rdzv", "foo"], "--rdzv"),
                         (["--node-rank", "1", "--rdzv", "h:1"], "--node-rank and --rdzv")):
        result = CliRunner().invoke(main, ["train", "--params", str(tmp_path / "params.yaml"), *extra],
                                    env={"SLURM_JOB_ID": None})
        assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == (
            f"Error: {flags}: for a training on several nodes, but train.nodes=1; leave them out, "
            "or pass --nnodes N"), result.output


def test_a_slurm_allocation_of_another_node_count_than_train_nodes_is_refused():
    """train.nodes is what DVC sees; a run on the allocation's nodes instead would be recorded under
    params that say otherwise (found from outside: `dvc repro` on one node handed back a two-node run)."""
    alloc = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    launch.check_node_count(2, "once", alloc)
    with pytest.raises(launch.LaunchError, match=r"^train.nodes=1, but this SLURM allocation has 2 node\(s\): set "
                                                 r"train.nodes: 2 in params.yaml .*or ask SLURM for 1 node\(s\)$"):
        launch.check_node_count(1, "once", alloc)
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "3"}
    launch.check_node_count(3, "per-node", step)
    with pytest.raises(launch.LaunchError, match=r"^train.nodes=2, but this srun step has 3 node\(s\)"):
        launch.check_node_count(2, "per-node", step)
    launch.check_node_count(1, "once", {"SLURM_JOB_ID": "7"})  # one node, as before
    launch.check_node_count(1, "once", {})


def test_first_slurm_host():
    assert launch.first_slurm_host("node7") == "node7"
    assert launch.first_slurm_host("gpu[03-05,07],cpu1") == "gpu03"
    assert launch.first_slurm_host("a[1,4]") == "a1"
    assert launch.first_slurm_host("x1,x2") == "x1"


def test_worker_args_drop_the_launchers_nproc():
    assert launch.worker_args(["train", "--nproc", "2", "--out", "m"]) == ["train", "--out", "m"]
    assert launch.worker_args(["train", "--nproc=2", "--restart"]) == ["train", "--restart"]


def test_max_restarts_goes_to_the_launcher_not_the_workers():
    assert launch.worker_args(["train", "--max-restarts", "2", "--nproc=2", "--restart"]) == ["train", "--restart"]
    assert launch.worker_args(["train", "--max-restarts=1"]) == ["train"]
    # with restarts, each attempt gets its own rendezvous store (see launch._restartable)
    cmd = launch.torchrun_command(2, ["train"], max_restarts=3)
    assert cmd[:3] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable] and "--max-restarts=3" in cmd
    assert launch.torchrun_command(2, ["train"])[0] == sys.executable
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]"}
    cmd = launch.srun_torchrun_command(8, ["train"], env, max_restarts=3, scontrol=NO_SCONTROL)
    assert cmd[cmd.index("env") + 1] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" and "--max-restarts=3" in cmd


# Started under srun: never srun again (the environments are what srun sets in each task).
def test_srun_role_once_outside_a_multi_task_step():
    assert launch.srun_role({}) == "once"  # a shell, or a GPU server without SLURM
    # an sbatch script with --ntasks=2 (SLURM_NTASKS, but no step variables), and Snakemake's `srun -n1` job step
    assert launch.srun_role({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2"}) == "once"
    assert launch.srun_role({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1"}) == "once"


def test_srun_once_per_node_runs_this_nodes_torchrun_with_the_shared_rendezvous():
    env = {"SLURM_JOB_ID": "777", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_PROCID": "1"}
    assert launch.srun_role(env) == "per-node"
    cmd = launch.node_torchrun_command(4, ["train"], env, max_restarts=2, scontrol=NO_SCONTROL)
    assert "srun" not in cmd and "--standalone" not in cmd
    # exactly the torchrun that our own `srun torchrun` launch runs on each node
    srun = launch.srun_torchrun_command(4, ["train"], env, max_restarts=2, scontrol=NO_SCONTROL)
    assert cmd == srun[srun.index("env"):]
    assert {"--nnodes=2", "--nproc_per_node=4", "--rdzv_endpoint=gpu03:20777", "--rdzv_id=777"} <= set(cmd)


def test_srun_once_per_gpu_is_refused_with_one_line():
    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2", "SLURM_PROCID": "3"}
    with pytest.raises(launch.LaunchError, match=r"^srun started 8 copies of ddpmrepro on 2 node\(s\).*run it once per allocation"):
        launch.srun_role(env)
    with pytest.raises(launch.LaunchError):  # two copies on one node would train the same run twice
        launch.srun_role({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1"})


def test_cli_refuses_srun_per_gpu_before_anything_starts(tmp_path):
    from click.testing import CliRunner

    from ddpmrepro.cli import main

    env = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "1"}
    (tmp_path / "params.yaml").write_text("{}\n")
    for cmd in (["train"], ["sample"]):
        result = CliRunner().invoke(main, [*cmd, "--params", str(tmp_path / "params.yaml")], env=env)
        assert result.exit_code == 1
        assert result.output.strip().splitlines() == [
            "Error: srun started 4 copies of ddpmrepro on 1 node(s), but it starts one process per GPU itself: "
            "run it once per allocation (without srun), or with `srun --ntasks-per-node=1`"]


def test_node_list_from_scontrol_when_the_job_step_dropped_it(tmp_path):
    # What `scontrol show job -o` prints for a running 2-node job (abridged); ReqNodeList must not match.
    line = ("JobId=4242 JobName=snakejob UserId=me(1000) JobState=RUNNING ReqNodeList=(null) ExcNodeList=(null) "
            "NodeList=gpu[07-08] BatchHost=gpu07 NumNodes=2 NumCPUs=64 NumTasks=2 TRES=cpu=64,gres/gpu=8")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\n[ \"$*\" = 'show job -o 4242' ] && echo '{line}'\n")
    scontrol.chmod(0o755)
    # Snakemake's job step keeps only the job id among the SLURM_* variables.
    found = launch.slurm_allocation({"SLURM_JOB_ID": "4242"}, scontrol=str(scontrol))
    assert found == {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    cmd = launch.srun_torchrun_command(4, ["train"], {"SLURM_JOB_ID": "4242", **found}, scontrol=NO_SCONTROL)
    assert "--nodes=2" in cmd and "--rdzv_endpoint=gpu07:24242" in cmd
    # nothing to add: SLURM's own variables are there, or this is not a SLURM job, or no scontrol
    assert launch.slurm_allocation({"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu07"}, scontrol=str(scontrol)) == {}
    assert launch.slurm_allocation({}, scontrol=str(scontrol)) == {}
    assert launch.slurm_allocation({"SLURM_JOB_ID": "4242"}, scontrol=str(tmp_path / "missing")) == {}
    assert launch.slurm_allocation({"SLURM_JOB_ID": "1"}, scontrol=str(scontrol)) == {}  # scontrol printed nothing


def test_the_agent_reads_the_workers_reports_of_the_last_attempt_earliest_first(tmp_path, monkeypatch):
    from ddpmrepro.runtime import torchrun

    assert torchrun.report_error("not handed over", 1) is False  # no agent: the worker prints it itself
    monkeypatch.setenv(torchrun.ERROR_DIR, str(tmp_path))

    def report(rank: int, attempt: int, message: str | None, code: int = 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        assert torchrun.report_error(message, code)
    # Attempt 0: rank 0 failed first, rank 1 followed; torchrun restarted the group (--max-restarts).
    report(0, 0, "an error of the first attempt")
    report(1, 0, "its peer's consequence")
    # Attempt 1: rank 1 crashed (no message: it printed its traceback); rank 0 was killed, reporting nothing.
    report(1, 1, None)
    reports = torchrun.reported_errors(tmp_path)
    assert [(r["rank"], r["message"]) for r in reports] == [(1, None)]
    assert not list(tmp_path.glob(".*tmp"))  # written through temp files, renamed into place


def test_a_killed_agents_work_directory_is_removed_by_the_next_agent(tmp_path, monkeypatch):
    import subprocess
    import tempfile

    from ddpmrepro.runtime import torchrun

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = torchrun._host()
    killed = tmp_path / f"ddpmrepro-torchrun-{int(dead.stdout)}@{host}-a1"  # SIGKILLed: its errors/ is still there
    kept = tmp_path / f"ddpmrepro-torchrun-{int(dead.stdout)}@{host}-b2"  # ended and kept its log for the user
    running = tmp_path / f"ddpmrepro-torchrun-{os.getpid()}@{host}-c3"
    # a TMPDIR shared with another node: that pid is not this host's to judge
    elsewhere = tmp_path / f"ddpmrepro-torchrun-{int(dead.stdout)}@{host}x-d4"
    for d in (killed / "errors", kept, running / "errors", elsewhere / "errors"):
        d.mkdir(parents=True)
    (kept / "torchrun.log").write_text("the log an Error line named")
    torchrun._remove_work_dirs_of_killed_agents()
    assert not killed.exists() and kept.exists() and running.exists() and elsewhere.exists()
    work = subprocess.run([sys.executable, "-c", "import tempfile, os, socket, sys; sys.argv = ['x']; "
                           "from ddpmrepro.runtime import torchrun; print(torchrun._host())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert work == host and "@" not in host


def test_device_cuda_without_a_visible_gpu_names_the_device_key(monkeypatch):
    """It said "train.nproc=1 processes need 1 GPUs but 0 are visible; lower train.nproc": the key to
    change is the device."""
    import torch

    from ddpmrepro.runtime.launch import LaunchError, check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for key in ("train.nproc", "sample.nproc"):
        with pytest.raises(LaunchError, match=rf"^{key.split('.')[0]}\.device: cuda, but no CUDA device is visible "
                                              r"here; set it to auto \(a GPU where there is one\) or cpu"):
            check_devices("cuda", 1, key=key, claim=False)
    assert check_devices("auto", 1, claim=False)  # auto runs on the CPU


def _params(**sections):
    from ddpmrepro import params as P

    return P.from_dict({name: dict(values) for name, values in sections.items()})


def test_the_snakefiles_check_finds_the_stages_that_launch_and_their_params_files():
    """The main pipeline's and the cascade's dvc.yaml, as load_stages reads them: which commands start
    processes on devices, with which params file (the check reads that file, not params.yaml)."""
    from ddpmrepro.pipeline.dvc_bridge import load_stages
    from ddpmrepro.pipeline.jobs_here import launched_command

    root = Path(__file__).resolve().parents[1]
    found = {st.name: launched_command(st.cmd) for st in load_stages(root)}
    assert {k: v for k, v in found.items() if v} == {"train": ("train", "params.yaml"),
                                                     "sample": ("sample", "params.yaml")}
    found = {st.name: launched_command(st.cmd) for st in load_stages(root / "cascade")}
    assert {k: v for k, v in found.items() if v} == {
        "train_base": ("train", "base.yaml"), "sample_base": ("sample", "base.yaml"),
        "train_upsampler": ("train", "upsampler.yaml")}  # sample-superres: one process, no launcher
    assert launched_command("ddpmrepro train -p x.yaml --out m") == ("train", "x.yaml")
    assert launched_command("/env/bin/ddpmrepro sample --params=y.yaml") == ("sample", "y.yaml")
    assert launched_command("python -m ddpmrepro.cli evaluate --samples s") is None


def test_the_snakefiles_check_says_what_the_launcher_would_refuse_and_nothing_else(monkeypatch):
    """Each line is the launcher's own refusal (truth: check_devices / check_node_count called as
    `ddpmrepro train` calls them); a run that can start here gets none."""
    import torch

    from ddpmrepro.pipeline.jobs_here import launch_problems
    from ddpmrepro.runtime.launch import LaunchError, check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cuda = _params(train={"device": "cuda"})
    with pytest.raises(LaunchError) as refused:
        check_devices("cuda", 1, claim=False)
    assert launch_problems("train", cuda, {}) == [str(refused.value)]
    assert launch_problems("train", _params(), {}) == []
    assert launch_problems("sample", cuda, {}) == []  # sample.device is auto: the CPU
    assert launch_problems("train", _params(train={"device": "cuda", "import_from": "x.pt"}), {}) == []

    two = _params(train={"nodes": 2})
    [line] = launch_problems("train", two, {})
    assert line.startswith("train.nodes=2 runs on 2 nodes: in a SLURM allocation of 2 nodes")
    assert launch_problems("train", two, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}) == []
    [line] = launch_problems("train", two, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert line.startswith("train.nodes=2, but this SLURM allocation has 1 node(s)")
    assert len(launch_problems("train", _params(train={"nodes": 2, "device": "cuda"}), {})) == 2  # both said

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a two-GPU machine: counts checked
    assert launch_problems("train", _params(train={"nproc": 2}), {}) == []
    [line] = launch_problems("sample", _params(sample={"nproc": 4}), {})
    assert line == "sample.nproc=4 processes need 4 GPUs but 2 are visible; lower sample.nproc or set CUDA_VISIBLE_DEVICES"


def test_fp16_on_a_cpu_is_noted_once_by_the_launcher_and_fp32_is_not(monkeypatch, caplog):
    """The launcher, which runs once per run (not per torchrun worker), says that fp16 has no fast
    path on the CPU it found (a GPU preset on a laptop trained at ~60 s a step without a word)."""
    import logging

    for key in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DDPMREPRO_CPU_SLOTS", "0")  # no cores claimed from concurrent jobs
    with caplog.at_level(logging.INFO, logger="ddpmrepro.runtime.autocast_network"):
        assert launch.launch_train("cpu", 1, [], precision="fp32") is None
        assert launch.launch_sample(1, [], "bf16") is None
        assert not caplog.records
        assert launch.launch_train("cpu", 1, [], precision="fp16") is None
        assert launch.launch_sample(1, [], "fp16") is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["train.precision", "sample.precision"]
