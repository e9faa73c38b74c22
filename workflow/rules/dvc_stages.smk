# One rule per DVC stage; the job delegates to `dvc repro --single-item`.
# At parse time the main process asks DVC which stages it would run (`dvc status` plus
# everything downstream) and rewrites a stamp input for each; the inputs of all other stages
# are ancient(), and the profile sets `rerun-triggers: [mtime]`. So Snakemake runs exactly
# what DVC would run, after a fresh clone, a `dvc checkout` or a `dvc exp apply` alike.
import json
import os
import shutil
import sys
import time
from pathlib import Path

from ddpmrepro.pipeline.dvc_bridge import expand_source_dir, is_dry_run, load_stages, stages_to_run
from ddpmrepro.pipeline.jobs_here import check_jobs_here

STAGES = load_stages(".")
# The job's script, from the working directory: the project root, or cascade/ for the cascade's Snakefile.
DVC_STAGE_SCRIPT = os.path.relpath(
    Path(workflow.current_basedir.get_path_or_uri(secret_free=True)).parent / "scripts" / "dvc_stage.sh")
PRODUCED = {o.path for st in STAGES for o in st.outs}
STAMP_DIR = Path(".snakemake/dvc-stamps")  # inside .snakemake/: git- and dvc-ignored


def sync_stamps():
    will_run = stages_to_run(".")
    STAMP_DIR.mkdir(parents=True, exist_ok=True)
    for st in STAGES:
        stamp = STAMP_DIR / f"{st.rule}.stamp"
        if st.name in will_run:
            # New content, not just a new mtime: Snakemake ignores a newer input whose
            # checksum it has already recorded.
            stamp.write_text(json.dumps({"why": will_run[st.name], "t": time.time()}, default=str))
        else:
            # Old again: a stage stale at an earlier parse (an edit since reverted, or run by
            # `dvc repro`) kept a stamp newer than its outputs, and Snakemake ran it (a DVC
            # no-op, on SLURM a job with the stage's whole request) at every later call.
            if not stamp.exists():
                stamp.write_text("{}")
            os.utime(stamp, (0, 0))
    return set(will_run)


def recover_backups(dry_run=False):
    """Backups of git-tracked outputs left by a Snakemake that was killed while their job ran:
    puts back what that job deleted, drops the rest (Snakemake refuses to back up over them).
    A dry run only says what the next run will put back."""
    if any(Path(".snakemake/locks").glob("*")):
        return  # a running Snakemake's (or a stale lock, which `snakemake --unlock` clears first)
    backups = Path(".snakemake/backups")
    for o in (o for st in STAGES for o in st.outs if not o.cache):
        backup, out = backups / o.path, Path(o.path)
        if not backup.exists():
            continue
        if dry_run:
            if not out.exists():
                print(f"{o.path}: will be restored from {backup} by a run (its job was interrupted)", file=sys.stderr)
            continue
        if not out.exists():
            shutil.move(backup, out)
            print(f"{o.path}: restored from {backup} (its job was interrupted)", file=sys.stderr)
        elif backup.is_dir():
            shutil.rmtree(backup)
        else:
            backup.unlink()


# Cluster job steps re-parse this file: only the main process asks DVC.
if workflow.is_main_process:
    recover_backups(dry_run=is_dry_run(workflow))
WILL_RUN = sync_stamps() if workflow.is_main_process else {st.name for st in STAGES}


def stage_inputs(st):
    files = [f for d in st.deps for f in expand_source_dir(d, PRODUCED)]
    if st.name not in WILL_RUN:
        # Up to date for DVC: mtimes (reordered by dvc checkout/pull) must not trigger it.
        # Only on stages that will not run: Snakemake does not propagate a rerun through
        # an edge whose inputs are all ancient.
        files = [ancient(f) for f in files]
    return files + [str(STAMP_DIR / f"{st.rule}.stamp")]


def executor_on_command_line():
    """The --executor this Snakemake was started with (None: the local one). Read from its command
    line: `workflow.executor_plugin` is set only after this file is parsed."""
    for i, arg in enumerate(sys.argv):
        if arg in ("--executor", "-e") and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith("--executor="):
            return arg.split("=", 1)[1]
    return None


def runs_jobs_here():
    """This Snakemake runs the jobs' shell commands: a local run, or on SLURM the one inside the
    job: under `srun` in a job step, or, for a multi-node job (`mpi`), started by the job step
    plugin in the batch script itself (found from outside: that one was not counted, and a failed
    two-node job lost every git-tracked curve). Only it has the backups; the Snakemakes that submit,
    or run the job step plugin, would find none to restore, and keep-incomplete (profiles/slurm)
    stops them deleting the outputs."""
    if workflow.is_main_process:
        return workflow.resource_settings.cores is not None  # None: a cluster executor submits
    if "SLURM_STEP_ID" in os.environ:
        return True
    return "SLURM_JOB_ID" in os.environ and executor_on_command_line() not in ("slurm", "slurm-jobstep")


def check_local_jobs():
    """Stops the run before its first job if a training or sampling job that runs on this machine
    (a local run; on SLURM, the local rules only) could not start here: `train.device: cuda` without
    a GPU, `train.nodes: 2` outside an allocation, more processes than GPUs. The job itself would
    refuse too, after DVC removed its outputs (src/ddpmrepro/pipeline/jobs_here.py)."""
    if not workflow.is_main_process:
        return
    needed = {job.rule.name for job in workflow.dag.needrun_jobs()}
    here = [st for st in STAGES if st.rule in needed and (workflow.local_exec or st.local)]
    problems = check_jobs_here(here, os.environ)
    if problems:
        raise SystemExit("\n".join(f"Error: {p}" for p in problems))


def stage_log(st):
    return f"logs/dvc/{st.rule}.log"  # dvc repro's output for the stage (workflow/scripts/dvc_stage.sh)


def stage_outputs(st):
    outs = []
    for o in st.outs:
        # `persist` outs too (check_params'): they connect the DAG.
        out = directory(o.path) if o.is_dir else o.path
        # `meta.snakemake.report` in dvc.yaml: what `snakemake --report` shows, with its caption.
        spec = dict(st.report.get(o.path) or {})
        if "caption" in spec:  # report() reads a caption relative to this file; dvc.yaml's are from the root
            spec["caption"] = str(Path(spec["caption"]).resolve())
        if spec:
            out = report(out, **spec)
        if not o.cache and runs_jobs_here():
            # Tracked by git (cache: false): no copy in DVC's cache, and DVC deletes a stage's
            # outputs before its command runs. update() makes the Snakemake that runs the job
            # keep them before it and put them back if it fails.
            out = update(out)
        outs.append(out)
    return outs


for st in STAGES:

    rule:
        name:
            st.rule
        input:
            stage_inputs(st),
        output:
            stage_outputs(st),
        params:
            stage=st.name,  # bound now: a loop variable read in shell: would be the last stage
        threads: fitted_threads(st)  # dvc.yaml's, fitted to the partition on SLURM (slurm.smk)
        localrule: st.local
        resources:
            **fitted_resources(st),
        log:
            stage_log(st),
        shell:
            # dvc --wait-for-lock repro --single-item STAGE > LOG; on SLURM it also waits through
            # SIGTERM for a training to checkpoint and requeues the job to resume
            f"bash {DVC_STAGE_SCRIPT} {{params.stage:q}} {{log:q}}"
