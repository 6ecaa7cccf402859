#!/usr/bin/env bash
# Start a real single-node SLURM cluster (munge, mariadb, slurmdbd, slurmctld, slurmd) under a fresh temporary
# directory, for CI and for trying the slurm profile on one machine. Prints the environment its clients need:
#
#     eval "$(scripts/slurm/start.sh)"     # exports SLURM_CONF and SLURM_CLUSTER_DIR
#     sinfo; snakemake --profile slurm ...
#     scripts/slurm/stop.sh                # stops what this script started (pid files), removes the directory
#
# Needs root and Debian's packages (installed if missing: slurm-wlm slurmdbd mariadb-server munge). Ports are picked
# free, so several clusters can run side by side. Logs: $SLURM_CLUSTER_DIR/log/.
set -euo pipefail

log() { echo "slurm-start: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root (SlurmUser=root, daemons write their pid files under the cluster dir)"
if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null \
    || ! command -v munged >/dev/null; then
    log "installing slurm-wlm slurmdbd mariadb-server munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends slurm-wlm slurmdbd mariadb-server munge >&2
fi

DIR=$(mktemp -d "${TMPDIR:-/tmp}/slurm-cluster.XXXXXX")
chmod 0755 "$DIR"  # munge's socket directory and its parents must be 0755 for clients
mkdir -p "$DIR"/{etc,log,run,state,spool,munge,mysql}
chmod 0755 "$DIR"/munge
SOCK=$DIR/munge/munge.socket.2
fail() { log "error: $*; logs:"; tail -n 20 "$DIR"/log/*.log >&2 || true; "$(dirname "$0")/stop.sh" "$DIR" >&2 || true; exit 1; }

read -r P_CTLD P_SLURMD P_DBD P_SQL < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)

# --- munge: a fresh key, its own socket.
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$DIR/munge/munge.key"
munged --force --key-file="$DIR/munge/munge.key" --socket="$SOCK" --pid-file="$DIR/run/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" || fail "munged did not start"

# --- mariadb on a free localhost port (slurmdbd cannot be pointed at a custom unix socket).
mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=root --auth-root-authentication-method=normal \
    --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 || fail "mariadb-install-db failed"
mariadbd --no-defaults --datadir="$DIR/mysql" --user=root --bind-address=127.0.0.1 --port="$P_SQL" \
    --socket="$DIR/run/mysqld.sock" --pid-file="$DIR/run/mariadbd.pid" --log-error="$DIR/log/mariadb.log" \
    --skip-name-resolve --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
for _ in $(seq 100); do [[ -S $DIR/run/mysqld.sock ]] && break; sleep 0.1; done
[[ -S $DIR/run/mysqld.sock ]] || fail "mariadbd did not start"
mariadb --no-defaults --socket="$DIR/run/mysqld.sock" -u root -e \
    "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" \
    || fail "could not create the slurm database user"

# --- configuration: 95% of the node's real memory (more drains the node); its real CPUs, or SLURM_CPUS when set
# (the test suite's CI sets 8: its jobs mostly wait for a time limit or a requeue, and on 2 cores a two-task job would
# otherwise hold every CPU while it waits and the two test workers' jobs queue behind each other; slurmd accepts more
# CPUs than the machine has through config_overrides).
NODE=$(hostname -s)
read -r CPUS MEM < <(slurmd -C | awk '/^NodeName/ {for (i = 1; i <= NF; i++) {split($i, kv, "=");
    if (kv[1] == "CPUs") c = kv[2]; if (kv[1] == "RealMemory") m = kv[2]}} END {print c, int(m * 0.95)}')
CPUS=${SLURM_CPUS:-$CPUS}
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || fail "SLURM_CPUS = '$CPUS': valid: a positive integer"
cat >"$DIR/etc/slurm.conf" <<CONF
ClusterName=ci
SlurmctldHost=localhost
SlurmctldPort=$P_CTLD
SlurmdPort=$P_SLURMD
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire (120 s by default) before it can start again.
AuthInfo=socket=$SOCK,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# Accounting: without sacct, submitit cannot learn that a job was cancelled and waits forever.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$P_DBD
AccountingStoragePass=$SOCK
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# Seconds between a job's SIGTERM and its SIGKILL (time limit, cancel, requeue): a requeued job's tasks that ignore
# SIGTERM (submitit's do) hold the requeue this long; 5 s leave a loaded machine's job time to log its requeue.
KillWait=5
SlurmdParameters=config_overrides
MinJobAge=600
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
cat >"$DIR/etc/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$SOCK
DbdHost=localhost
DbdPort=$P_DBD
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$P_SQL
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
CONF
chmod 0600 "$DIR/etc/slurmdbd.conf"  # slurmdbd refuses a config others can read
export SLURM_CONF=$DIR/etc/slurm.conf

# --- daemons: slurmdbd first (slurmctld registers the cluster with it), then the controller, then the node.
slurmdbd || fail "slurmdbd did not start"
for _ in $(seq 100); do sacctmgr -i list cluster >/dev/null 2>&1 && break; sleep 0.1; done
sacctmgr -i list cluster >/dev/null 2>&1 || fail "slurmdbd does not answer"
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" -N "$NODE" || fail "slurmd did not start"
for _ in $(seq 150); do
    scontrol ping >/dev/null 2>&1 && [[ $(sinfo -h -N -o %t 2>/dev/null) == idle* ]] && break
    sleep 0.2
done
[[ $(sinfo -h -N -o %t 2>/dev/null) == idle* ]] || fail "node $NODE is not idle: $(sinfo -h -N -o '%t %E' 2>&1)"
log "up: $NODE, $CPUS CPUs, ${MEM} MB, partition ci, dir $DIR"
echo "export SLURM_CONF=$SLURM_CONF"
echo "export SLURM_CLUSTER_DIR=$DIR"
