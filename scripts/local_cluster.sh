#!/usr/bin/env bash
# A SLURM cluster of several nodes on this one machine, to run the multi-node path for real
# (tests/test_multinode_cluster.py, CI) and to try it on a laptop:
#
#   sudo scripts/local_cluster.sh up 2       # hosts ctl, node1, node2; slurmctld in ctl, a slurmd per node
#   sudo scripts/local_cluster.sh up 2 --accounting   # and slurmdbd + MariaDB in ctl: sacct, sacctmgr
#   sudo scripts/local_cluster.sh exec ctl sbatch -N2 job.sh    # any command, run on one of the hosts
#   scripts/local_cluster.sh status          # hosts, daemons, sinfo; exit 0 only when usable
#   sudo scripts/local_cluster.sh down       # stop everything `up` started, remove the namespaces
#
# The hosts are Linux namespaces: each has a network namespace (its own address on a private
# subnet, joined to the others by a bridge), a UTS namespace (its own hostname: slurmd takes its
# node name from it) and a mount namespace (its own /etc/hosts, /etc/slurm and /run/munge, bind-
# mounted from $DIR; the machine's files are never edited). Everything else is shared, as on a
# cluster with everything on NFS: the filesystem, the PIDs, the CPUs. The traffic stays among the
# namespaces: they have no route out, and this machine's route to their subnet is `unreachable`.
#
# It is a cluster of its own beside the one-node cluster of scripts/local_slurm.sh (CI starts
# both): its own munged (own key and socket), its own slurm.conf, ports, state and logs, all
# under $DIR. Inside the namespaces /etc/slurm is ours, so clients that drop SLURM_CONF (the
# Snakemake job step plugin does) still find the right controller.
#
# With --accounting, ctl also runs a MariaDB of our own (its datadir and socket under $DIR/db,
# TCP only on ctl's loopback; no systemd, not the machine's /var/lib/mysql) and slurmdbd, and
# slurmctld records every job and step there: `sacct` works, and cluster ddpmmn, account
# ddpmrepro and user root (default account ddpmrepro) are registered. The database is part of
# the cluster's state: `down` stops both daemons and removes it, as it removes slurmctld's state.
#
# `up` is idempotent: with the cluster up with the same nodes and accounting it only checks it;
# otherwise (another node count, accounting switched on or off) it brings it down first and
# starts it again as asked. Every failure is one line starting with `Error:`.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin

DIR=${LOCAL_CLUSTER_DIR:-/var/lib/ddpmrepro-cluster}
PREFIX=ddpmmn                   # namespaces ddpmmn-ctl, ddpmmn-node1, ...; veths ddpmmn-...
BRIDGE=ddpmmnbr0
NET=10.213.0                    # ctl 10.213.0.1, nodeK 10.213.0.(10+K)
CTLD_PORT=7817 SLURMD_PORT=7818  # not the one-node cluster's 6817/6818 (not that they could meet)
DBD_PORT=7819 DB_PORT=3317      # slurmdbd on ctl's address; MariaDB on ctl's loopback only
ACCOUNT=ddpmrepro               # the account the tests and docs/CLUSTER.md's recipe pass
# Not plain nproc: it honours OMP_NUM_THREADS, and `OMP_NUM_THREADS=1 ... up 2` made 1-CPU nodes.
CPUS=${LOCAL_CLUSTER_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
MEM_MB=${LOCAL_CLUSTER_MEM_MB:-4000}
PACKAGES=(slurmctld slurmd slurm-client munge)
ACCT_PACKAGES=(slurmdbd mariadb-server)
WAIT_S=${LOCAL_CLUSTER_WAIT_S:-60}
MAX_NODES=9

die() { echo "Error: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "'$1' creates namespaces and starts daemons: run it as root (sudo $0 $1)"; }
alive() { [ -f "$1" ] && [ -d "/proc/$(cat "$1")" ]; }
holder_pid() { cat "$DIR/run/holder-$1.pid" 2>/dev/null; }
accounting() { [ -f "$DIR/accounting" ]; }  # the cluster that is up keeps accounting
hosts() { echo ctl; for k in $(seq "$(cat "$DIR/nodes" 2>/dev/null || echo 0)"); do echo "node$k"; done; }
addr() { [ "$1" = ctl ] && echo "$NET.1" || echo "$NET.$((10 + ${1#node}))"; }

on() {  # on HOST CMD...: run CMD in HOST's namespaces, in this directory (as seen from inside)
  local host=$1; shift
  local pid; pid=$(holder_pid "$host") || die "no host '$host' (is the cluster up? $0 status)"
  [ -d "/proc/$pid" ] || die "host '$host' is gone (its holder process $pid died): run $0 down, then up"
  # --wdns, not --wd: --wd opens the directory before entering the mount namespace, and a rename
  # between that cwd and an absolute path then crosses mounts (EXDEV).
  nsenter -t "$pid" --net --uts --mount --wdns="$PWD" -- "$@"
}

install() {  # ACCOUNTING (0/1)
  local missing=() packages=("${PACKAGES[@]}" iproute2 util-linux)
  for cmd in slurmctld slurmd sinfo munged nsenter unshare ip; do
    command -v "$cmd" >/dev/null || missing+=("$cmd")
  done
  if [ "$1" = 1 ]; then
    packages+=("${ACCT_PACKAGES[@]}")
    for cmd in slurmdbd sacctmgr mariadbd mariadb-install-db mariadb; do
      command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
  fi
  [ ${#missing[@]} = 0 ] && return
  command -v apt-get >/dev/null || die "${missing[*]} missing and no apt-get here: install SLURM, munge, iproute2 and util-linux (and slurmdbd, MariaDB for --accounting)"
  echo "installing ${packages[*]} (apt)"
  apt-get update -qq >/dev/null || die "apt-get update failed (network or sources); run it yourself to see why"
  # Where the image lets packages start services, mariadb-server starts the machine's own MariaDB
  # (/var/lib/mysql, port 3306): that one is not ours, and ours neither uses nor stops it.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" \
    >/dev/null || die "apt-get install ${packages[*]} failed; run it yourself to see why"
}

write_files() {  # N ACCOUNTING (0/1)
  local n=$1 acct=$2 k
  mkdir -p "$DIR"/{run,log,net,etc,munge,state/ctl} && chmod 0755 "$DIR"
  { echo "127.0.0.1 localhost"; echo "$NET.1 ctl"; for k in $(seq "$n"); do echo "$NET.$((10 + k)) node$k"; done; } \
    > "$DIR/net/hosts"
  for k in $(seq "$n"); do mkdir -p "$DIR/state/node$k"; done
  cat > "$DIR/etc/slurm.conf" <<EOF
# Written by ddpmrepro scripts/local_cluster.sh: a $n-node test cluster in namespaces. Rewritten by each \`up\`.
ClusterName=ddpmmn
SlurmctldHost=ctl($NET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
StateSaveLocation=$DIR/state/ctl
SlurmdSpoolDir=$DIR/state/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# No cgroups (containers, no systemd): processes are tracked by parent id, no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Memory per CPU by default: a job without --mem must not take a node's whole memory, or two
# jobs could never share a node.
DefMemPerCPU=500
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=3600
KillWait=10
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
EOF
  if [ "$acct" = 1 ]; then
    # Jobs and steps go to slurmdbd; jobacct_gather/linux reads /proc for the steps' CPU time and
    # memory (MaxRSS), without cgroups. A step has a MaxRSS only if it was sampled while alive (at
    # its end /proc is gone) and our steps last 10-30 s: sample every 2 s, not every 10 (a 10 s
    # period left a two-node step's MaxRSS empty once in CI). No AccountingStorageEnforce: a job
    # without --account runs under the user's default account, as on most sites.
    cat >> "$DIR/etc/slurm.conf" <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=ctl
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=2
EOF
    # slurmdbd refuses a config readable by others (it holds the database password).
    ( umask 077; cat > "$DIR/etc/slurmdbd.conf" <<EOF
# Written by ddpmrepro scripts/local_cluster.sh up N --accounting. Rewritten by each \`up\`.
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
DbdHost=ctl
DbdAddr=$NET.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
StorageLoc=ddpmmn_acct_db
EOF
    )
    touch "$DIR/accounting"
  else
    printf '%s\n' AccountingStorageType=accounting_storage/none JobAcctGatherType=jobacct_gather/none >> "$DIR/etc/slurm.conf"
    rm -f "$DIR/etc/slurmdbd.conf" "$DIR/accounting"
  fi
  for k in $(seq "$n"); do
    echo "NodeName=node$k NodeAddr=$NET.$((10 + k)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN" >> "$DIR/etc/slurm.conf"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$DIR/etc/slurm.conf"
  echo "$n" > "$DIR/nodes"
}

make_host() {  # HOST: a netns on the bridge, and a holder process keeping its UTS + mount namespaces
  local host=$1 ns=$PREFIX-$1 veth=$PREFIX-$1
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$BRIDGE" up
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  ip -n "$ns" addr add "$(addr "$host")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  # `ip netns exec` would remount /sys and hide the cgroup mounts that slurmd 22.05 needs: nsenter.
  setsid nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c "
    hostname $host
    mount --bind '$DIR/net/hosts' /etc/hosts
    mount --bind '$DIR/etc' /etc/slurm
    mount --bind '$DIR/munge' /run/munge
    echo \$\$ > '$DIR/run/holder-$host.pid'
    exec sleep infinity" </dev/null >/dev/null 2>"$DIR/log/holder-$host.log" &
  local t=0
  until [ -s "$DIR/run/holder-$host.pid" ]; do
    sleep 0.1; t=$((t + 1))
    [ $t -lt 100 ] || die "host $host did not come up (see $DIR/log/holder-$host.log)"
  done
}

start_munge() {
  [ -s "$DIR/munge.key" ] || mungekey --create --keyfile="$DIR/munge.key" >/dev/null \
    || die "mungekey could not create $DIR/munge.key"
  chown munge:munge "$DIR/munge.key" "$DIR/munge" && chmod 0600 "$DIR/munge.key" && chmod 0755 "$DIR/munge"
  if alive "$DIR/munge/munged.pid"; then return; fi
  runuser -u munge -- munged --key-file="$DIR/munge.key" --socket="$DIR/munge/munge.socket.2" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || die "munged did not start (see $DIR/munge/munged.log)"
}

sql() { mariadb --no-defaults --socket="$DIR/db/mariadb.sock" -u root "$@"; }  # as root, over the unix socket

start_accounting() {  # MariaDB, then slurmdbd, in ctl; the cluster, account and user registered
  local t=0
  mkdir -p "$DIR/db" && chown mysql:mysql "$DIR/db" && chmod 0750 "$DIR/db"
  if [ ! -d "$DIR/db/data/mysql" ]; then
    # --no-defaults everywhere: the machine's /etc/mysql (datadir /var/lib/mysql, port 3306) stays out.
    mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/db/data" --auth-root-authentication-method=socket \
      --skip-test-db >"$DIR/log/mariadb-install-db.log" 2>&1 \
      || die "mariadb-install-db failed (see $DIR/log/mariadb-install-db.log)"
  fi
  if ! alive "$DIR/db/mariadb.pid"; then
    # In ctl: TCP on ctl's own loopback (slurmdbd's way in), the socket a file under $DIR (ours).
    # The default 128 MB buffer pool: slurmdbd logs one "not recommended" line, moot for a test.
    # nsenter as a simple command, not `on`: the background job is then mariadbd itself, not a
    # shell waiting for it.
    nsenter -t "$(holder_pid ctl)" --net --uts --mount --wdns=/ -- setsid mariadbd --no-defaults --user=mysql \
      --datadir="$DIR/db/data" --socket="$DIR/db/mariadb.sock" --bind-address=127.0.0.1 --port=$DB_PORT --skip-name-resolve --pid-file="$DIR/db/mariadb.pid" \
      --log-error="$DIR/db/mariadb.log" --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
  fi
  until sql -e 'SELECT 1' >/dev/null 2>&1; do
    sleep 1; t=$((t + 1))
    [ $t -lt "$WAIT_S" ] || die "MariaDB did not answer on $DIR/db/mariadb.sock after ${WAIT_S}s (see $DIR/db/mariadb.log)"
  done
  local pass; pass=$(sed -n 's/^StoragePass=//p' "$DIR/etc/slurmdbd.conf")
  sql -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1'; ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
          GRANT ALL ON ddpmmn_acct_db.* TO 'slurm'@'127.0.0.1';" \
    || die "MariaDB refused to create slurmdbd's user (see $DIR/db/mariadb.log)"
  alive "$DIR/run/slurmdbd.pid" || on ctl slurmdbd || die "slurmdbd did not start (see $DIR/log/slurmdbd.log)"
  t=0
  until on ctl sacctmgr -n show cluster >/dev/null 2>&1; do
    sleep 1; t=$((t + 1))
    [ $t -lt "$WAIT_S" ] || die "slurmdbd did not answer sacctmgr after ${WAIT_S}s (see $DIR/log/slurmdbd.log)"
  done
  # Before slurmctld starts: it registers with slurmdbd as cluster ddpmmn. Each `add` only where
  # it is missing (sacctmgr fails on an existing one).
  on ctl sacctmgr -n -P show cluster format=cluster | grep -qx ddpmmn \
    || on ctl sacctmgr -i add cluster ddpmmn >/dev/null || die "sacctmgr could not add cluster ddpmmn"
  on ctl sacctmgr -n -P show account format=account | grep -qx "$ACCOUNT" \
    || on ctl sacctmgr -i add account "$ACCOUNT" cluster=ddpmmn description="ddpmrepro tests" organization=ddpmrepro \
      >/dev/null || die "sacctmgr could not add account $ACCOUNT"
  on ctl sacctmgr -n -P show assoc cluster=ddpmmn user=root format=account | grep -qx "$ACCOUNT" \
    || on ctl sacctmgr -i add user root account="$ACCOUNT" cluster=ddpmmn >/dev/null \
    || die "sacctmgr could not add user root to account $ACCOUNT"
  on ctl sacctmgr -i modify user root set defaultaccount="$ACCOUNT" >/dev/null 2>&1 || true  # "nothing modified" when set
}

cmd_up() {
  need_root up
  local n=${1:-2} acct=0 was
  [[ $n =~ ^[1-9]$ ]] || die "up N: N is the number of compute nodes, 1 to $MAX_NODES (got '$n')"
  [ -z "${2:-}" ] || [ "${2:-}" = --accounting ] || die "unknown option '$2' (usage: $0 up N [--accounting])"
  [ -z "${2:-}" ] || acct=1
  install $acct
  if [ -f "$DIR/nodes" ]; then
    was=$(accounting && echo 1 || echo 0)
    if [ "$(cat "$DIR/nodes")" = "$n" ] && [ "$was" = $acct ] && grep -q " CPUs=$CPUS RealMemory=$MEM_MB " "$DIR/etc/slurm.conf" \
       && cmd_status >/dev/null 2>&1; then
      echo "the cluster is up with $n nodes$([ $acct = 1 ] && echo ', accounting on')"
      on ctl sinfo -o "%P %a %D %T %c %m %N"; return
    fi
    [ "$was" = $acct ] || echo "accounting $([ $acct = 1 ] && echo on || echo off): restarting the cluster"
    cmd_down >/dev/null
  fi
  write_files "$n" $acct
  mkdir -p /run/munge /etc/slurm  # mount points (the one-node cluster uses them too, unchanged)
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  # Without this, the machine's default route would take packets for the subnet out of it.
  ip route add unreachable "$NET.0/24"
  for host in $(hosts); do make_host "$host"; done
  start_munge
  [ $acct = 0 ] || start_accounting
  on ctl slurmctld -c || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
  for host in $(hosts | grep -v '^ctl$'); do
    on "$host" slurmd || die "slurmd on $host did not start (see $DIR/log/slurmd-$host.log)"
  done
  local t=0 idle=0
  while [ $t -lt "$WAIT_S" ]; do
    idle=$(on ctl sinfo -h -t idle -o %D 2>/dev/null | head -1)
    [ "${idle:-0}" = "$n" ] && break
    sleep 1; t=$((t + 1))
  done
  [ "${idle:-0}" = "$n" ] || die "${idle:-0} of $n nodes idle after ${WAIT_S}s (see $DIR/log/slurmctld.log and slurmd-*.log)"
  # Every host reaches every other by name, and the machine does not reach them.
  for a in $(hosts); do for b in $(hosts); do
    on "$a" timeout 5 bash -c "exec 3<>/dev/tcp/$b/$([ "$b" = ctl ] && echo $CTLD_PORT || echo $SLURMD_PORT)" 2>/dev/null \
      || die "host $a cannot reach $b ($(addr "$b"))"
  done; done
  ! timeout 2 bash -c "exec 3<>/dev/tcp/$NET.1/$CTLD_PORT" 2>/dev/null || die "this machine reaches $NET.1: traffic would leave the namespaces"
  local names; names=$(on ctl srun -N"$n" -t 1 hostname | sort | tr '\n' ' ')
  [ "$names" = "$(hosts | grep -v '^ctl$' | sort | tr '\n' ' ')" ] || die "srun -N$n hostname printed '$names'"
  if [ $acct = 1 ]; then  # slurmctld sends finished jobs to slurmdbd at once; a second for it to store them
    local job; job=$(on ctl squeue -h -t all -o %i | sort -n | tail -1) t=0
    until on ctl sacct -n -X -P -j "$job" -o state 2>/dev/null | grep -qx COMPLETED; do
      sleep 1; t=$((t + 1))
      [ $t -lt "$WAIT_S" ] || die "sacct does not list job $job (srun -N$n hostname) as COMPLETED after ${WAIT_S}s (see $DIR/log/slurmdbd.log)"
    done
  fi
  on ctl sinfo -o "%P %a %D %T %c %m %N"
}

stop_pid() {  # pidfile [seconds to wait before SIGKILL, 5]
  alive "$1" || return 0
  local pid; pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq $((${2:-5} * 10))); do [ -d "/proc/$pid" ] || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

cmd_down() {
  need_root down
  if [ ! -f "$DIR/nodes" ] && ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    echo "no cluster of this script here: nothing to stop"; return
  fi
  if alive "$DIR/run/slurmctld.pid" && alive "$DIR/run/holder-ctl.pid"; then
    on ctl sh -c 'squeue -h -o %i | xargs -r scancel' 2>/dev/null || true
  fi
  local host
  for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pid "$f"; done
  stop_pid "$DIR/run/slurmctld.pid"
  stop_pid "$DIR/run/slurmdbd.pid"
  stop_pid "$DIR/db/mariadb.pid" 30  # InnoDB flushes on SIGTERM
  stop_pid "$DIR/munge/munged.pid"
  for f in "$DIR"/run/holder-*.pid; do [ -e "$f" ] && stop_pid "$f"; done
  for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do ip netns del "$ns"; done
  ip link del "$BRIDGE" 2>/dev/null || true
  ip route del unreachable "$NET.0/24" 2>/dev/null || true
  rm -rf "$DIR/run" "$DIR/state" "$DIR/db" "$DIR/nodes" "$DIR/accounting"
  echo "cluster stopped"
}

cmd_status() {
  [ -f "$DIR/nodes" ] || { echo "no cluster (run: sudo $0 up N)"; return 1; }
  local ok=0 host
  for host in $(hosts); do
    if alive "$DIR/run/holder-$host.pid"; then echo "host $host: $(addr "$host"), holder pid $(holder_pid "$host")"
    else echo "host $host: gone"; ok=1; fi
  done
  for f in munge/munged $(accounting && echo db/mariadb run/slurmdbd) run/slurmctld $(hosts | grep -v '^ctl$' | sed 's|^|run/slurmd-|'); do
    if alive "$DIR/$f.pid"; then echo "${f#*/}: running (pid $(cat "$DIR/$f.pid"))"; else echo "${f#*/}: not running"; ok=1; fi
  done
  if [ $ok = 0 ]; then
    on ctl sinfo -o "%P %a %D %T %c %m %N" || ok=1
    on ctl squeue -o "%.8i %.9P %.20j %.8T %.10M %.6D %R" || ok=1
    [ "$(on ctl sinfo -h -t idle,mixed,allocated -o %D | awk '{s+=$1} END {print s+0}')" = "$(cat "$DIR/nodes")" ] || ok=1
    if accounting; then
      echo "accounting: on (slurmdbd + MariaDB in ctl), clusters in slurmdbd: $(on ctl sacctmgr -n -P show cluster format=cluster | tr '\n' ' ')"
      on ctl sacctmgr -n -P show cluster format=cluster | grep -qx ddpmmn || ok=1
    else
      echo "accounting: off (sacct knows no job; up N --accounting turns it on)"
    fi
  fi
  return $ok
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  exec) [ $# -ge 3 ] || { echo "usage: $0 exec HOST CMD..." >&2; exit 2; }
        need_root exec; shift; host=$1; shift; on "$host" "$@" ;;
  *) echo "usage: $0 up N [--accounting] | down | exec HOST CMD... | status" >&2; exit 2 ;;
esac
