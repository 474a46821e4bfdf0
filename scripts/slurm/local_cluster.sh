#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for tests and trying the sbatch scripts:
#   scripts/slurm/local_cluster.sh start STATE_DIR   installs slurm-wlm + munge if missing (Debian),
#                                                    starts munged, slurmctld and slurmd; prints
#                                                    the SLURM_CONF line to export
#   scripts/slurm/local_cluster.sh stop STATE_DIR    stops the daemons it started
# Needs root. The configuration lives in STATE_DIR; /etc/slurm is not touched.
set -euo pipefail
action=${1:?usage: local_cluster.sh start|stop STATE_DIR}
state=${2:?usage: local_cluster.sh start|stop STATE_DIR}
mkdir -p "$state"
state=$(cd "$state" && pwd)
conf="$state/slurm.conf"

stop() {
    for pidfile in "$state/slurmd.pid" "$state/slurmctld.pid" "$state/munged.pid"; do
        if [ -f "$pidfile" ]; then
            kill "$(cat "$pidfile")" 2>/dev/null || true
            rm -f "$pidfile"
        fi
    done
}

if [ "$action" = stop ]; then
    stop
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "local_cluster: installing slurm-wlm and munge" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge
chown munge:munge /run/munge 2>/dev/null || true
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    if id munge >/dev/null 2>&1; then
        su -s /bin/sh munge -c "/usr/sbin/munged --pid-file=/run/munge/munged.pid" 2>/dev/null || /usr/sbin/munged --force
    else
        /usr/sbin/munged --force
    fi
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    cp /run/munge/munged.pid "$state/munged.pid" 2>/dev/null || pgrep -x munged | head -n1 > "$state/munged.pid"
fi

host=$(hostname -s)
# the processors we may run on; not plain nproc, which obeys OMP_NUM_THREADS / OMP_THREAD_LIMIT
# (=1 for CPU runs made a 1-CPU node; scripts/cluster.sh says more)
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p "$state/ctld" "$state/spool"
cat > "$conf" <<CONF
ClusterName=trainer
SlurmctldHost=$host
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# sbatch refuses at once what the node can never give (else it pends for ever: PartitionConfig)
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
SlurmctldPort=$(( 16817 + RANDOM % 1000 ))
SlurmdPort=$(( 17818 + RANDOM % 1000 ))
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$conf"
/usr/sbin/slurmctld -f "$conf"
/usr/sbin/slurmd -f "$conf"
for _ in $(seq 100); do
    if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
        echo "export SLURM_CONF=$conf"
        exit 0
    fi
    sleep 0.2
done
echo "local_cluster: the node did not become idle; see $state/slurmctld.log and $state/slurmd.log" >&2
sinfo >&2 || true
stop
exit 1
