# ddpmrepro as a Snakemake workflow: the table of contents.
#
# The rules are generated from dvc.yaml (workflow/rules/dvc_stages.smk); every job runs
# `dvc --wait-for-lock repro --single-item STAGE`, so DVC decides what is stale and records
# the results, and Snakemake schedules them within `--resources gpu=N` or on SLURM.
#   snakemake --cores all --resources gpu=4
#   snakemake --workflow-profile profiles/slurm
import yaml
from snakemake.utils import min_version

from ddpmrepro.pipeline.check_params import check_params_file, put_back_resolved, resolved_as_they_are
from ddpmrepro.pipeline.dvc_bridge import is_dry_run

min_version("9.0")


configfile: "params.yaml"


# `snakemake --report report.html`: this page, then the outputs dvc.yaml marks under meta.snakemake.report.
report: "workflow/report/workflow.rst"


# DVC reads params.yaml itself: a --config override would make the two tools disagree.
with open("params.yaml") as _f:
    if config != yaml.safe_load(_f):
        raise ValueError("Edit params.yaml (or use `dvc exp run -S key=value`) instead of --config overrides")


# A bad params.yaml stops Snakemake here, before any job starts (and DVC removes an output).
# The main process also brings reports/params/ (check_params' outputs, the --out of its command
# in dvc.yaml) up to date, so DVC's status already shows what a params edit makes stale; a job's
# own parse only reads them (where they match, it skips building the network: no torch import).
# A dry run (-n) writes nothing: each stage's `params:` in dvc.yaml already makes DVC's status see
# an edit of its sections; only a default changed in the code is seen by the real run alone.
RESOLVED_BEFORE = resolved_as_they_are("reports/params")  # put back if the run is refused in onstart
check_params_file("params.yaml", "reports/params", write=workflow.is_main_process and not is_dry_run(workflow))


include: "workflow/rules/slurm.smk"
include: "workflow/rules/dvc_stages.smk"


# Before the first job: on SLURM, stop if a job could never start or be seen to end; locally, if a
# training or sampling job could not start on this machine (before DVC removes its outputs).
onstart:
    try:
        check_slurm_jobs()
        check_local_jobs()
    except SystemExit:
        put_back_resolved("reports/params", RESOLVED_BEFORE)  # a refused run changes no output
        raise


# On SLURM a failed job shows here only as "SLURM status is: 'FAILED'" and its log's path (found
# from outside): say the stage's own one-line error too, from its log. (Locally dvc_stage.sh's
# stderr already says it.)
onerror:
    say_slurm_job_errors()


# `rule all` lives here: a default target set inside an included file is dropped.
rule all:
    default_target: True
    input:
        [o.path for st in STAGES for o in st.outs],
