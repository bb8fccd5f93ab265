#!/bin/bash
# A real one-node Slurm on this machine (Debian slurm-wlm + munge), for tests. Idempotent.
#
#   bash scripts/slurm_local.sh [start]   install if needed, write the config, start munged/slurmctld/slurmd,
#                                         wait until the node is idle, print `export SLURM_CONF=...`
#   bash scripts/slurm_local.sh stop      stop the daemons this script started
#   bash scripts/slurm_local.sh status    sinfo / squeue
#
# Variables: SLURM_LOCAL_DIR (state dir, default /tmp/polar-slurm), SLURM_LOCAL_CPUS (default 32; config_overrides lets it exceed real cores),
# SLURM_LOCAL_MEM_MB (default 131072, not enforced: task/none), SLURM_LOCAL_TIMEOUT (seconds to wait for idle, default 60).
# Needs root (apt-get, munge key, slurmd). Everything but the key and packages lives in the state dir.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/polar-slurm}"
CONF="$DIR/slurm.conf"
CPUS="${SLURM_LOCAL_CPUS:-32}"
MEM_MB="${SLURM_LOCAL_MEM_MB:-131072}"
TIMEOUT="${SLURM_LOCAL_TIMEOUT:-60}"
log() { echo "slurm_local: $*" >&2; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v python3 >/dev/null; then
    return
  fi
  log "installing slurm-wlm, munge, python3"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq slurm-wlm munge python3 >/dev/null
}

write_conf() {
  mkdir -p "$DIR/spool/ctld" "$DIR/spool/d" "$DIR/log" "$DIR/run"
  cat > "$CONF.new" <<EOF
# written by scripts/slurm_local.sh
ClusterName=polarlocal
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
SchedulerType=sched/backfill
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.new" "$CONF"
}

alive() {  # PIDFILE
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
  if [ ! -f /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if ! munge -n </dev/null >/dev/null 2>&1; then
    log "starting munged"
    if id munge >/dev/null 2>&1; then
      runuser -u munge -- munged --force
    else
      munged --force
    fi
    touch "$DIR/run/munged.started"
  fi
}

idle() {
  SLURM_CONF="$CONF" sinfo -h -N -o '%t' 2>/dev/null | grep -qx 'idle'
}

start() {
  install
  write_conf
  start_munge
  if ! alive "$DIR/run/slurmctld.pid"; then
    log "starting slurmctld"
    slurmctld -f "$CONF"
  fi
  if ! alive "$DIR/run/slurmd.pid"; then
    log "starting slurmd"
    slurmd -f "$CONF" -N localhost
  fi
  local waited=0
  until idle; do
    if [ "$waited" -ge $((TIMEOUT * 2)) ]; then
      log "node not idle after ${TIMEOUT}s; logs in $DIR/log"
      SLURM_CONF="$CONF" sinfo -N >&2 || true
      tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
      exit 1
    fi
    # a node left DOWN/DRAIN by an earlier run comes back on resume
    if [ $((waited % 10)) -eq 9 ]; then
      SLURM_CONF="$CONF" scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.5
    waited=$((waited + 1))
  done
  echo "export SLURM_CONF=$CONF"
}

stop_one() {  # NAME PIDFILE
  if alive "$2"; then
    local pid
    pid="$(cat "$2")"
    log "stopping $1 ($pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
}

stop() {
  if [ -f "$CONF" ] && alive "$DIR/run/slurmctld.pid"; then
    SLURM_CONF="$CONF" scancel --full --user=root 2>/dev/null || true
  fi
  stop_one slurmd "$DIR/run/slurmd.pid"
  stop_one slurmctld "$DIR/run/slurmctld.pid"
  # munged is stopped only when this script started it
  if [ -f "$DIR/run/munged.started" ]; then
    stop_one munged /run/munge/munged.pid
    rm -f "$DIR/run/munged.started"
  fi
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF="$CONF" sinfo -N; SLURM_CONF="$CONF" squeue ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
