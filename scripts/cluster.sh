#!/usr/bin/env bash
# A cluster of N nodes on this one Linux machine, for trying multi-node launches and faults
# (docs/cluster.md). Root only. Each node is a network, host-name (UTS) and mount namespace:
#
#   bash scripts/cluster.sh up DIR --nodes N [--link-rate RATE] [--slurm]
#       makes node1..nodeN; prints `export NAME=VALUE` lines to paste (CLUSTER, with --slurm SLURM_CONF):
#       --slurm adds a real Slurm, slurmctld on node1 and a slurmd (and munged) on every node, each
#       node with the machine's processors; sbatch refuses at once a job they can never hold
#   bash scripts/cluster.sh exec DIR NODE -- CMD ...   runs CMD on NODE (its host name, networks, disks)
#                                                      with the caller's environment and directory
#   bash scripts/cluster.sh link DIR NODE down|up      unplugs / plugs NODE's data0 cable at the switch
#   bash scripts/cluster.sh link DIR NODE rate RATE    shapes NODE's data0 both ways (tc syntax: 300mbit;
#                                                      none: unshaped)
#   bash scripts/cluster.sh down DIR                   removes every namespace, link, mount and process
#
# A node has two networks, as real nodes have: mgmt0 (host names, ssh, launcher control) on
# 198.18.K.I/24 and data0 (for the collectives: TRAINER_IFACE=data0) on 198.19.K.I/24, K derived from
# DIR; both bridges live in a switch namespace of their own, so nothing is added to the machine's own
# network. Its own /tmp, /run, /dev/shm, ~/.cache, ~/.horovod, /etc/hosts and /etc/hostname (node-local
# disks are folders under DIR/nodes/NODE); DIR, DIR/shared, this checkout and its .venv at their own
# paths on every node (the shared filesystem); an sshd for root with keys in DIR/ssh.
set -euo pipefail

die() { echo "cluster: $*" >&2; exit 2; }
usage() { die "usage: cluster.sh up DIR --nodes N [--link-rate RATE] [--slurm] | exec DIR NODE -- CMD... | link DIR NODE down|up|rate RATE|none | down DIR"; }

checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
REGISTRY=/run/trainer-cluster       # one folder per running cluster: namespace files, its DIR
SSHD=${TRAINER_SSHD:-/opt/trainer-openssh/usr/sbin/sshd}   # scripts/test.sh unpacks it there

action=${1:-}; [ -n "$action" ] || usage; shift
dir=${1:-}; [ -n "$dir" ] || usage; shift
mkdir -p "$dir" 2>/dev/null || die "cannot make $dir; choose a writable folder"
dir=$(cd "$dir" && pwd -P)
id=$(printf %s "$dir" | sha1sum | cut -c1-6)          # names: tc<id>n<I>, tc<id>sw
octet=$(( 16#$id % 250 + 2 ))                          # addresses 198.18.<octet>.I and 198.19.<octet>.I
run=$REGISTRY/$id
switch=tc${id}sw

node_ns() { echo "tc${id}n${1#node}"; }
node_index() { [[ $1 =~ ^node([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -ge 1 ] && [ "${BASH_REMATCH[1]}" -le "$nodes" ] \
    || die "no node '$1' in the cluster at $dir (node1..node$nodes)"; echo "${BASH_REMATCH[1]}"; }
load() {
    [ -f "$run/dir" ] && [ -f "$dir/cluster.env" ] || die "no cluster is up at $dir; run: bash scripts/cluster.sh up $dir --nodes N"
    # shellcheck source=/dev/null
    . "$dir/cluster.env"
}
in_node() {  # in_node I CMD...: CMD inside node I's namespaces
    local i=$1; shift
    nsenter --net="/run/netns/$(node_ns "$i")" --uts="$run/node$i.uts" --mount="$run/node$i.mnt" -- "$@"
}

shape() {  # shape I RATE: tbf on both ends of node I's data link (tbf shapes what leaves an interface)
    local i=$1 rate=$2
    ip -n "$(node_ns "$i")" link show data0 >/dev/null 2>&1 || die "node$i has no data0"
    tc -n "$(node_ns "$i")" qdisc replace dev data0 root tbf rate "$rate" burst 256kb latency 400ms 2>/dev/null \
        || die "tc refused the rate '$rate'; give it in tc's syntax, e.g. 300mbit"
    tc -n "$switch" qdisc replace dev "d$i" root tbf rate "$rate" burst 256kb latency 400ms
}

down() {
    if [ -d "$run" ]; then
        for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^tc${id}"); do
            # every process of the node (sshd, munged, slurmd and whatever ran there): the netns knows them
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        done
        sleep 0.2
        for f in "$run"/*.uts "$run"/*.mnt; do
            [ -e "$f" ] || continue
            umount "$f" 2>/dev/null || umount -l "$f" 2>/dev/null || true
        done
        umount "$run" 2>/dev/null || umount -l "$run" 2>/dev/null || true
        rm -rf "$run"
    fi
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^tc${id}"); do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
    done
}

case $action in
down)
    [ $# -eq 0 ] || usage
    down
    exit 0
    ;;
exec)
    [ $# -ge 2 ] || usage
    load
    i=$(node_index "$1"); shift
    [ "${1:-}" = -- ] && shift
    [ $# -ge 1 ] || usage
    # the caller's folder when the node has it (the shared paths), else DIR
    # shellcheck disable=SC2016  # the inner shell expands them
    HOSTNAME=node$i exec nsenter --net="/run/netns/$(node_ns "$i")" --uts="$run/node$i.uts" --mount="$run/node$i.mnt" -- \
        /bin/sh -c 'cd "$1" 2>/dev/null || cd "$2"; shift 2; exec "$@"' sh "$PWD" "$dir" "$@"
    ;;
link)
    [ $# -ge 2 ] || usage
    load
    i=$(node_index "$1")
    case $2 in
    down) ip -n "$switch" link set "d$i" down ;;   # the cable at the switch: node2's data0 stays up, no carrier
    up) ip -n "$switch" link set "d$i" up ;;
    rate)
        [ -n "${3:-}" ] || usage
        if [ "$3" = none ]; then  # unshaped again
            tc -n "$(node_ns "$i")" qdisc del dev data0 root 2>/dev/null || true
            tc -n "$switch" qdisc del dev "d$i" root 2>/dev/null || true
        else
            shape "$i" "$3"
        fi ;;
    *) usage ;;
    esac
    exit 0
    ;;
up) ;;
*) usage ;;
esac

# ---- up ----
nodes=0; rate=""; slurm=0
while [ $# -gt 0 ]; do
    case $1 in
    --nodes) nodes=${2:-}; shift 2 ;;
    --link-rate) rate=${2:-}; shift 2 ;;
    --slurm) slurm=1; shift ;;
    *) usage ;;
    esac
done
[[ $nodes =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 64 ] || die "--nodes must be 1..64, not '$nodes'"
[ -z "$rate" ] || [[ $rate =~ ^[0-9]+(\.[0-9]+)?([kmgt]?(bit|bps))$ ]] || die "tc refused the rate '$rate'; give it in tc's syntax, e.g. 300mbit"
[ "$(id -u)" = 0 ] || die "making nodes needs root (network, UTS and mount namespaces); run as root"
for tool in ip nsenter unshare tc ssh ssh-keygen; do
    command -v "$tool" >/dev/null || die "$tool is missing; run: bash scripts/setup.sh"
done
[ -x "$SSHD" ] || die "no sshd at $SSHD; run bash scripts/test.sh as root (its set-up unpacks openssh-server there without starting it)"
if [ -d "$run" ]; then
    die "a cluster is already up at $(cat "$run/dir" 2>/dev/null || echo "$dir"); run: bash scripts/cluster.sh down $dir"
fi
# (another cluster may use the same addresses: each cluster's nodes and switch are namespaces of
# their own, so they never meet; only the names, from DIR's digest, must differ)
probe=tcprobe$$
{ ip netns add "$probe" 2>/dev/null && ip netns del "$probe"; } \
    || die "this machine cannot make network namespaces (ip netns add failed: not root in the machine's own namespace, or a container without CAP_SYS_ADMIN)"
unshare --uts --mount true 2>/dev/null || die "this machine cannot make UTS and mount namespaces (unshare failed)"

# a failed up leaves nothing behind (die has said why; anything else gets a line of its own)
# shellcheck disable=SC2154  # status is the trap's own
trap 'status=$?; [ $status = 0 ] || { [ $status = 2 ] || echo "cluster: up failed; taking down what it made" >&2; down; }; exit $status' EXIT

mkdir -p "$run" "$dir/shared" "$dir/ssh"
# namespace files are bind mounts; their folder must be a private mount
mount --bind "$run" "$run"
mount --make-private "$run"
echo "$dir" > "$run/dir"
cat > "$dir/cluster.env" <<ENV
nodes=$nodes
slurm=$slurm
ENV

# keys: the nodes' host key and root's key, made once per DIR
[ -f "$dir/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -C "cluster $dir" -f "$dir/ssh/id_ed25519"
[ -f "$dir/ssh/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N "" -f "$dir/ssh/ssh_host_ed25519_key"
cp "$dir/ssh/id_ed25519.pub" "$dir/ssh/authorized_keys"
cat > "$dir/ssh/sshd_config" <<CONF
ListenAddress 0.0.0.0
HostKey $dir/ssh/ssh_host_ed25519_key
PidFile /run/sshd.pid
AuthorizedKeysFile $dir/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
MaxStartups 200
MaxSessions 200
LogLevel ERROR
CONF
cat > "$dir/ssh/ssh_config" <<CONF
Host *
    IdentityFile $dir/ssh/id_ed25519
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    BatchMode yes
    ConnectTimeout 10
    LogLevel ERROR
CONF
id sshd >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /run/sshd --shell /usr/sbin/nologin sshd

hosts="127.0.0.1 localhost"$'\n'
for i in $(seq "$nodes"); do
    hosts+="198.18.$octet.$i node$i"$'\n'
done
for i in $(seq "$nodes"); do
    hosts+="198.19.$octet.$i node$i-data"$'\n'
done

# the switch: two bridges in a namespace of their own
ip netns add "$switch"
ip -n "$switch" link set lo up
for bridge in mgmt data; do
    ip -n "$switch" link add "$bridge" type bridge
    ip -n "$switch" link set "$bridge" up
done

# paths every node sees as the machine does, even when they lie under /tmp (which a node has its own of)
shared_paths=("$dir" "$checkout")
[ -e "$checkout/.venv" ] && shared_paths+=("$(cd "$checkout/.venv" && pwd -P)")
mkdir -p /root/.cache /root/.horovod

for i in $(seq "$nodes"); do
    ns=$(node_ns "$i")
    home=$dir/nodes/node$i
    mkdir -p "$home"/{tmp,run,shm,cache,horovod}
    chmod 1777 "$home/tmp"
    printf %s "$hosts" > "$home/hosts"
    echo "node$i" > "$home/hostname"

    ip netns add "$ns"
    ip -n "$ns" link set lo up
    for net in mgmt data; do
        peer=${net:0:1}$i
        ip link add "${net}0" netns "$ns" type veth peer name "$peer" netns "$switch"
        ip -n "$switch" link set "$peer" master "$net"
        ip -n "$switch" link set "$peer" up
    done
    ip -n "$ns" addr add "198.18.$octet.$i/24" dev mgmt0
    ip -n "$ns" addr add "198.19.$octet.$i/24" dev data0
    ip -n "$ns" link set mgmt0 up
    ip -n "$ns" link set data0 up

    touch "$run/node$i.uts" "$run/node$i.mnt"
    # the node's own host name and disks, made once inside its UTS and mount namespaces (kept by the files)
    unshare --uts="$run/node$i.uts" --mount="$run/node$i.mnt" --propagation private -- \
        /bin/bash -s "$i" "$home" "$run/stage$i" "$slurm" "$dir" "${shared_paths[@]}" <<'NODE'
set -euo pipefail
i=$1 home=$2 stage=$3 slurm=$4 dir=$5; shift 5
hostname "node$i"
# keep the shared paths reachable while the node's own /tmp covers the machine's
mkdir -p "$stage"
n=0
for path in "$@"; do
    mkdir -p "$stage/$n"
    mount --bind "$path" "$stage/$n"
    n=$((n + 1))
done
mount --bind "$stage/0/nodes/node$i/tmp" /tmp
n=0
for path in "$@"; do
    mkdir -p "$path"
    mount --bind "$stage/$n" "$path"
    umount "$stage/$n"
    n=$((n + 1))
done
mount --bind "$home/run" /run
mount --bind "$home/shm" /dev/shm
mount --bind "$home/cache" /root/.cache
mount --bind "$home/horovod" /root/.horovod
mount --bind "$home/hosts" /etc/hosts
mount --bind "$home/hostname" /etc/hostname
mount --bind "$dir/ssh/ssh_config" /etc/ssh/ssh_config
mkdir -p /run/sshd
if [ "$slurm" = 1 ]; then
    # slurmd wants a cgroup hierarchy even with proctrack/linuxproc: a private, empty one
    mount -t tmpfs cgroup /sys/fs/cgroup
    mkdir -p /sys/fs/cgroup/systemd
    mount -t cgroup -o ro,none,name=systemd cgroup /sys/fs/cgroup/systemd
fi
NODE
    rmdir "$run/stage$i"/* "$run/stage$i" 2>/dev/null || true
    # sshd daemonizes with its streams on /dev/null: it holds none of up's output
    in_node "$i" "$SSHD" -f "$dir/ssh/sshd_config" -E "$home/sshd.log" </dev/null >/dev/null 2>&1
    [ -z "$rate" ] || shape "$i" "$rate"
done

# ready when every node reaches every other's sshd by name
for i in $(seq "$nodes"); do
    j=$(( i % nodes + 1 ))
    for _ in $(seq 100); do
        in_node "$i" ssh "node$j" true </dev/null >/dev/null 2>&1 && break
        sleep 0.1
    done
    in_node "$i" ssh "node$j" true </dev/null >/dev/null 2>&1 || die "node$i cannot ssh to node$j; see $dir/nodes/node$j/sshd.log"
done

if [ "$slurm" = 1 ]; then
    { command -v slurmctld >/dev/null && command -v munged >/dev/null; } \
        || die "--slurm needs Debian's slurm-wlm and munge; run: bash scripts/slurm/local_cluster.sh (installs them) or apt-get install slurm-wlm munge"
    mkdir -p "$dir/slurm/ctld"
    # one key for every node's munged (each on the socket under its node's own /run)
    [ -s "$dir/slurm/munge.key" ] || dd if=/dev/urandom of="$dir/slurm/munge.key" bs=1 count=1024 status=none
    chmod 400 "$dir/slurm/munge.key"
    # every node gets the processors the caller may run on (its affinity: the daemons and jobs run
    # there). Not plain nproc, which obeys OMP_NUM_THREADS and OMP_THREAD_LIMIT too: with
    # OMP_NUM_THREADS=1 every node had 1 CPU and 2-task-a-node jobs pended forever. Not --all, which
    # counts CPUs a cpuset keeps us off (slurmd accepts fewer CPUs than it finds, never more)
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    cat > "$dir/slurm/slurm.conf" <<CONF
ClusterName=c$id
SlurmctldHost=node1
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# sbatch refuses at once what the nodes can never give (else it pends for ever: PartitionConfig)
EnforcePartLimits=ALL
MpiDefault=none
ReturnToService=2
JobRequeue=1
StateSaveLocation=$dir/slurm/ctld
SlurmdSpoolDir=/run/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$dir/slurm/slurmctld.log
SlurmdLogFile=$dir/nodes/%n/slurmd.log
NodeName=node[1-$nodes] CPUs=$cpus State=UNKNOWN
PartitionName=cluster Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    for i in $(seq "$nodes"); do
        in_node "$i" /bin/sh -c "mkdir -p /run/munge /run/slurmd && /usr/sbin/munged --force --key-file=$dir/slurm/munge.key \
            --log-file=$dir/nodes/node$i/munged.log --seed-file=$dir/nodes/node$i/munged.seed" </dev/null >/dev/null 2>&1 \
            || die "munged did not start on node$i; see $dir/nodes/node$i/munged.log"
    done
    in_node 1 /usr/sbin/slurmctld -f "$dir/slurm/slurm.conf" </dev/null >/dev/null 2>&1 \
        || die "slurmctld did not start; see $dir/slurm/slurmctld.log"
    for i in $(seq "$nodes"); do
        in_node "$i" /usr/sbin/slurmd -f "$dir/slurm/slurm.conf" -N "node$i" </dev/null >/dev/null 2>&1 \
            || die "slurmd did not start on node$i; see $dir/nodes/node$i/slurmd.log"
    done
    for _ in $(seq 300); do
        idle=$(SLURM_CONF=$dir/slurm/slurm.conf in_node 1 sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)' || true)
        [ "$idle" = "$nodes" ] && break
        sleep 0.2
    done
    [ "$idle" = "$nodes" ] || die "only $idle of $nodes slurmd(s) came up; see $dir/slurm/slurmctld.log and $dir/nodes/*/slurmd.log"
fi

echo "export CLUSTER=$(printf %q "$dir")"
[ "$slurm" = 0 ] || echo "export SLURM_CONF=$(printf %q "$dir/slurm/slurm.conf")"
# what a job can ask for: a request beyond it is refused by sbatch at once (EnforcePartLimits=ALL)
[ "$slurm" = 0 ] || echo "# Slurm: node[1-$nodes], $cpus CPU(s) each"
