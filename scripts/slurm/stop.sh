#!/usr/bin/env bash
# Stop the cluster that scripts/slurm/start.sh started and remove its directory: its jobs are cancelled, then each
# daemon named by a pid file under the directory is stopped (and only if that process belongs to this directory).
#
#     scripts/slurm/stop.sh [DIR]     # DIR defaults to $SLURM_CLUSTER_DIR
set -uo pipefail

DIR=${1:-${SLURM_CLUSTER_DIR:-}}
[[ -n $DIR && -d $DIR && -f $DIR/etc/slurm.conf || -n $DIR && -d $DIR/munge ]] \
    || { echo "slurm-stop: no cluster directory (argument or SLURM_CLUSTER_DIR)" >&2; exit 1; }
export SLURM_CONF=$DIR/etc/slurm.conf

# The process of a pid file, if it is still the daemon this cluster started (its command line or environment names
# the directory; a recycled pid does not).
ours() {
    local pid
    pid=$(cat "$DIR/run/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    local identity
    identity=$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null; tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null)
    [[ $identity == *"$DIR"* ]] || return 1
    echo "$pid"
}

stop() {
    local pid
    pid=$(ours "$1") || return 0
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    echo "slurm-stop: $1 ($pid) ignored SIGTERM for 10 s; SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null
}

if [[ -f $SLURM_CONF ]] && ours slurmctld >/dev/null; then
    scancel --full --quiet --user=root 2>/dev/null  # every job of this (private) cluster
    for _ in $(seq 50); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2; done
fi
for daemon in slurmd slurmctld slurmdbd mariadbd munged; do stop "$daemon"; done
rm -rf "$DIR"
echo "slurm-stop: stopped and removed $DIR" >&2
