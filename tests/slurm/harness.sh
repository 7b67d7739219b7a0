#!/usr/bin/env bash
# A one-node Slurm cluster on 127.0.0.1 for the launch tests: munge, slurmctld and slurmd started directly (no systemd)
# and tracked by PID, so `down` stops only what `up` started. Debian/Ubuntu, as root.
#
#   tests/slurm/harness.sh up      install slurm-wlm and munge if missing, configure, start, wait for an idle node
#   tests/slurm/harness.sh down    cancel every job, stop the daemons this script started
#
# MARIN_SLURM_DIR (default /var/tmp/marin-slurm) holds state, logs and PID files; MARIN_SLURM_CPUS (default 4) is
# what the node advertises (config_overrides lets it exceed the machine: tasks share the cores).
set -euo pipefail

DIR=${MARIN_SLURM_DIR:-/var/tmp/marin-slurm}
CPUS=${MARIN_SLURM_CPUS:-4}
NODE=$(hostname -s)
say() { echo "slurm harness: $*" >&2; }
fail() { say "$*"; exit 1; }
alive() { [ -s "$DIR/pids/$1" ] && [ "$(cat "/proc/$(cat "$DIR/pids/$1")/comm" 2>/dev/null)" = "$1" ]; }
until_ok() { local end=$(( $(date +%s) + $1 )); shift; until "$@" >/dev/null 2>&1; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 0.3; done; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || fail "Slurm is not installed and installing it needs root (apt-get install slurm-wlm munge)"
  command -v apt-get >/dev/null || fail "Slurm is not installed and there is no apt-get here"
  say "installing slurm-wlm and munge"
  local policy=0  # keep the packages' scripts from starting daemons this script would not track
  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; policy=1; }
  apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
  [ $policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

configure() {
  local mem; mem=$(awk '/MemTotal/ {m = int($2 / 1024) - 512; print (m > 8192 ? 8192 : m)}' /proc/meminfo)
  mkdir -p /etc/slurm "$DIR"/{state,spool,log,run,pids}
  chown slurm:slurm "$DIR"/{state,log,run} 2>/dev/null || true
  cat > /etc/slurm/slurm.conf <<EOF
# written by marin-study's tests/slurm/harness.sh
ClusterName=marin-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
# also how many seconds a requeued job is held before it starts again
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
MinJobAge=600
JobRequeue=1
EnforcePartLimits=ALL
SchedulerParameters=bf_interval=1,sched_interval=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi  # one is running already: use it, never stop it
  [ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; }
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge; chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged
  until_ok 10 test -s /run/munge/munged.pid || fail "munged did not start (/var/log/munge/munged.log)"
  cp /run/munge/munged.pid "$DIR/pids/munged"
  until_ok 10 sh -c 'munge -n | unmunge' || fail "munge does not answer"
}

start() {  # start NAME FLAGS...: a daemon that forks and writes its PID file
  local name=$1; shift
  alive "$name" && return 0
  rm -f "$DIR/run/$name.pid"
  "$name" "$@"
  until_ok 15 test -s "$DIR/run/$name.pid" || { tail -20 "$DIR/log/$name.log" >&2; fail "$name did not start"; }
  cp "$DIR/run/$name.pid" "$DIR/pids/$name"
}

stop() {
  alive "$1" || { rm -f "$DIR/pids/$1"; return 0; }
  local pid; pid=$(cat "$DIR/pids/$1")
  kill -TERM "$pid" 2>/dev/null || true
  until_ok 10 sh -c "! test -d /proc/$pid" || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$DIR/pids/$1"
}

up() {
  install_packages
  [ "$(id -u)" = 0 ] || fail "starting the daemons needs root"
  configure
  start_munge
  alive slurmctld || start slurmctld -c
  until_ok 20 scontrol ping || fail "slurmctld does not answer ($DIR/log/slurmctld.log)"
  start slurmd
  local end=$(( $(date +%s) + 60 )) state
  while state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null); [ "$state" != idle ]; do
    case "$state" in down*|drain*|fail*|inval*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true;; esac
    [ "$(date +%s)" -lt "$end" ] || fail "node $NODE is '$state', not idle ($DIR/log/slurmd.log)"
    sleep 0.3
  done
  say "up: node $NODE idle with $CPUS CPUs, partition debug ($(sinfo --version))"
}

down() {
  if alive slurmctld; then
    scancel --quiet $(squeue -h -o %A 2>/dev/null | sort -u) 2>/dev/null || true
    until_ok 20 sh -c '[ -z "$(squeue -h 2>/dev/null)" ]' || true
  fi
  stop slurmd; stop slurmctld; stop munged
  say "down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
