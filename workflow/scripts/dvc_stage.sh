#!/usr/bin/env bash
# One Snakemake job = one DVC stage:   workflow/scripts/dvc_stage.sh STAGE LOG
# runs `dvc --wait-for-lock repro --single-item STAGE > LOG 2>&1` and exits with its status.
#
# Inside a SLURM job it also makes preemption and time limits end in a resume, not a crash.
# SLURM sends SIGTERM to every process of the job step at once (`scancel --signal=TERM`,
# `--signal=TERM@N` before the time limit, preemption, a plain `scancel`). `ddpmrepro train`
# answers by saving a checkpoint at the end of the current step and exiting 130 ("stopped,
# rerun to resume"), but the processes between Snakemake and the training (this shell, dvc,
# the torchrun launcher) would die at once, the job step would end, and SLURM would kill the
# training while it writes its checkpoint. So SIGTERM is ignored here, and by dvc and the
# stage's processes (inherited; ddpmrepro train installs its own handler), and all of them
# wait for the training; a stage without a handler runs on until SLURM's SIGKILL (KillWait later).
#
# When the stage stopped to resume (exit 130) while the job is still RUNNING (a signal, not a
# cancel or a time limit already reached) and may be requeued (`--requeue`, profiles/slurm),
# the job requeues itself: SLURM ends it, holds it (about 2 minutes) and starts it again as the
# same job id, which resumes from the checkpoint. Snakemake sees that job PENDING and RUNNING
# again and waits for it to COMPLETE: no resubmission, no retry used up, however many times
# a long training is stopped. In any other case the job fails, and Snakemake's `retries` resubmit it.
#
# A failed stage's own one-line errors are repeated on stderr, where Snakemake shows them (its own
# message names only the log file).
set -u
stage=$1 log=$2

say_why() {
  echo "stage $stage failed (exit $1); from $log:" >&2
  grep -E "^(Error|ERROR): " "$log" | head -n 5 >&2
}

if [ -z "${SLURM_JOB_ID:-}" ]; then
  dvc --wait-for-lock repro --single-item "$stage" > "$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || say_why $rc
  exit $rc
fi

trap '' TERM
dvc --wait-for-lock repro --single-item "$stage" > "$log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -qE "exited with 130$" "$log"; then
  job=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null)
  if [[ " $job " == *" JobState=RUNNING "* && " $job " == *" Requeue=1 "* ]]; then
    echo "stage $stage stopped to resume: requeueing SLURM job $SLURM_JOB_ID" | tee -a "$log"
    # The requeued job's Snakemake starts LOG afresh: this part is kept beside it, numbered as
    # scontrol counts restarts (SLURM_RESTART_COUNT does not reach the job step's processes).
    [[ " $job " =~ \ Restarts=([0-9]+)\  ]] && part=${BASH_REMATCH[1]} || part=0
    cp "$log" "${log%.log}.slurm-$SLURM_JOB_ID-$part.log"
    if scontrol requeue "$SLURM_JOB_ID"; then
      trap - TERM
      sleep 3600 # SLURM ends this job now; nothing here may report a failure first
    fi
  fi
fi
[ $rc -eq 0 ] || say_why $rc
exit $rc
