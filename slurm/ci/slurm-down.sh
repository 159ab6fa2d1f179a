#!/usr/bin/env bash
# slurm-down.sh - stop what slurm-up.sh started, by PID file only (never by process name).
#   slurm-down.sh          stop the daemons, keep state/logs/config (slurm-up.sh resumes it)
#   slurm-down.sh --purge  also delete $SLURM_CI_DIR, the /etc/hosts line, the
#                          /etc/slurm/slurm.conf symlink and Slurm's freezer cgroups
# The Debian packages stay installed.
set -uo pipefail
BASE=${SLURM_CI_DIR:-/var/tmp/toolkit-slurm-ci}
RUN=$BASE/run
export SLURM_CONF=$BASE/etc/slurm.conf
HOSTS_MARK="# toolkit-slurm-ci-nodes"

alive() { local pid; [ -s "$1" ] && pid=$(cat "$1" 2>/dev/null) && [ -r "/proc/$pid/cmdline" ] &&
          tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$2"; }
stop() {  # stop PIDFILE PATTERN: SIGTERM, wait up to 20 s, then SIGKILL
  local pf=$1 pat=$2 pid i
  alive "$pf" "$pat" || { rm -f "$pf"; return 0; }
  pid=$(cat "$pf"); kill "$pid" 2>/dev/null
  for i in $(seq 1 100); do alive "$pf" "$pat" || break; sleep 0.2; done
  alive "$pf" "$pat" && { echo "slurm-down: SIGKILL $pat ($pid)"; kill -9 "$pid" 2>/dev/null; sleep 0.5; }
  rm -f "$pf"; echo "slurm-down: stopped $pat ($pid)"
}

# 1. cancel jobs first, so Slurm itself cleans up slurmstepd and the job processes
if alive "$RUN/slurmctld.pid" slurmctld && [ -n "$(squeue -h -o %A 2>/dev/null)" ]; then
  scancel --full $(squeue -h -o %A) 2>/dev/null
  for i in $(seq 1 75); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
fi
# 2. daemons, in reverse start order
for pf in "$RUN"/slurmd-*.pid; do [ -e "$pf" ] && stop "$pf" slurmd; done
stop "$RUN/slurmctld.pid" slurmctld
if [ -e "$RUN/munged.ours" ]; then stop /run/munge/munged.pid munged; rm -f "$RUN/munged.ours"; fi

if [ "${1:-}" = --purge ]; then
  rm -rf "$BASE"
  if grep -q -- "$HOSTS_MARK" /etc/hosts; then    # rewrite in place: /etc/hosts may be a bind mount
    grep -v -- "$HOSTS_MARK" /etc/hosts >/tmp/hosts.toolkit-slurm-ci && cat /tmp/hosts.toolkit-slurm-ci >/etc/hosts && rm -f /tmp/hosts.toolkit-slurm-ci
  fi
  [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null)" = "$BASE/etc/slurm.conf" ] && rm -f /etc/slurm/slurm.conf
  for d in /sys/fs/cgroup/*/slurm_*; do [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null; done
  echo "slurm-down: purged $BASE"
fi
exit 0
