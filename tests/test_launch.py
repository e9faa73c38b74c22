"""The torchrun / srun command lines built for each launch case."""
import sys

from ddpmrepro import launch


def test_single_node_uses_torchrun_standalone():
    cmd = launch.torchrun_command(4, ["train", "--params", "p.yaml"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc_per_node=4" in cmd
    assert cmd[-5:] == ["-m", "ddpmrepro.cli", "train", "--params", "p.yaml"]


def test_multi_node_uses_srun_with_rendezvous_from_slurm():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "777"}
    cmd = launch.srun_torchrun_command(8, ["train"], env)
    assert cmd[0] == "srun" and "--nodes=2" in cmd and "--ntasks-per-node=1" in cmd
    assert "--nnodes=2" in cmd and "--nproc_per_node=8" in cmd
    assert "--rdzv_endpoint=gpu03:29500" in cmd and "--rdzv_id=777" in cmd and "--rdzv_backend=c10d" in cmd
    assert "--standalone" not in cmd


def test_first_slurm_host():
    assert launch.first_slurm_host("node7") == "node7"
    assert launch.first_slurm_host("gpu[03-05,07],cpu1") == "gpu03"
    assert launch.first_slurm_host("a[1,4]") == "a1"
    assert launch.first_slurm_host("x1,x2") == "x1"


def test_worker_args_drop_the_launchers_nproc():
    assert launch.worker_args(["train", "--nproc", "2", "--out", "m"]) == ["train", "--out", "m"]
    assert launch.worker_args(["train", "--nproc=2", "--restart"]) == ["train", "--restart"]
