#!/usr/bin/env bash
# slurm-up.sh - install, configure and start a real single-host Slurm cluster for the tests:
# munged + slurmctld + N slurmd ("nodes" n1..nN, all on this host), without systemd.
# Idempotent: re-running starts only what is not running (and restarts Slurm if the generated
# config changed). Returns when `sinfo` shows every node idle. Stop it with slurm-down.sh.
#
# No accounting (slurmdbd + MariaDB would add ~184 MiB and a perl upgrade): `toolkit slurm status`
# falls back to `scontrol show job`, which keeps finished jobs for MinJobAge (600 s here).
# Adapted from a measured recipe for Debian 12 / Slurm 22.05.8 (see docs/slurm.md).
#
# Knobs (env):
#   SLURM_CI_DIR=/var/tmp/toolkit-slurm-ci   state/spool/log/pid/config dir
#   SLURM_CI_NODES=2                         simulated nodes n1..nN, one slurmd each
#   SLURM_CI_PROCTRACK=auto                  auto|cgroup|linuxproc (auto: cgroup v1 freezer if usable)
#   SLURM_CI_TIMEOUT=90                      seconds to wait for each daemon / for idle nodes
# Afterwards: source "$SLURM_CI_DIR/env.sh" (clients also find /etc/slurm/slurm.conf, a symlink).
set -euo pipefail

BASE=${SLURM_CI_DIR:-/var/tmp/toolkit-slurm-ci}
NNODES=${SLURM_CI_NODES:-2}
PROCTRACK=${SLURM_CI_PROCTRACK:-auto}
TIMEOUT=${SLURM_CI_TIMEOUT:-90}
CTLD_PORT=${SLURM_CI_CTLD_PORT:-6817}
SLURMD_PORT0=${SLURM_CI_SLURMD_PORT0:-17000}   # node i listens on SLURMD_PORT0+i
HOSTS_MARK="# toolkit-slurm-ci-nodes"

ETC=$BASE/etc RUN=$BASE/run LOG=$BASE/log
export SLURM_CONF=$ETC/slurm.conf
T0=$(date +%s.%N)
log() { printf '[slurm-up %6.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*" >&2; }
die() { log "ERROR: $*"; for f in "$LOG"/*.log; do [ -f "$f" ] && { echo "== $f" >&2; tail -n 20 "$f" >&2; }; done; exit 1; }
# alive PIDFILE PATTERN: the pid file names a live process whose cmdline matches PATTERN
alive() { local pid; [ -s "$1" ] && pid=$(cat "$1" 2>/dev/null) && [ -r "/proc/$pid/cmdline" ] &&
          tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$2"; }
# wait_for DESCRIPTION CMD...: poll CMD every 0.2 s until it succeeds or TIMEOUT
wait_for() { local what=$1; shift; local end=$(( $(date +%s) + TIMEOUT ))
             until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -lt "$end" ] || die "timeout waiting for $what"; sleep 0.2; done; }

NODES=(); for i in $(seq 1 "$NNODES"); do NODES+=("n$i"); done

# ---------------------------------------------------------------- 1. packages
PKGS=(munge slurmctld slurmd slurm-client)
MISSING=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || MISSING+=("$p")
done
if [ ${#MISSING[@]} -gt 0 ]; then
  log "installing ${MISSING[*]}"
  # Debian's maintainer scripts start daemons through invoke-rc.d; there is no init system to own them.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  APT_LOG=${TMPDIR:-/tmp}/toolkit-slurm-ci-apt.log
  apt-get -o DPkg::Lock::Timeout=120 update -qq >"$APT_LOG" 2>&1 || { tail -n 30 "$APT_LOG"; die "apt-get update failed"; }
  apt-get -o DPkg::Lock::Timeout=120 install -y -qq --no-install-recommends "${MISSING[@]}" >>"$APT_LOG" 2>&1 ||
    { tail -n 30 "$APT_LOG"; die "apt-get install failed"; }
  log "packages installed"
fi

mkdir -p "$ETC" "$RUN" "$LOG" "$BASE/state"
for n in "${NODES[@]}"; do mkdir -p "$BASE/spool/$n"; done   # slurmd wants its spool dir to exist

# ---------------------------------------------------------------- 2. munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
  install -d -o munge -g munge -m 0711 /var/lib/munge
  install -d -o munge -g munge -m 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null ||
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key   # munged rejects looser modes
  runuser -u munge -- /usr/sbin/munged            # as root it refuses a key owned by munge
  touch "$RUN/munged.ours"                        # teardown stops only a munged we started
  wait_for munged sh -c 'munge -n | unmunge'
  log "munged started (pid $(cat /run/munge/munged.pid))"
fi

# ---------------------------------------------------------------- 3. name resolution
# `scontrol show hostnames` gives node names (n1, n2); the rendezvous address must resolve.
NEED=()
for n in "$(hostname -s)" "${NODES[@]}"; do getent hosts "$n" >/dev/null || NEED+=("$n"); done
if [ ${#NEED[@]} -gt 0 ]; then
  echo "127.0.0.1 ${NEED[*]} $HOSTS_MARK" >>/etc/hosts     # append: /etc/hosts may be a bind mount
  log "added to /etc/hosts: ${NEED[*]}"
fi

# ---------------------------------------------------------------- 4. config
if [ "$PROCTRACK" = auto ]; then
  # cgroup/v2 fails on a v1+v2 hybrid layout ("Hybrid mode is not supported"); linuxproc loses
  # children re-parented to PID 1, so prefer the v1 freezer when it is usable.
  PROCTRACK=linuxproc
  if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = tmpfs ] && [ -d /sys/fs/cgroup/freezer ] &&
     mkdir /sys/fs/cgroup/freezer/toolkit-slurm-ci-probe 2>/dev/null; then
    rmdir /sys/fs/cgroup/freezer/toolkit-slurm-ci-probe; PROCTRACK=cgroup
  fi
fi
HW=$(slurmd -C 2>/dev/null | head -n1 | grep -o 'CPUs=.*ThreadsPerCore=[0-9]*' || echo "CPUs=$(nproc)")
MEM_MB=$(awk '/MemTotal/ {print int($2/1024*0.9)}' /proc/meminfo)
H=$(hostname -s)
NEW=$(mktemp)
cat >"$NEW" <<EOF
# generated by slurm/ci/slurm-up.sh
ClusterName=toolkitci
SlurmctldHost=$H(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
# a requeued job may start again after cred_expire+1 s (default 121 s)
AuthInfo=cred_expire=10
CredType=cred/munge
MailProg=/bin/true
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=600
KillWait=5
Waittime=0
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=n[1-$NNODES] NodeHostname=$H NodeAddr=127.0.0.1 Port=[$((SLURMD_PORT0+1))-$((SLURMD_PORT0+NNODES))] $HW RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
CHANGED=0
if ! cmp -s "$NEW" "$ETC/slurm.conf"; then mv "$NEW" "$ETC/slurm.conf"; chmod 644 "$ETC/slurm.conf"; CHANGED=1; log "wrote $ETC/slurm.conf"
else rm -f "$NEW"; fi
if [ "$PROCTRACK" = cgroup ]; then
  printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n' >"$ETC/cgroup.conf"
fi
echo "export SLURM_CONF=$ETC/slurm.conf" >"$BASE/env.sh"
# clients (sbatch/srun/squeue called by the toolkit) find it without SLURM_CONF too
mkdir -p /etc/slurm
if [ ! -e /etc/slurm/slurm.conf ] || [ "$(readlink /etc/slurm/slurm.conf)" = "$ETC/slurm.conf" ]; then
  ln -sfn "$ETC/slurm.conf" /etc/slurm/slurm.conf
fi

if [ "$CHANGED" = 1 ]; then   # config changed: restart the Slurm daemons (state is kept)
  for pf in "$RUN"/slurmd-*.pid "$RUN/slurmctld.pid"; do
    alive "$pf" slurm && { kill "$(cat "$pf")"; while alive "$pf" slurm; do sleep 0.2; done; log "stopped $(basename "$pf" .pid) for config change"; }
  done
fi

# ---------------------------------------------------------------- 5. slurmctld + slurmd(s)
if ! alive "$RUN/slurmctld.pid" slurmctld; then
  slurmctld
  wait_for slurmctld sh -c 'scontrol ping | grep -q UP'
  log "slurmctld started (pid $(cat "$RUN/slurmctld.pid"), proctrack/$PROCTRACK)"
fi
for n in "${NODES[@]}"; do
  if ! alive "$RUN/slurmd-$n.pid" slurmd; then
    slurmd -N "$n"
    wait_for "slurmd $n" alive "$RUN/slurmd-$n.pid" slurmd     # the pid file appears just after the fork
    log "slurmd $n started (pid $(cat "$RUN/slurmd-$n.pid"))"
  fi
done

# ---------------------------------------------------------------- 6. wait for idle nodes
all_idle() {
  local bad; bad=$(sinfo -h -N -o '%N %t' | sort -u | awk '$2 != "idle" && $2 != "mix" && $2 != "alloc"')
  [ -z "$bad" ] && [ "$(sinfo -h -N -o '%N' | sort -u | wc -l)" -eq "${#NODES[@]}" ] && return 0
  # nodes left down/drained by an earlier run ("Node unexpectedly rebooted") -> resume them
  echo "$bad" | awk '$2 ~ /^(down|drain|drng|fail)/ {print $1}' | while read -r n; do
    scontrol update NodeName="$n" State=RESUME 2>/dev/null || true; done
  return 1
}
wait_for "idle nodes" all_idle
log "cluster ready: ${NODES[*]} (source $BASE/env.sh)"
