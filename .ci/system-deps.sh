#!/usr/bin/env bash
# System software for the `sinkmerge reproduce` tests, on Debian 12 as root:
#   - the headless-browser test: Debian's chromium and chromium-driver (/usr/bin/chromium,
#     /usr/bin/chromedriver), driven over WebDriver;
#   - the Slurm test: a real single-node Slurm on this machine (slurm-wlm, munge), with slurmctld
#     and slurmd running as daemons, so that the tests can sbatch, squeue, scontrol, sacct, scancel.
#
# Source it (`. .ci/system-deps.sh`, as .ci/run does) so that SLURM_CONF reaches the tests; running
# it as a command sets the machine up just the same, then `export SLURM_CONF=<dir>/slurm.conf`.
# Installs only what is missing (apt-get update only then), writes its slurm.conf, state and logs
# under SINKMERGE_SLURM_DIR (default /tmp/sinkmerge-slurm), creates the munge key if missing, and
# starts munged, slurmctld and slurmd unless they already answer. Running it again is harmless.
#
# The node is `localhost` (127.0.0.1) with this machine's CPUs and memory from `slurmd -C`, in one
# default partition `debug`. Accounting is off (no slurmdbd); sacct reads the job-completion file
# instead (jobcomp/filetxt, `sacct -c`), and the controller keeps finished jobs for MinJobAge
# seconds, so `scontrol show job` also sees them for that long.
#
# Stop everything it started:
#   kill "$(cat "$SINKMERGE_SLURM_DIR/slurmd.pid")" "$(cat "$SINKMERGE_SLURM_DIR/slurmctld.pid")"
#   kill "$(cat /run/munge/munged.pid)"     # only if this script started munged
# (or pkill slurmd; pkill slurmctld; pkill munged, on a machine that runs no other Slurm).
set -euo pipefail

_sd_log() { echo "system-deps: $*" >&2; }
_sd_die() { echo "system-deps: ERROR: $*" >&2; exit 1; }

# --- Packages --------------------------------------------------------------------------------
_sd_missing=()
for _sd_pkg in chromium chromium-driver munge slurm-wlm slurm-client curl; do
  if ! dpkg-query -W -f='${Status}' "$_sd_pkg" 2>/dev/null | grep -q 'install ok installed'; then
    _sd_missing+=("$_sd_pkg")
  fi
done
if [ "${#_sd_missing[@]}" -gt 0 ]; then
  _sd_log "installing ${_sd_missing[*]}"
  _sd_t0=$SECONDS
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${_sd_missing[@]}" >/dev/null
  _sd_log "installed in $((SECONDS - _sd_t0)) s"
else
  _sd_log "chromium, chromium-driver, munge, slurm-wlm, slurm-client, curl already installed"
fi
for _sd_bin in /usr/bin/chromium /usr/bin/chromedriver /usr/sbin/munged /usr/sbin/slurmctld \
  /usr/sbin/slurmd /usr/bin/sbatch; do
  [ -x "$_sd_bin" ] || _sd_die "$_sd_bin is missing after the install"
done

# --- munge -----------------------------------------------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
  _sd_log "creating /etc/munge/munge.key"
  install -d -o munge -g munge -m 0700 /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  _sd_log "munged already running"
else
  _sd_log "starting munged"
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  # A munged that died leaves its socket lock behind; --force starts anyway.
  runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.2
  done
  munge -n | unmunge >/dev/null || _sd_die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- slurm.conf ------------------------------------------------------------------------------
SINKMERGE_SLURM_DIR=${SINKMERGE_SLURM_DIR:-/tmp/sinkmerge-slurm}
export SINKMERGE_SLURM_DIR
_sd_dir=$SINKMERGE_SLURM_DIR
mkdir -p "$_sd_dir/state" "$_sd_dir/spool"
chmod 0755 "$_sd_dir"
# `slurmd -C` prints this machine's NodeName=... CPUs=... Sockets... RealMemory=... line.
_sd_node=$(slurmd -C | grep '^NodeName=' | head -n1 | sed -E 's/^NodeName=[^ ]+ //; s/ *UpTime=.*$//')
[ -n "$_sd_node" ] || _sd_die "slurmd -C printed no node line"
cat >"$_sd_dir/slurm.conf.new" <<EOF
# Written by .ci/system-deps.sh: a single-node Slurm for the sinkmerge tests.
ClusterName=sinkmerge
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$_sd_dir/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=600
${SINKMERGE_SLURM_DEPENDENCY_PARAMETERS:+DependencyParameters=$SINKMERGE_SLURM_DEPENDENCY_PARAMETERS}
SlurmctldPidFile=$_sd_dir/slurmctld.pid
SlurmdPidFile=$_sd_dir/slurmd.pid
SlurmctldLogFile=$_sd_dir/slurmctld.log
SlurmdLogFile=$_sd_dir/slurmd.log
SlurmdSpoolDir=$_sd_dir/spool
StateSaveLocation=$_sd_dir/state
NodeName=localhost NodeAddr=127.0.0.1 $_sd_node State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
_sd_changed=0
if ! cmp -s "$_sd_dir/slurm.conf.new" "$_sd_dir/slurm.conf" 2>/dev/null; then
  mv "$_sd_dir/slurm.conf.new" "$_sd_dir/slurm.conf"
  _sd_changed=1
  _sd_log "wrote $_sd_dir/slurm.conf ($_sd_node)"
else
  rm -f "$_sd_dir/slurm.conf.new"
fi
export SLURM_CONF=$_sd_dir/slurm.conf

# --- slurmctld, slurmd -----------------------------------------------------------------------
_sd_since=
# A daemon is alive when its pid file names a process that is not a zombie.
_sd_alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  [ "$(sed -E 's/^.*\) ([A-Za-z]).*$/\1/' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}
_sd_logs() {
  local f
  for f in slurmctld.log slurmd.log; do
    [ -f "$_sd_dir/$f" ] && { echo "--- $_sd_dir/$f (tail)"; tail -n 20 "$_sd_dir/$f"; }
  done >&2
  return 0
}
if _sd_alive "$_sd_dir/slurmctld.pid"; then
  _sd_log "slurmctld already running (pid $(cat "$_sd_dir/slurmctld.pid"))"
  if [ "$_sd_changed" = 1 ]; then
    _sd_log "slurm.conf changed: scontrol reconfigure"
    scontrol reconfigure
  fi
else
  if scontrol ping 2>/dev/null | grep -q 'is UP'; then
    _sd_die "another slurmctld, not started from $_sd_dir, already answers on localhost's Slurm port"
  fi
  _sd_log "starting slurmctld"
  rm -f "$_sd_dir/slurmctld.pid"
  slurmctld -f "$SLURM_CONF" || { _sd_logs; _sd_die "slurmctld did not start"; }
fi
for _ in $(seq 50); do
  scontrol ping 2>/dev/null | grep -q 'is UP' && break
  sleep 0.2
done
scontrol ping | grep -q 'is UP' || { _sd_logs; _sd_die "slurmctld does not answer scontrol ping"; }
if _sd_alive "$_sd_dir/slurmd.pid"; then
  _sd_log "slurmd already running (pid $(cat "$_sd_dir/slurmd.pid"))"
else
  _sd_log "starting slurmd"
  _sd_since=$(date +%s)
  rm -f "$_sd_dir/slurmd.pid"
  slurmd -f "$SLURM_CONF" -N localhost || { _sd_logs; _sd_die "slurmd did not start"; }
fi

# Wait for the node to be idle (or busy with earlier jobs: mixed, allocated), and, when slurmd was
# just started, for it to have registered (a restarted slurmctld recovers the node as idle at once).
_sd_registered() {
  [ -z "${_sd_since:-}" ] && return 0
  local t
  t=$(scontrol show node localhost 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)
  t=$(date -d "$t" +%s 2>/dev/null) || return 1
  [ "$t" -ge "$((_sd_since - 1))" ]
}
_sd_state=
for _ in $(seq 60); do
  _sd_state=$(sinfo -h -N -n localhost -o '%T' 2>/dev/null | head -n1)
  case $_sd_state in idle | mixed | allocated) _sd_registered && break ;; esac
  for _sd_f in slurmctld slurmd; do
    if [ -s "$_sd_dir/$_sd_f.pid" ] && ! _sd_alive "$_sd_dir/$_sd_f.pid"; then
      _sd_logs; _sd_die "$_sd_f exited (see its log above)"
    fi
  done
  if [ "$_sd_state" = down ] || [ "$_sd_state" = drained ]; then
    scontrol update NodeName=localhost State=RESUME 2>/dev/null || true
  fi
  sleep 0.5
done
case $_sd_state in
  idle | mixed | allocated) _sd_registered || { _sd_logs; _sd_die "slurmd did not register within 30 s"; }
    _sd_log "Slurm ready: node localhost is $_sd_state, SLURM_CONF=$SLURM_CONF" ;;
  *) _sd_logs; _sd_die "node localhost is '${_sd_state:-unknown}' after 30 s, not idle" ;;
esac
unset _sd_missing _sd_pkg _sd_bin _sd_t0 _sd_dir _sd_node _sd_changed _sd_state _sd_f _sd_since
unset -f _sd_log _sd_die _sd_alive _sd_logs _sd_registered
