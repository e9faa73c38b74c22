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
# training while it writes its checkpoint. So SIGTERM is ignored by dvc and the stage's
# processes (inherited; ddpmrepro train installs its own handler), and all of them wait for the
# training; a stage without a handler runs on until SLURM's SIGKILL (KillWait later).
#
# A SIGTERM that comes before the training has installed its handler (while dvc starts and
# hashes the dependencies, while Python imports torch, loads data and a checkpoint: seconds to
# minutes) would be ignored there and lost: the training would run on to SLURM's SIGKILL. This
# shell catches it instead and leaves a file, $DDPMREPRO_STOP_FILE (exported to the stage), and
# the training looks for it once its handler is in place: it stops as if signalled then.
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

stop_dir=$(mktemp -d "${TMPDIR:-/tmp}/ddpmrepro-stop.XXXXXX") || exit 1
export DDPMREPRO_STOP_FILE=$stop_dir/stop
trap 'rm -rf "$stop_dir"' EXIT
trap ': > "$DDPMREPRO_STOP_FILE"' TERM # a builtin: the file is there within microseconds
# dvc ignores SIGTERM from its first instruction (the subshell sets it before the exec).
( trap '' TERM; exec dvc --wait-for-lock repro --single-item "$stage" ) > "$log" 2>&1 &
dvc_pid=$!
while :; do
  wait "$dvc_pid"
  rc=$?
  [ $rc -gt 128 ] || break                 # dvc's own status
  kill -0 "$dvc_pid" 2>/dev/null && continue # the trap ran (wait returns then): dvc runs on
  wait "$dvc_pid"                           # it ended: its own status (bash kept it)
  rc=$?
  break
done
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
      rm -rf "$stop_dir" # SIGKILL ends this shell: no EXIT trap
      sleep 3600 # SLURM ends this job now; nothing here may report a failure first
    fi
  fi
fi
[ $rc -eq 0 ] || say_why $rc
exit $rc
