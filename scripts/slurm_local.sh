#!/bin/bash
# A real one-node Slurm on this machine (Debian slurm-wlm + munge), with job accounting (slurmdbd on a private
# MariaDB), for tests. Idempotent: a second `start` only checks that every daemon is alive.
#
#   bash scripts/slurm_local.sh [start]   install if needed, write the configs, start munged, MariaDB, slurmdbd
#                                         (registering the cluster), slurmctld and slurmd, wait until the node is
#                                         idle, print `export SLURM_CONF=...`
#   bash scripts/slurm_local.sh stop      stop the daemons this script started (slurmd, slurmctld, slurmdbd,
#                                         MariaDB, and munged only if this script started it)
#   bash scripts/slurm_local.sh status    sinfo / squeue / sacct
#
# Start order matters: MariaDB -> slurmdbd -> `sacctmgr add cluster` -> slurmctld, so slurmctld finds its cluster
# in the accounting database from its first connection and `sacct` reports real job states (submitit reads them).
# MariaDB is private to this script: its datadir is $DIR/mysql, socket and pid under $DIR/run/mariadb, TCP only on
# 127.0.0.1:$SLURM_LOCAL_DB_PORT (slurmdbd.conf has no socket setting, and StorageHost=localhost would go to the
# client library's default socket, i.e. a system MariaDB). slurmdbd 22.05 has no -f: it reads slurmdbd.conf
# (mode 600, owner SlurmUser=root) next to $SLURM_CONF. Accounting records reach sacct a moment after the event.
#
# Variables: SLURM_LOCAL_DIR (state dir, default /tmp/polar-slurm), SLURM_LOCAL_CPUS (default 32; config_overrides lets it exceed real cores),
# SLURM_LOCAL_MEM_MB (default 131072, not enforced: task/none), SLURM_LOCAL_TIMEOUT (seconds to wait for each daemon, default 60),
# SLURM_LOCAL_DB_PORT (MariaDB TCP port on 127.0.0.1, default 3307), SLURM_LOCAL_DBD_PORT (slurmdbd port, default 6819),
# SLURM_LOCAL_CTLD_PORT (slurmctld, default 6817), SLURM_LOCAL_SLURMD_PORT (slurmd, default 6818). With a state dir and
# ports of its own, a second cluster runs beside the first (both use the machine's one munged).
# Needs root (apt-get, munge key, slurmd). Everything but the key and packages lives in the state dir.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/polar-slurm}"
CONF="$DIR/slurm.conf"
CPUS="${SLURM_LOCAL_CPUS:-32}"
MEM_MB="${SLURM_LOCAL_MEM_MB:-131072}"
TIMEOUT="${SLURM_LOCAL_TIMEOUT:-60}"
DB_PORT="${SLURM_LOCAL_DB_PORT:-3307}"
DBD_PORT="${SLURM_LOCAL_DBD_PORT:-6819}"
CTLD_PORT="${SLURM_LOCAL_CTLD_PORT:-6817}"
SLURMD_PORT="${SLURM_LOCAL_SLURMD_PORT:-6818}"
DBD_CONF="$DIR/slurmdbd.conf"  # must sit next to $CONF: slurmdbd finds it through SLURM_CONF
DB_DATA="$DIR/mysql"
DB_RUN="$DIR/run/mariadb"
DB_SOCK="$DB_RUN/mariadb.sock"
DB_PID="$DB_RUN/mariadb.pid"
log() { echo "slurm_local: $*" >&2; }

install() {
  local cmd missing=""
  for cmd in slurmctld slurmd munged slurmdbd mariadbd mariadb-install-db mariadb python3; do
    command -v "$cmd" >/dev/null || missing=1
  done
  [ -z "$missing" ] && return
  log "installing slurm-wlm, slurmdbd, mariadb-server, munge, python3"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # Debian's postinst would start a system MariaDB on port 3306 through its init script (no systemd here);
  # a temporary policy-rc.d forbids that, this script runs its own MariaDB.
  local policy=/usr/sbin/policy-rc.d added="" rc=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    added=1
  fi
  apt-get install -y -qq slurm-wlm slurmdbd mariadb-server munge python3 >/dev/null || rc=$?
  if [ -n "$added" ]; then rm -f "$policy"; fi
  return "$rc"
}

write_conf() {
  mkdir -p "$DIR/spool/ctld" "$DIR/spool/d" "$DIR/log" "$DIR/run"
  # slurm.conf is world-readable (sacct, sbatch read it); the DB password lives only in slurmdbd.conf
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
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
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

  # the slurmdbd user's MariaDB password: random, made once, kept in the state dir (root only)
  if [ ! -s "$DIR/db.pass" ]; then
    (umask 077; od -An -N16 -tx1 /dev/urandom | tr -d ' \n' > "$DIR/db.pass")
  fi
  (umask 077; cat > "$DBD_CONF.new" <<EOF
# written by scripts/slurm_local.sh; slurmdbd insists on mode 600 and owner SlurmUser
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$DIR/db.pass")
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$DBD_CONF.new"
  mv "$DBD_CONF.new" "$DBD_CONF"
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

wait_until() {  # WHAT COMMAND...: poll COMMAND every 0.5 s for up to $TIMEOUT s
  local what="$1" waited=0
  shift
  until "$@"; do
    if [ "$waited" -ge $((TIMEOUT * 2)) ]; then
      log "$what not up after ${TIMEOUT}s; logs in $DIR/log"
      return 1
    fi
    sleep 0.5
    waited=$((waited + 1))
  done
}

db() {  # SQL on stdin, as MariaDB root over the private socket (unix_socket auth: OS root is DB root)
  mariadb --no-defaults --socket="$DB_SOCK" -u root --batch --skip-column-names
}

db_up() {
  alive "$DB_PID" && echo 'SELECT 1' | db >/dev/null 2>&1
}

start_mariadb() {
  mkdir -p "$DB_RUN"
  if [ ! -f "$DB_DATA/.polar-initialized" ]; then
    # a half-made datadir (interrupted first start) is rebuilt from scratch
    log "initializing MariaDB datadir $DB_DATA"
    rm -rf "$DB_DATA"
    mariadb-install-db --no-defaults --user=root --datadir="$DB_DATA" \
      --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 \
      || { log "mariadb-install-db failed:"; tail -n 20 "$DIR/log/mariadb-install.log" >&2; return 1; }
    touch "$DB_DATA/.polar-initialized"
  fi
  if ! alive "$DB_PID"; then
    log "starting MariaDB on 127.0.0.1:$DB_PORT"
    # --no-defaults: ignore /etc/mysql (the system server's socket, port and datadir). setsid and closed stdio so
    # the server outlives this script and does not hold a caller's pipes open (the test fixture captures output).
    # The InnoDB values are the least that keep slurmdbd from logging 'Database settings not recommended' (the pool
    # is reserved, not resident: RSS stays near 100 MB for this tiny database).
    setsid mariadbd --no-defaults --user=root --datadir="$DB_DATA" --socket="$DB_SOCK" --pid-file="$DB_PID" \
      --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve --log-error="$DIR/log/mariadb.log" \
      --innodb-buffer-pool-size=512M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
  fi
  wait_until MariaDB db_up || { tail -n 20 "$DIR/log/mariadb.log" >&2; return 1; }
  # idempotent; also resets the password should db.pass have been remade
  db <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$DIR/db.pass")';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$DIR/db.pass")';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
}

dbd_up() {
  SLURM_CONF="$CONF" sacctmgr -i -n show cluster >/dev/null 2>&1
}

start_slurmdbd() {
  if ! alive "$DIR/run/slurmdbd.pid"; then
    log "starting slurmdbd on port $DBD_PORT"
    SLURM_CONF="$CONF" slurmdbd
  fi
  wait_until slurmdbd dbd_up || { tail -n 20 "$DIR/log/slurmdbd.log" >&2; return 1; }
  # register the cluster before slurmctld first connects, so its jobs are recorded from the start
  if ! SLURM_CONF="$CONF" sacctmgr -n -P show cluster format=Cluster | grep -qx polarlocal; then
    log "registering cluster polarlocal with slurmdbd"
    SLURM_CONF="$CONF" sacctmgr -i add cluster polarlocal >/dev/null
  fi
}

idle() {
  SLURM_CONF="$CONF" sinfo -h -N -o '%t' 2>/dev/null | grep -qx 'idle'
}

start() {
  install
  write_conf
  start_munge
  start_mariadb
  start_slurmdbd
  # a slurmctld left running from before accounting was configured keeps its old config: restart it
  # (output captured first: `scontrol | grep -q` would fail under pipefail when grep exits early)
  if alive "$DIR/run/slurmctld.pid"; then
    local running
    running="$(SLURM_CONF="$CONF" scontrol show config 2>/dev/null || true)"
    if ! grep -q '^AccountingStorageType *= accounting_storage/slurmdbd' <<<"$running"; then
      stop_one slurmctld "$DIR/run/slurmctld.pid"
    fi
  fi
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

stop_one() {  # NAME PIDFILE [SECONDS before SIGKILL, default 5]
  if alive "$2"; then
    local pid
    pid="$(cat "$2")"
    log "stopping $1 ($pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq $(( ${3:-5} * 10 ))); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    log "$1 ($pid) ignored SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
}

stop() {
  if [ -f "$CONF" ] && alive "$DIR/run/slurmctld.pid"; then
    SLURM_CONF="$CONF" scancel --full --user=root 2>/dev/null || true
  fi
  stop_one slurmd "$DIR/run/slurmd.pid"
  stop_one slurmctld "$DIR/run/slurmctld.pid"
  stop_one slurmdbd "$DIR/run/slurmdbd.pid"
  # MariaDB flushes InnoDB on SIGTERM: give it longer than the Slurm daemons
  stop_one MariaDB "$DB_PID" 30
  # munged is stopped only when this script started it
  if [ -f "$DIR/run/munged.started" ]; then
    stop_one munged /run/munge/munged.pid
    rm -f "$DIR/run/munged.started"
  fi
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF="$CONF" sinfo -N; SLURM_CONF="$CONF" squeue; SLURM_CONF="$CONF" sacct -X -o JobID,JobName,State ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
