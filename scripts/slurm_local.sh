#!/bin/bash
# A real one-node Slurm on this machine (Debian slurm-wlm + munge), with job accounting (slurmdbd on a private
# MariaDB), for tests. Idempotent: a second `start` only checks that every daemon is alive.
#
#   bash scripts/slurm_local.sh [start]   install if needed, write the configs, start munged, MariaDB, slurmdbd
#                                         (registering the cluster), slurmctld and slurmd, wait until the node is
#                                         idle, print `export SLURM_CONF=...`
#   bash scripts/slurm_local.sh start --nodes N
#                                         the same with N compute nodes (N >= 1), each a slurmd in network, UTS,
#                                         mount and time namespaces of its own (see "Several nodes" below)
#   bash scripts/slurm_local.sh stop      stop the daemons this script started (slurmd, slurmctld, slurmdbd,
#                                         MariaDB, and munged only if this script started it); with nodes, also
#                                         every process left in a node (jobs too), the namespaces, veths, bridge
#                                         and the /etc/hosts block
#   bash scripts/slurm_local.sh status    sinfo / squeue / sacct
#   bash scripts/slurm_local.sh kill-node NODE
#                                         a node crash: SIGKILL to its slurmd and every process on it (jobs too);
#                                         its namespaces stay, and `start --nodes N` brings its slurmd back
#   bash scripts/slurm_local.sh link NODE down|up
#                                         unplug / plug the node's cable (its veth on the bridge)
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
#
# Several nodes (--nodes N): the controller (slurmctld, slurmdbd, MariaDB) stays in the host's network namespace and
# answers on the bridge's address $SUBNET.1 as $NAME-ctl (slurmctld runs in a UTS namespace with that hostname, as
# Slurm wants its own name to match SlurmctldHost). Node i is `ip netns` $NAME-node$i: eth0 (a veth pair whose host
# end is on bridge ${NAME}br0) at $SUBNET.$((10 + i)), its own loopback, hostname $NAME-node$i (UTS namespace), a
# private mount namespace where $SCRATCH is a bind of $DIR/nodes/<node>/scratch (node-local scratch: the same path
# shows each node its own files), and a time namespace whose CLOCK_MONOTONIC is i days ahead (nothing may compare
# monotonic times across nodes). Jobs are slurmd's children, so they live in the node's namespaces; a job on node A
# reaches node B only through B's name or address (B's 127.0.0.1 is B's own). Names resolve through a marked block
# in /etc/hosts. Debian's slurmd runs once per namespace with per-node spool, pid and log files (%n in
# slurm.conf); proctrack/linuxproc and task/none need no cgroup.
# More variables: SLURM_LOCAL_NAME (default polar: hostnames, namespaces, bridge; at most 8 characters),
# SLURM_LOCAL_SUBNET (first three octets of a free /24, default 10.77.0), SLURM_LOCAL_SCRATCH (the node-local
# scratch path, default $DIR/scratch), SLURM_LOCAL_TIME_NS (1: per-node monotonic offsets, the default; 0: none),
# SLURM_LOCAL_NODE_TIMEOUT (SlurmdTimeout: seconds until a silent node is DOWN, default 30).
# /etc/hosts is replaced whole (a temporary file in /etc renamed over it; a bind-mounted one is written in place in
# one write, never truncated first) under a lock in SLURM_LOCAL_LOCK_DIR (default /run/polar-slurm, mode 700,
# root's own). `hosts-block N` / `hosts-clear` do that step alone (tests point SLURM_LOCAL_HOSTS_FILE elsewhere).
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
NAME="${SLURM_LOCAL_NAME:-polar}"
SUBNET="${SLURM_LOCAL_SUBNET:-10.77.0}"
SCRATCH="${SLURM_LOCAL_SCRATCH:-$DIR/scratch}"
TIME_NS="${SLURM_LOCAL_TIME_NS:-1}"
NODE_TIMEOUT="${SLURM_LOCAL_NODE_TIMEOUT:-30}"
NODES_FILE="$DIR/nodes.list"  # the started cluster's "NODES NAME SUBNET" (absent: the one-node localhost cluster)
names_from() {  # NAME: the bridge and the /etc/hosts markers of a cluster named NAME
  NAME="$1" BRIDGE="${1}br0" HOSTS_BEGIN="# >>> slurm_local $1 ($DIR) >>>" HOSTS_END="# <<< slurm_local $1 <<<"
}
names_from "$NAME"
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

write_conf() {  # NODES (0: the one-node localhost cluster)
  local nodes="$1" ctl_host=localhost spool="$DIR/spool/d" pidfile="$DIR/run/slurmd.pid" logfile="$DIR/log/slurmd.log"
  local node_lines="NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN" i
  local partition_nodes=localhost
  mkdir -p "$DIR/spool/ctld" "$DIR/spool/d" "$DIR/log" "$DIR/run"
  if [ "$nodes" -gt 0 ]; then  # one slurmd per node, each with its own spool, pid and log file
    ctl_host="$NAME-ctl($SUBNET.1)" spool="$DIR/spool/%n" pidfile="$DIR/run/slurmd-%n.pid"
    logfile="$DIR/log/slurmd-%n.log" node_lines="" partition_nodes="$NAME-node[1-$nodes]"
    # a killed node is DOWN (its jobs NODE_FAIL) after SlurmdTimeout: seconds, not the default 5 minutes
    # TmpFS: the node-local scratch (each node's own bind at the same path), as a real cluster declares /tmp or /scratch
    node_lines="SlurmdTimeout=$NODE_TIMEOUT"$'\n'"TmpFS=$SCRATCH"$'\n'
    for i in $(seq "$nodes"); do
      node_lines+="NodeName=$NAME-node$i NodeAddr=$SUBNET.$((10 + i)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"$'\n'
    done
    node_lines="${node_lines%$'\n'}"
  fi
  # slurm.conf is world-readable (sacct, sbatch read it); the DB password lives only in slurmdbd.conf
  cat > "$CONF.new" <<EOF
# written by scripts/slurm_local.sh
ClusterName=polarlocal
SlurmctldHost=$ctl_host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$pidfile
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$logfile
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
$node_lines
PartitionName=debug Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP
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

idle() {  # NODES: every node (at least one) idle
  local states
  states="$(SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u)" || return 1
  [ -n "$states" ] && [ "$(grep -c ' idle$' <<<"$states")" -eq "$(grep -c . <<<"$states")" ] \
    && [ "$(grep -c . <<<"$states")" -ge "${1:-1}" ]
}

node_names() {  # NODES
  local i
  for i in $(seq "$1"); do echo "$NAME-node$i"; done
}

HOSTS_FILE="${SLURM_LOCAL_HOSTS_FILE:-/etc/hosts}"
hosts_without_block() {  # /etc/hosts without this cluster's block
  awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' "$HOSTS_FILE"
}

# Clusters side by side edit /etc/hosts one at a time, under a lock in a directory only root can write: a lock file
# in /tmp would be opened as root through any symlink another user put there (and truncate what it points to).
LOCK_DIR="${SLURM_LOCAL_LOCK_DIR:-/run/polar-slurm}"

lock_hosts() {  # take the /etc/hosts lock on fd 9 (the directory is made 0700 and must be root's own, no symlink)
  if [ ! -e "$LOCK_DIR" ] && [ ! -L "$LOCK_DIR" ]; then
    mkdir -m 0700 "$LOCK_DIR" 2>/dev/null || true  # fails if someone made it meanwhile: checked below
  fi
  if [ -L "$LOCK_DIR" ] || [ ! -d "$LOCK_DIR" ] || [ "$(stat -c '%u %a' "$LOCK_DIR")" != "$(id -u) 700" ]; then
    log "refusing the lock directory $LOCK_DIR: it must be a directory of $(id -un)'s own, mode 700, not a symlink"
    return 1
  fi
  exec 9>"$LOCK_DIR/hosts.lock"
  flock 9
}

replace_hosts() {  # CONTENT: make it /etc/hosts without a moment where the file is empty or cut
  local tmp size length
  rm -f "$(dirname "$HOSTS_FILE")"/.hosts.slurm_local.*  # left by a crash (we hold the lock: none is in use)
  tmp="$(mktemp "$(dirname "$HOSTS_FILE")/.hosts.slurm_local.XXXXXX")"  # O_EXCL, mode 600, same file system
  if ! printf '%s' "$1" > "$tmp" || ! chmod --reference="$HOSTS_FILE" "$tmp" \
      || ! chown --reference="$HOSTS_FILE" "$tmp"; then
    rm -f "$tmp"
    return 1
  fi
  sync "$tmp" 2>/dev/null || true
  if mv -fT "$tmp" "$HOSTS_FILE" 2>/dev/null; then return 0; fi
  # A container's /etc/hosts is often a bind mount, which rename cannot replace (EBUSY). Then write in place
  # without truncating first: the new content padded with newlines to at least the old size goes out in one
  # write over the old bytes, and only then is the padding cut. A crash leaves the old file, the new one, or the
  # new one with blank lines after it, never an empty or half file.
  size="$(stat -c %s "$HOSTS_FILE")" length="$(stat -c %s "$tmp")"
  if [ "$size" -gt "$length" ]; then head -c "$((size - length))" /dev/zero | tr '\0' '\n' >> "$tmp"; fi
  if ! dd if="$tmp" of="$HOSTS_FILE" bs="$(stat -c %s "$tmp")" count=1 conv=notrunc,fsync status=none; then
    rm -f "$tmp"
    return 1
  fi
  rm -f "$tmp"
  truncate -s "$length" "$HOSTS_FILE"
}

write_hosts() {  # NODES: (re)write the marked block
  local new i
  lock_hosts
  new="$(hosts_without_block)"$'\n'"$HOSTS_BEGIN"$'\n'"$SUBNET.1 $NAME-ctl"
  for i in $(seq "$1"); do new+=$'\n'"$SUBNET.$((10 + i)) $NAME-node$i"; done
  replace_hosts "$new"$'\n'"$HOSTS_END"$'\n'
  exec 9>&-
}

clear_hosts() {  # remove the marked block, if there is one
  lock_hosts
  if grep -qxF "$HOSTS_BEGIN" "$HOSTS_FILE"; then
    local kept
    kept="$(hosts_without_block)"
    replace_hosts "$kept"$'\n'
  fi
  exec 9>&-
}

start_network() {  # NODES: bridge, and per node a namespace with a veth on the bridge (idempotent)
  local i ns veth
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    local taken
    taken="$(ip -4 -o addr show | awk -v a="$SUBNET.1/24" '$4 == a {print $2}')"
    if [ -n "$taken" ]; then
      log "$SUBNET.0/24 is in use on $taken: choose another SLURM_LOCAL_SUBNET"
      return 1
    fi
    log "creating bridge $BRIDGE ($SUBNET.1/24)"
    ip link add "$BRIDGE" type bridge
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
  for i in $(seq "$1"); do
    ns="$NAME-node$i" veth="${NAME}v$i"
    if ! ip netns list | grep -qw "^$ns"; then ip netns add "$ns"; fi
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link del "$veth" 2>/dev/null || true
      ip link add "$veth" type veth peer name "${veth}n"
      ip link set "${veth}n" netns "$ns"
      ip -n "$ns" link set "${veth}n" name eth0
      ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev eth0
      ip link set "$veth" master "$BRIDGE"
    fi
    ip link set "$veth" up
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  write_hosts "$1"
}

start_slurmd_in_node() {  # INDEX: slurmd in the node's namespaces (it daemonizes; its jobs are its children)
  local node="$NAME-node$1" time_args=() timens=/dev/null
  mkdir -p "$DIR/nodes/$node/scratch" "$SCRATCH"
  rm -f "$DIR/nodes/$node/timens"
  if [ "$TIME_NS" = 1 ]; then
    time_args=(--time --monotonic=$(($1 * 86400)) --boottime=$(($1 * 86400))) timens="$DIR/nodes/$node/timens"
  fi
  # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup, and slurmd 22.05 then fails to start
  # ("Unable to initialize cgroup plugin"). The mount namespace is a slave of the host's: the bind stays node-local.
  nsenter --net="/run/netns/$node" unshare --mount --propagation slave --uts "${time_args[@]}" --fork -- sh -c \
    'hostname "$1" && mount --bind "$2" "$3" && readlink /proc/$$/ns/time > "$5" && exec slurmd -f "$4" -N "$1"' \
    sh "$node" "$DIR/nodes/$node/scratch" "$SCRATCH" "$CONF" "$timens"
}

node_slurmd() {  # NODE: the pid of its slurmd, if running (pids wrap quickly on a busy host: a pid file alone lies)
  local pid
  pid="$(cat "$DIR/run/slurmd-$1.pid" 2>/dev/null)" || return 0
  if [ -n "$pid" ] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "^slurmd .*-N $1 "; then echo "$pid"; fi
}

node_pids() {  # NODE: the processes in its network namespace, and (sandboxes may have a network namespace of their
  # own) those in its time namespace, which nothing below slurmd leaves
  local node="$1" timens=""
  ip netns pids "$node" 2>/dev/null || true
  if [ -s "$DIR/nodes/$node/timens" ]; then  # written only for a node started with a time namespace
    timens="$(cat "$DIR/nodes/$node/timens")"  # time:[INODE]: one stat for every process, not a readlink each
    stat -L -c '%i %n' /proc/[0-9]*/ns/time 2>/dev/null \
      | awk -v inode="${timens//[!0-9]/}" '$1 == inode { split($2, path, "/"); print path[3] }' || true
  fi
}

own_state_dir() {  # the state dir holds the configs, keys and pid files root's daemons read: ours, never a link
  if [ -L "$DIR" ] || { [ -e "$DIR" ] && [ "$(stat -c %u "$DIR")" != "$(id -u)" ]; }; then
    log "refusing the state directory $DIR: it must be $(id -un)'s own and not a symlink (SLURM_LOCAL_DIR picks another)"
    exit 1
  fi
  mkdir -p "$DIR"
}

start() {
  own_state_dir
  local nodes=0
  if [ "${1:-}" = "--nodes" ]; then
    nodes="${2:-}"
    [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 start [--nodes N]" >&2; exit 2; }
    [ "${#NAME}" -le 8 ] || { log "SLURM_LOCAL_NAME=$NAME: at most 8 characters (interface names)"; exit 2; }
  fi
  local before=0
  if [ -f "$NODES_FILE" ]; then before="$(cat "$NODES_FILE")"; fi
  if [ "${before%% *}" != "$nodes" ] && alive "$DIR/run/slurmctld.pid"; then
    log "this cluster runs with ${before%% *} node(s) (0: localhost); run '$0 stop' first"
    exit 1
  fi
  install
  write_conf "$nodes"
  if [ "$nodes" -gt 0 ]; then
    echo "$nodes $NAME $SUBNET" > "$NODES_FILE"
    start_network "$nodes"
  else
    rm -f "$NODES_FILE"
  fi
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
    if [ "$nodes" -gt 0 ]; then  # its hostname must match SlurmctldHost
      unshare --uts -- sh -c 'hostname "$1" && exec slurmctld -f "$2"' sh "$NAME-ctl" "$CONF"
    else
      slurmctld -f "$CONF"
    fi
  fi
  local i names=localhost
  if [ "$nodes" -gt 0 ]; then
    names="$NAME-node[1-$nodes]"
    for i in $(seq "$nodes"); do
      if [ -z "$(node_slurmd "$NAME-node$i")" ]; then
        log "starting slurmd on $NAME-node$i ($SUBNET.$((10 + i)))"
        start_slurmd_in_node "$i"
      fi
    done
  elif ! alive "$DIR/run/slurmd.pid"; then
    log "starting slurmd"
    slurmd -f "$CONF" -N localhost
  fi
  local waited=0
  until idle "$nodes"; do
    if [ "$waited" -ge $((TIMEOUT * 2)) ]; then
      log "nodes not idle after ${TIMEOUT}s; logs in $DIR/log"
      SLURM_CONF="$CONF" sinfo -N >&2 || true
      tail -n 20 "$DIR/log/slurmctld.log" "$DIR"/log/slurmd*.log >&2 || true
      exit 1
    fi
    # a node left DOWN/DRAIN by an earlier run comes back on resume
    if [ $((waited % 10)) -eq 9 ]; then
      SLURM_CONF="$CONF" scontrol update NodeName="$names" State=RESUME >/dev/null 2>&1 || true
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

stop_node() {  # NODE: slurmd, then every process left in its network namespace (jobs too), then the namespace
  local node="$1" pids slurmd
  slurmd="$(node_slurmd "$node")"
  if [ -n "$slurmd" ]; then
    log "stopping slurmd on $node ($slurmd)"
    kill -TERM "$slurmd" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$slurmd" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$DIR/run/slurmd-$node.pid"
  pids="$(node_pids "$node" | sort -u)"
  if [ -n "$pids" ]; then
    log "killing what is left on $node: $(echo $pids)"
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 30); do [ -z "$(node_pids "$node")" ] && break; sleep 0.1; done
    pids="$(node_pids "$node" | sort -u)"
    if [ -n "$pids" ]; then kill -KILL $pids 2>/dev/null || true; fi
    for _ in $(seq 50); do [ -z "$(node_pids "$node")" ] && break; sleep 0.1; done
  fi
  if ip netns list | grep -qw "^$node"; then
    ip netns del "$node" 2>/dev/null || true  # takes its veth pair with it
  fi
}

stop_network() {  # NODES
  local i
  for i in $(seq "$1"); do ip link del "${NAME}v$i" 2>/dev/null || true; done
  ip link del "$BRIDGE" 2>/dev/null || true
  clear_hosts
}

load_cluster() {  # the node count, names and subnet the cluster was started with, whatever the environment says now
  local name
  NODES=0
  if [ -f "$NODES_FILE" ]; then read -r NODES name SUBNET < "$NODES_FILE"; names_from "$name"; fi
}

node_index() {  # NODE: its index, or exit 2 if it is not a node of this cluster
  local i="${1#"$NAME-node"}"
  if [[ ! "$i" =~ ^[1-9][0-9]*$ ]] || [ "$i" -gt "$NODES" ]; then
    log "$1 is not a node of this cluster ($(node_names "$NODES" | tr '\n' ' '))"
    exit 2
  fi
  echo "$i"
}

kill_node() {  # NODE: a crash: SIGKILL to its slurmd and everything on it; the namespace stays (start revives it)
  local node="$1" pids
  load_cluster
  node_index "$node" >/dev/null
  pids="$(node_pids "$node" | sort -u)"  # slurmd too: it lives in the node's namespaces
  if [ -n "$pids" ]; then log "killing $node: $(echo $pids)"; kill -KILL $pids 2>/dev/null || true; fi
  rm -f "$DIR/run/slurmd-$node.pid"
  for _ in $(seq 50); do [ -z "$(node_pids "$node")" ] && all_exited $pids && return 0; sleep 0.1; done
  log "processes left on $node: $(node_pids "$node" | tr '\n' ' ')"
  return 1
}

all_exited() {  # PIDS: each gone, or a zombie with no thread left. A killed process leaves its namespaces (so node_pids
  # no longer lists it) while its other threads still exit and hold its files: its listening sockets accept a moment
  # longer (a test's connect reached a killed gateway once)
  local pid
  for pid in "$@"; do
    [ -r "/proc/$pid/status" ] || continue
    awk '/^State:/ { zombie = ($2 == "Z") } /^Threads:/ { threads = $2 } END { exit !(zombie && threads <= 1) }' \
      "/proc/$pid/status" 2>/dev/null || return 1
  done
}

link_node() {  # NODE up|down: its cable (the host end of its veth)
  load_cluster
  local i
  i="$(node_index "$1")"
  [[ "${2:-}" =~ ^(up|down)$ ]] || { echo "usage: $0 link NODE up|down" >&2; exit 2; }
  ip link set "${NAME}v$i" "$2"
}

stop() {
  local nodes node
  load_cluster
  nodes="$NODES"
  if [ -f "$CONF" ] && alive "$DIR/run/slurmctld.pid"; then
    SLURM_CONF="$CONF" scancel --full --user=root 2>/dev/null || true
    # slurmctld and every slurmd at once (2.6 s for three nodes, against 11 s one daemon at a time: slurmctld
    # alone sat 5 s on SIGTERM once its nodes were gone); what is left below is stopped one by one
    local daemons pid
    daemons="$(cat "$DIR/run/slurmctld.pid" 2>/dev/null || true)"
    for node in $(node_names "$nodes"); do daemons="$daemons $(node_slurmd "$node")"; done
    [ "$nodes" -gt 0 ] || daemons="$daemons $(cat "$DIR/run/slurmd.pid" 2>/dev/null || true)"
    if SLURM_CONF="$CONF" scontrol shutdown >/dev/null 2>&1; then
      for pid in $daemons; do
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      done
    fi
  fi
  if [ "$nodes" -gt 0 ]; then
    for node in $(node_names "$nodes"); do stop_node "$node"; done
  else
    stop_one slurmd "$DIR/run/slurmd.pid"
  fi
  stop_one slurmctld "$DIR/run/slurmctld.pid"
  stop_one slurmdbd "$DIR/run/slurmdbd.pid"
  # MariaDB flushes InnoDB on SIGTERM: give it longer than the Slurm daemons
  stop_one MariaDB "$DB_PID" 30
  if [ "$nodes" -gt 0 ]; then stop_network "$nodes"; rm -f "$NODES_FILE"; fi
  # munged is stopped only when this script started it
  if [ -f "$DIR/run/munged.started" ]; then
    stop_one munged /run/munge/munged.pid
    rm -f "$DIR/run/munged.started"
  fi
}

case "${1:-start}" in
  start) shift || true; start "$@" ;;
  stop) stop ;;
  kill-node) kill_node "${2:?usage: $0 kill-node NODE}" ;;
  link) link_node "${2:?usage: $0 link NODE up|down}" "${3:-}" ;;
  # the /etc/hosts block alone (tests: SLURM_LOCAL_HOSTS_FILE and SLURM_LOCAL_LOCK_DIR point elsewhere)
  hosts-block) write_hosts "${2:?usage: $0 hosts-block NODES}" ;;
  hosts-clear) clear_hosts ;;
  status) SLURM_CONF="$CONF" sinfo -N; SLURM_CONF="$CONF" squeue; SLURM_CONF="$CONF" sacct -X -o JobID,JobName,State ;;
  *) echo "usage: $0 [start [--nodes N]|stop|status|kill-node NODE|link NODE up|down]" >&2; exit 2 ;;
esac
