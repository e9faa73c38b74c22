"""Before a local Snakemake's first job: can the trainings and samplers it is about to run start on
this machine?

`ddpmrepro train` refuses `train.device: cuda` where no GPU is visible, `train.nodes > 1` outside a
SLURM allocation of that many nodes, and more processes than GPUs (runtime/launch.py), but only
when its job runs: by then DVC has removed the stage's outputs (models/ddpm comes back with
`dvc checkout`, and only from the cache). check_params cannot refuse them earlier: it runs for a
`dvc repro prepare` on a login node too, with params meant for the cluster, and cannot know
which stages this run includes (found from outside and by our CI). The Snakefile can: it knows the
jobs it will run (`workflow.dag.needrun_jobs()`) and whether they run here (its executor).
"""
from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from .. import params as P
from .dvc_bridge import StageSpec

LAUNCHING = ("train", "sample")  # the commands that start processes on this machine's devices


def launched_command(cmd: str) -> tuple[str, str] | None:
    """('train' or 'sample', its params file) when a stage's command runs `ddpmrepro train` or
    `ddpmrepro sample` (`python -m ddpmrepro.cli ...` or the console script); None otherwise."""
    words = shlex.split(cmd)
    for i, word in enumerate(words[:-1]):
        if Path(word).name in ("ddpmrepro", "ddpmrepro.cli") and words[i + 1] in LAUNCHING:
            params, rest = "params.yaml", words[i + 2:]
            for j, arg in enumerate(rest):
                if arg in ("-p", "--params") and j + 1 < len(rest):
                    params = rest[j + 1]
                elif arg.startswith("--params="):
                    params = arg.split("=", 1)[1]
            return words[i + 1], params
    return None


def launch_problems(command: str, params: P.Params, env: Mapping[str, str]) -> list[str]:
    """Why `ddpmrepro <command>` with these params could not start here (the launcher's own checks,
    claiming nothing), a line each; empty when it can."""
    from ..runtime import launch

    problems = []

    def check(f, *args, **kwargs):
        try:
            f(*args, **kwargs)
        except launch.LaunchError as e:
            problems.append(str(e))

    if command == "train":
        if params.train.import_from:  # a published model is converted, not trained: no devices
            return []
        env = dict(env)
        check(lambda: launch.check_node_count(params.train.nodes, launch.srun_role(env), env))
        check(launch.check_devices, params.train.device, params.train.nproc, claim=False)
    elif command == "sample":
        check(launch.check_devices, "auto", params.sample.nproc, key="sample.nproc", claim=False)
    return problems


def check_jobs_here(stages: Iterable[StageSpec], env: Mapping[str, str], root: str | Path = ".") -> list[str]:
    """`Error:`-ready lines, one per problem, for the stages (those about to run on this machine)
    whose training or sampling could not start here."""
    problems = []
    for st in stages:
        launched = launched_command(st.cmd)
        if launched is None:
            continue
        command, params_file = launched
        try:
            params = P.load(Path(root) / params_file)
        except (P.ParamsError, OSError):
            continue  # the stage's own command says what is wrong with it (check_params, for params.yaml)
        problems += [f"{st.name}: {p} (checked before any job ran; nothing was removed)"
                     for p in launch_problems(command, params, env)]
    return problems
