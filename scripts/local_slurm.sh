#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (Debian/Ubuntu), to try the SLURM path of the pipeline
# on a laptop and to test it for real in CI:
#
#   sudo scripts/local_slurm.sh up       # install (apt) if missing, configure, start, wait until idle
#   scripts/local_slurm.sh status        # daemons, the node and the queue; exit 0 only when usable
#   sudo scripts/local_slurm.sh down     # stop the daemons that `up` started
#
# The cluster: munge for authentication, slurmctld + slurmd on this host, one node with this
# host's real CPUs and memory (`slurmd -C`), one default partition `debug`, no GPUs (gres) and
# no accounting database. Without accounting `sacct` knows no finished job, so job status comes
# from `squeue`, and MinJobAge keeps finished jobs visible there for an hour (the SLURM profile
# asks the Snakemake plugin for `squeue`; the plugin needs MinJobAge >= 3x its first status wait).
# We chose this over slurmdbd + MariaDB: two fewer daemons and a database to install, and it is
# the setup where a missing override hangs silently, which is what the tests must keep closed.
#
# It never touches a SLURM setup it did not write: an existing /etc/slurm/slurm.conf without
# our marker line stops it. Every failure is one line starting with `Error:` and a non-zero exit.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # the daemons, for users whose PATH lacks them

CONF=/etc/slurm/slurm.conf
MARK="# Written by ddpmrepro scripts/local_slurm.sh"
PARTITION=debug
PACKAGES=(slurmctld slurmd slurm-client munge)
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
STARTED=/run/ddpmrepro-slurm.started   # the daemons this script started (down stops only those)
WAIT_S=${LOCAL_SLURM_WAIT_S:-60}

die() { echo "Error: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "'$1' installs packages and starts daemons: run it as root (sudo $0 $1)"; }
alive() { [ -f "$1" ] && [ -d "/proc/$(cat "$1")" ]; }  # kill -0 fails for non-root
ours() { [ -f "$CONF" ] && head -1 "$CONF" | grep -qF "$MARK"; }

install() {
  local missing=()
  for cmd in slurmctld slurmd sinfo munged; do
    command -v "$cmd" >/dev/null || missing+=("$cmd")
  done
  [ ${#missing[@]} = 0 ] && return
  command -v apt-get >/dev/null || die "${missing[*]} missing and no apt-get here: install SLURM and munge with your package manager"
  echo "installing ${PACKAGES[*]} (apt)"
  apt-get update -qq >/dev/null || die "apt-get update failed (network or sources); run it yourself to see why"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null \
    || die "apt-get install ${PACKAGES[*]} failed; run it yourself to see why"
}

write_conf() {
  # This host as slurmd sees it: NodeName=... CPUs=... Boards=... ... RealMemory=...
  local node host
  node=$(slurmd -C | head -1)
  [[ $node == NodeName=* ]] || die "slurmd -C printed no node line ($node)"
  host=${node%% *}; host=${host#NodeName=}
  id slurm >/dev/null 2>&1 || die "no user 'slurm' (Debian's slurm packages create it): reinstall ${PACKAGES[*]}"
  mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
  chown slurm:slurm /var/lib/slurm/slurmctld /var/log/slurm
  local new
  new=$(cat <<EOF
$MARK: a one-node test cluster (see that script). Rewritten by each \`up\`.
ClusterName=ddpmrepro
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# No cgroups here (containers, no systemd): processes are tracked by parent id.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
SchedulerType=sched/backfill
ReturnToService=2
# Finished jobs stay in squeue for an hour: the status source without accounting.
MinJobAge=3600
# SIGTERM at the time limit (or scancel), SIGKILL this many seconds later.
KillWait=30
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$new" ]; then return 1; fi  # unchanged
  printf '%s\n' "$new" > "$CONF"
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    mungekey --create --keyfile=/etc/munge/munge.key || die "mungekey could not create /etc/munge/munge.key"
  fi
  chown -R munge:munge /etc/munge && chmod 0700 /etc/munge && chmod 0600 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  runuser -u munge -- munged || die "munged did not start (see /var/log/munge/munged.log)"
  echo munged >> "$STARTED"
  munge -n </dev/null | unmunge >/dev/null || die "munge runs but cannot decode its own credential (see /var/log/munge/munged.log)"
}

node_state() { sinfo -h -p "$PARTITION" -o %T 2>/dev/null | head -1; }

cmd_up() {
  need_root up
  install
  ours || [ ! -e "$CONF" ] || die "$CONF exists and was not written by this script: this machine has its own SLURM setup (try sinfo)"
  local changed=0
  write_conf && changed=1
  start_munge
  if [ $changed = 1 ] && { alive "$CTLD_PID" || alive "$SLURMD_PID"; }; then
    echo "configuration changed: restarting slurmctld and slurmd"
    stop_daemon slurmd "$SLURMD_PID"; stop_daemon slurmctld "$CTLD_PID"
  fi
  # -c: start without the jobs of an earlier session (a fresh test cluster every `up`).
  if ! alive "$CTLD_PID"; then
    slurmctld -c || die "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
    echo slurmctld >> "$STARTED"
  fi
  if ! alive "$SLURMD_PID"; then
    slurmd || die "slurmd did not start (see /var/log/slurm/slurmd.log)"
    echo slurmd >> "$STARTED"
  fi
  local state="" t=0
  while [ $t -lt "$WAIT_S" ]; do
    state=$(node_state)
    case $state in
      idle|mixed|allocated) break ;;
      down*|drain*) scontrol update nodename="$(sinfo -h -p $PARTITION -o %N | head -1)" state=resume 2>/dev/null || true ;;
    esac
    sleep 1; t=$((t + 1))
  done
  case $state in
    idle|mixed|allocated) ;;
    *) die "the node is '${state:-not listed}' after ${WAIT_S}s, not idle (see /var/log/slurm/slurmd.log and slurmctld.log)" ;;
  esac
  sinfo -p "$PARTITION" -o "%P %a %D %T %c %m %G %N"
}

stop_daemon() {  # name pidfile
  alive "$2" || return 0
  local pid; pid=$(cat "$2")
  kill "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

cmd_down() {
  need_root down
  if ! ours; then
    echo "no cluster of this script here (no $CONF with its marker): nothing to stop"
    return
  fi
  # Jobs first, so that their processes do not outlive slurmd.
  if alive "$CTLD_PID"; then squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true; fi
  stop_daemon slurmd "$SLURMD_PID"
  stop_daemon slurmctld "$CTLD_PID"
  # munged only if we started it: other software on this machine may use it.
  if [ -f "$STARTED" ] && grep -qx munged "$STARTED"; then stop_daemon munged "$MUNGE_PID"; fi
  rm -f "$STARTED"
  echo "SLURM stopped"
}

cmd_status() {
  local ok=0
  for d in "munged:$MUNGE_PID" "slurmctld:$CTLD_PID" "slurmd:$SLURMD_PID"; do
    if alive "${d#*:}"; then echo "${d%%:*}: running (pid $(cat "${d#*:}"))"; else echo "${d%%:*}: not running"; ok=1; fi
  done
  command -v sinfo >/dev/null || { echo "sinfo: not installed"; return 1; }
  if [ $ok = 0 ]; then
    sinfo -p "$PARTITION" -o "%P %a %D %T %c %m %G %N" || ok=1
    squeue -o "%.8i %.9P %.20j %.8T %.10M %R" || ok=1
    case $(node_state) in idle|mixed|allocated) ;; *) ok=1 ;; esac
  fi
  return $ok
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
