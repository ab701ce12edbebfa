#!/usr/bin/env bash
# A real two-node slurm cluster on this one machine, for tests/test_slurm.py (and for trying
# launch/slurm.sbatch by hand). Debian's slurm-wlm + munge; needs root.
#
#   tests/slurm/cluster.sh up            start it (does nothing that is already done); installs
#                                        slurm-wlm and munge with apt-get when they are missing
#                                        (status 3: they cannot be installed or run here)
#   tests/slurm/cluster.sh run CMD...    run a client command (sbatch, squeue, scontrol, scancel)
#                                        on the cluster's login host, in the current directory
#   tests/slurm/cluster.sh down          cancel every job, stop the daemons this script started,
#                                        remove the namespaces (the controller's state stays, so
#                                        job ids keep counting up; `down --forget` drops it)
#   tests/slurm/cluster.sh status
#
# Each node is a network namespace; one veth pair joins the two. A node's daemons run in their
# own UTS namespace (hostname = node name) and mount namespace, where a hosts file naming both
# nodes is bound over /etc/hosts: every process of a job sees its node's hostname and address,
# as on two machines, while the file system is shared, as a cluster's shared file system is.
#   node1  10.231.0.1  slurmctld + slurmd
#   node2  10.231.0.2  slurmd
#   login  (client commands: node1's network, hostname "login")
# munged runs with its own key and socket under $BASE; the slurm config is $BASE/etc/slurm.conf
# (exported as SLURM_CONF); nothing is written under /etc.
set -euo pipefail

BASE=${GLM5_SLURM_BASE:-/tmp/glm5-slurm}
PREFIX=glm5sl            # namespace and interface names: glm5sl1, glm5sl2, glm5sl1-veth, ...
ADDR1=10.231.0.1
ADDR2=10.231.0.2
CPUS_PER_NODE=2          # what slurm grants each node; the README's example fills it
export SLURM_CONF=$BASE/etc/slurm.conf
MUNGE_SOCKET=$BASE/munge/socket
PIDS=$BASE/pids
LOGS=$BASE/logs

log() { echo "cluster.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }
# Exit status 3: slurm cannot be installed or run on this machine (tests/test_slurm.py skips).
cannot() { log "cannot run slurm here: $*"; exit 3; }

is_running() { [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null; }
pid_file_value() { cat "$PIDS/$1" 2>/dev/null || true; }

install_slurm() {
  [[ $(id -u) == 0 ]] || cannot "network namespaces and the slurm daemons need root"
  local missing=()
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null || missing+=(slurm-wlm)
  command -v munged >/dev/null || missing+=(munge)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v nsenter >/dev/null && command -v unshare >/dev/null || missing+=(util-linux)
  [[ ${#missing[@]} == 0 ]] && return 0
  command -v apt-get >/dev/null || cannot "${missing[*]} missing and there is no apt-get"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # without `apt-get update` first when the package lists already name them (faster)
  apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 \
         && apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; } \
    || cannot "apt-get install ${missing[*]} failed"
}

make_network() {
  local i
  for i in 1 2; do
    ip netns list | grep -qx "$PREFIX$i\( .*\)\?" || ip netns add "$PREFIX$i"
    ip -n "$PREFIX$i" link set lo up
  done
  if ! ip -n "${PREFIX}1" link show "${PREFIX}1-veth" >/dev/null 2>&1; then
    ip link add "${PREFIX}1-veth" netns "${PREFIX}1" type veth \
      peer name "${PREFIX}2-veth" netns "${PREFIX}2"
  fi
  ip -n "${PREFIX}1" addr replace "$ADDR1/24" dev "${PREFIX}1-veth"
  ip -n "${PREFIX}2" addr replace "$ADDR2/24" dev "${PREFIX}2-veth"
  ip -n "${PREFIX}1" link set "${PREFIX}1-veth" up
  ip -n "${PREFIX}2" link set "${PREFIX}2-veth" up
}

write_files() {
  mkdir -p "$BASE"/{etc,state,spool,munge,logs,pids}
  chmod 700 "$BASE/munge"
  printf '127.0.0.1 localhost\n%s node1\n%s node2\n' "$ADDR1" "$ADDR2" > "$BASE/etc/hosts"
  if [[ ! -s $BASE/munge/key ]]; then
    head -c 1024 /dev/urandom > "$BASE/munge/key"
    chmod 400 "$BASE/munge/key"
  fi
  # cred_expire: how long a requeued job waits before it may start again (default 120 s);
  # sched_interval/bf_interval: schedule within a second or two instead of up to a minute.
  # KillWait 30 s is slurm's default: the time a job has between SIGTERM and SIGKILL.
  cat > "$SLURM_CONF" <<EOF
ClusterName=glm5test
SlurmctldHost=node1($ADDR1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$PIDS/slurmctld.pidfile
SlurmdPidFile=$PIDS/slurmd-%n.pidfile
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
KillWait=30
InactiveLimit=0
MinJobAge=600
NodeName=node1 NodeAddr=$ADDR1 NodeHostname=node1 CPUs=$CPUS_PER_NODE RealMemory=8000 State=UNKNOWN
NodeName=node2 NodeAddr=$ADDR2 NodeHostname=node2 CPUs=$CPUS_PER_NODE RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
}

# as_host NETNS HOSTNAME CMD...: exec CMD as a process of that host (see the header).
# nsenter --net rather than `ip netns exec`, which remounts /sys and so hides the cgroup tree
# from slurmd. Every step execs, so a background as_host's pid is CMD's pid.
as_host() {
  local netns=$1 host=$2
  shift 2
  exec nsenter --net="/run/netns/$netns" unshare --uts --mount --propagation private -- \
    sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' \
    "$BASE/etc/hosts" "$host" "$@"
}

# start NAME NETNS HOSTNAME CMD...: run CMD in the background as that host, pid in $PIDS/NAME.
start() {
  local name=$1 netns=$2 host=$3
  shift 3
  is_running "$(pid_file_value "$name")" && return 0
  (as_host "$netns" "$host" "$@") >>"$LOGS/$name.out" 2>&1 &
  echo $! > "$PIDS/$name"
}

start_munge() {
  is_running "$(pid_file_value munged)" && return 0
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  /usr/sbin/munged --foreground --force --socket="$MUNGE_SOCKET" --key-file="$BASE/munge/key" \
    --pid-file="$BASE/munge/pid" --seed-file="$BASE/munge/seed" \
    --log-file="$LOGS/munged.log" >>"$LOGS/munged.out" 2>&1 &
  echo $! > "$PIDS/munged"
  local _
  for _ in $(seq 50); do [[ -S $MUNGE_SOCKET ]] && return 0; sleep 0.1; done
  die "munged did not start: see $LOGS/munged.log"
}

wait_for_idle_nodes() {
  local _ idle
  for _ in $(seq 100); do
    idle=$(ip netns exec "${PREFIX}1" sinfo --noheader --Node --format=%t 2>/dev/null \
      | grep -c '^idle' || true)
    [[ $idle == 2 ]] && return 0
    sleep 0.3
  done
  die "the nodes did not come up: see $LOGS/"
}

up() {
  install_slurm
  make_network
  write_files
  start_munge
  start slurmctld "${PREFIX}1" node1 /usr/sbin/slurmctld -D -f "$SLURM_CONF"
  local _
  for _ in $(seq 50); do
    ip netns exec "${PREFIX}1" scontrol ping 2>/dev/null | grep -q UP && break
    sleep 0.2
  done
  start slurmd-node1 "${PREFIX}1" node1 /usr/sbin/slurmd -D -f "$SLURM_CONF" -N node1
  start slurmd-node2 "${PREFIX}2" node2 /usr/sbin/slurmd -D -f "$SLURM_CONF" -N node2
  wait_for_idle_nodes
  log "up: nodes node1, node2 ($CPUS_PER_NODE CPUs each); SLURM_CONF=$SLURM_CONF"
}

stop() {
  local pid
  pid=$(pid_file_value "$1")
  if is_running "$pid"; then
    kill "$pid"
    local _
    for _ in $(seq 50); do is_running "$pid" || break; sleep 0.1; done
    is_running "$pid" && kill -9 "$pid"
  fi
  rm -f "$PIDS/$1"
}

down() {
  if is_running "$(pid_file_value slurmctld)"; then
    ip netns exec "${PREFIX}1" scancel --full --signal=KILL --user="$(id -un)" 2>/dev/null \
      || true
    local _
    for _ in $(seq 50); do
      [[ -z $(ip netns exec "${PREFIX}1" squeue --noheader --states=R,CG 2>/dev/null) ]] && break
      sleep 0.2
    done
  fi
  local name
  for name in slurmd-node2 slurmd-node1 slurmctld munged; do stop "$name"; done
  local i
  for i in 1 2; do
    if ip netns list | grep -qx "$PREFIX$i\( .*\)\?"; then ip netns del "$PREFIX$i"; fi
  done
  rm -rf "$BASE/spool"
  if [[ ${1:-} == --forget ]]; then rm -rf "$BASE/state"; fi
  return 0
}

status() {
  local name
  for name in munged slurmctld slurmd-node1 slurmd-node2; do
    if is_running "$(pid_file_value "$name")"; then echo "$name: running"
    else echo "$name: stopped"; fi
  done
}

case ${1:-} in
  up) up ;;
  down) down "${2:-}" ;;
  status) status ;;
  run) shift; as_host "${PREFIX}1" login "$@" ;;
  *) echo "usage: $0 up | run CMD... | down [--forget] | status" >&2; exit 2 ;;
esac
