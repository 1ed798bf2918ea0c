#!/usr/bin/env bash
# A real single-node Slurm on localhost, for CI and laptops: slurmctld + slurmd from Debian's
# slurm-wlm, no munge (auth/none), and job accounting (slurmdbd on a private MariaDB) so `sacct`
# works; state, database and logs under one directory.
#
#   bash tools/slurm_local.sh install   # apt-get install slurm-wlm slurmdbd mariadb-server (root)
#   bash tools/slurm_local.sh start     # write $RFT_SLURM_DIR/*.conf, start the daemons
#   bash tools/slurm_local.sh stop      # cancel its jobs, stop its daemons and job steps: only
#                                       # those of this $RFT_SLURM_DIR, another instance runs on
#   bash tools/slurm_local.sh lose-node K   # (RFT_SLURM_NODES > 1) kill every process of node K
#                                       # at once, as a crash; `start` brings it back
#   bash tools/slurm_local.sh cut-node K    # set node K's link down (a network partition: its
#                                       # processes live on); `start` brings the link back up
#   export SLURM_CONF=$RFT_SLURM_DIR/slurm.conf   # what sbatch/srun/squeue/sacct need to find it
#
# Ports (override for a second instance): RFT_SLURMCTLD_PORT 6817, RFT_SLURMD_PORT 6818,
# RFT_SLURMDBD_PORT 6819, RFT_SLURM_DB_PORT 3307 (MariaDB, 127.0.0.1 only); with accounting, a second
# instance also needs its own RFT_SLURM_CLUSTER name (default rftlocal).
# RFT_SLURM_ACCOUNTING=0 starts without slurmdbd/MariaDB (sacct then says accounting is off).
#
# RFT_SLURM_DIR defaults to /tmp/rft-slurm. The node advertises RFT_SLURM_CPUS CPUs (default: this
# machine's count, at least 4, so a 2-task job and a 2-job array fit; slurmd is told to accept
# the difference) and one partition, `debug`. RFT_SLURM_GPUS=N (default 0) also gives it N GPUs
# (gres/gpu on stand-in device files: no real GPU), for sinfo %G and --gpus-per-node jobs.
# RFT_SLURM_KILL_WAIT (default 5) is KillWait, the seconds from a cancel's SIGTERM to its SIGKILL;
# RFT_SLURM_GRACE_TIME (default 0) the partition's GraceTime for preempted jobs.
#
# RFT_SLURM_NODES=N (N > 1, root): N nodes on this machine, each a network namespace of its own
# (rft-<name>-nodeK) joined to a bridge by a veth pair: node K has address $RFT_SLURM_NET.(10+K)
# (RFT_SLURM_NET defaults to 10.213.0; the bridge holds .1, where slurmctld listens) and its own
# hostname (a UTS namespace), and runs its own slurmd. Jobs, srun steps and every rank then see
# their node's address and name, as on a cluster; the filesystem is the host's, shared by all,
# except $RFT_SLURM_DIR/local: each node's own scratch (a tmpfs in the node's mount namespace).
# Node names are not added to /etc/hosts (on clusters they often resolve to another network).
# Each node advertises RFT_SLURM_CPUS CPUs (default: this machine's count over N, at least 4).
# `start` again brings back a node whose slurmd is gone (a node lost, then rebooted). `stop` also
# removes the namespaces, links and bridge. Without root or network namespaces,
# `start` exits with status 3 and says why.
set -euo pipefail
DIR=${RFT_SLURM_DIR:-/tmp/rft-slurm}
CPUS=${RFT_SLURM_CPUS:-$(( $(nproc) > 4 ? $(nproc) : 4 ))}
DBD_PORT=${RFT_SLURMDBD_PORT:-6819}
DB_PORT=${RFT_SLURM_DB_PORT:-3307}
ACCOUNTING=${RFT_SLURM_ACCOUNTING:-1}
GPUS=${RFT_SLURM_GPUS:-0}
NODES=${RFT_SLURM_NODES:-1}
CLUSTER=${RFT_SLURM_CLUSTER:-rftlocal}  # its name in slurmdbd: a second instance with accounting needs its own
NET=${RFT_SLURM_NET:-10.213.0}
# namespaces, links and the bridge carry this instance's name, so a second instance keeps its own
TAG=$(basename "$DIR" | tr -cd 'a-z0-9' | tail -c 6)
BRIDGE=rftbr-$TAG
case $NODES in ''|*[!0-9]*|0) echo "RFT_SLURM_NODES must be a number of 1 or more, not '$NODES'" >&2; exit 1;; esac
if [ "$NODES" -gt 1 ]; then
    CPUS=${RFT_SLURM_CPUS:-$(( $(nproc) / NODES > 4 ? $(nproc) / NODES : 4 ))}
fi

installed() {
    command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v ip >/dev/null \
        && { [ "$ACCOUNTING" != 1 ] || { command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null; }; }
}

install() {
    local want="slurm-wlm iproute2"  # iproute2: `ip`, for the nodes of RFT_SLURM_NODES > 1
    if [ "$ACCOUNTING" = 1 ]; then want="$want slurmdbd mariadb-server"; fi
    # one install at a time: two test workers start Slurm instances of their own side by side, and a
    # second apt-get fails on dpkg's lock instead of waiting for it (or starts a half-installed Slurm)
    exec 9>"${TMPDIR:-/tmp}/rft-slurm-install.lock"
    flock 9
    if installed; then return; fi
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    apt-get install -y -q $want >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q $want >/dev/null; }
}

wait_for() {  # wait_for <what> <log> <command...>: up to 30 s
    local what=$1 log=$2; shift 2
    for _ in $(seq 150); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    echo "$what did not come up; see $log" >&2; exit 1
}

start_accounting() {
    # a private MariaDB (TCP on 127.0.0.1 only: slurmdbd 22.05 has no socket option)
    if [ ! -d "$DIR/mysql/mysql" ]; then
        mariadb-install-db --no-defaults --user="$(id -un)" --datadir="$DIR/mysql" \
            --auth-root-authentication-method=normal >"$DIR/log/mariadb-install.log" 2>&1 \
            || { echo "mariadb-install-db failed; see $DIR/log/mariadb-install.log" >&2; exit 1; }
    fi
    if ! mariadb-admin --no-defaults -S "$DIR/mysql.sock" -u root ping >/dev/null 2>&1; then
        setsid mariadbd --no-defaults --user="$(id -un)" --datadir="$DIR/mysql" --socket="$DIR/mysql.sock" \
            --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/mariadb.pid" \
            --log-error="$DIR/log/mariadb.log" </dev/null >/dev/null 2>&1 &
        wait_for MariaDB "$DIR/log/mariadb.log" mariadb-admin --no-defaults -S "$DIR/mysql.sock" -u root ping
    fi
    mariadb --no-defaults -S "$DIR/mysql.sock" -u root -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'rft';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    printf '%s\n' "AuthType=auth/none" "DbdHost=localhost" "DbdPort=$DBD_PORT" "SlurmUser=$(id -un)" \
        "PidFile=$DIR/slurmdbd.pid" "LogFile=$DIR/log/slurmdbd.log" "StorageType=accounting_storage/mysql" \
        "StorageHost=127.0.0.1" "StoragePort=$DB_PORT" "StorageUser=slurm" "StoragePass=rft" \
        "StorageLoc=slurm_acct_db" > "$DIR/slurmdbd.conf"
    chmod 600 "$DIR/slurmdbd.conf"  # slurmdbd refuses a readable file that holds a password
    # slurmdbd takes no config path: it reads slurmdbd.conf beside $SLURM_CONF
    if ! { [ -f "$DIR/slurmdbd.pid" ] && kill -0 "$(cat "$DIR/slurmdbd.pid")" 2>/dev/null; }; then slurmdbd; fi
    wait_for slurmdbd "$DIR/log/slurmdbd.log" sacctmgr -n list cluster
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

start() {
    if [ "$NODES" -gt 1 ]; then can_make_nodes; fi
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    local mem; mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    # RFT_SLURM_GPUS: GresTypes and Gres= on the node line, or nothing at all (the default config
    # stays as it was), and gres.conf beside slurm.conf (slurmd reads it there). slurmd drops a
    # gpu without File=, so each names a stand-in for /dev/null here (a character device, so that
    # jobs get CUDA_VISIBLE_DEVICES as on a GPU node; a plain file if mknod is denied: none then)
    local gres_types="" node_gres="" i gres_nodes=localhost
    if [ "$NODES" -gt 1 ]; then gres_nodes="node[1-$NODES]"; fi
    case $GPUS in ''|*[!0-9]*) echo "RFT_SLURM_GPUS must be a number, not '$GPUS'" >&2; exit 1;; esac
    rm -rf "$DIR/gres.conf" "$DIR/gpu"
    if [ "$GPUS" -gt 0 ]; then
        gres_types=$'GresTypes=gpu\n' node_gres=" Gres=gpu:$GPUS"
        mkdir "$DIR/gpu"
        echo "AutoDetect=off" > "$DIR/gres.conf"
        for (( i = 0; i < GPUS; i++ )); do
            mknod "$DIR/gpu/gpu$i" c 1 3 2>/dev/null || : > "$DIR/gpu/gpu$i"
            echo "NodeName=$gres_nodes Name=gpu File=$DIR/gpu/gpu$i" >> "$DIR/gres.conf"
        done
    fi
    local ctld_host=localhost node_lines partition_nodes=localhost pid_file=$DIR/slurmd.pid
    local spool=$DIR/spool log_file=$DIR/log/slurmd.log
    node_lines="NodeName=localhost NodeHostname=localhost CPUs=$CPUS RealMemory=$mem$node_gres State=UNKNOWN"
    if [ "$NODES" -gt 1 ]; then
        # slurmctld accepts only its host's own name, given the bridge address the nodes reach;
        # per-node pid, spool and log files (one shared pid file: each slurmd stops the one before)
        ctld_host="$(hostname)($NET.1)" partition_nodes="node[1-$NODES]" node_lines=""
        pid_file=$DIR/slurmd-%n.pid spool=$DIR/spool-%n log_file=$DIR/log/slurmd-%n.log
        for (( i = 1; i <= NODES; i++ )); do
            node_lines+="NodeName=node$i NodeAddr=$NET.$(( 10 + i )) NodeHostname=node$i CPUs=$CPUS RealMemory=$(( mem / NODES ))$node_gres State=UNKNOWN"$'\n'
        done
    fi
    cat > "$DIR/slurm.conf" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$ctld_host
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPort=${RFT_SLURMCTLD_PORT:-6817}
SlurmdPort=${RFT_SLURMD_PORT:-6818}
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$pid_file
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$log_file
JobAcctGatherType=jobacct_gather/none
$(if [ "$ACCOUNTING" = 1 ]; then
    printf 'AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\nAccountingStoragePort=%s\n' "$DBD_PORT"
  else
    echo "AccountingStorageType=accounting_storage/none"
  fi)
JobCompType=jobcomp/none
KillWait=${RFT_SLURM_KILL_WAIT:-5}
# a requeued job may start again after the credential lifetime (default 120 s); tests requeue
AuthInfo=cred_expire=10
# and is started by the next scheduling pass once eligible: by default the main loop runs every 60 s
# and backfill every 30 s (a requeued job waited 35 s after its credential expired, seen)
SchedulerParameters=sched_interval=1,bf_interval=1
MinJobAge=300
${gres_types}${node_lines}
PartitionName=debug Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP GraceTime=${RFT_SLURM_GRACE_TIME:-0}
EOF
    export SLURM_CONF="$DIR/slurm.conf"
    if [ "$ACCOUNTING" = 1 ]; then start_accounting; fi
    any_ours slurmctld || slurmctld -f "$SLURM_CONF"  # start again: brings back a lost node's slurmd
    if [ "$NODES" -gt 1 ]; then
        start_nodes
    else
        slurmd -f "$SLURM_CONF" -N localhost
    fi
    for _ in $(seq 100); do
        if [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated|completing)')" -ge "$NODES" ]; then
            echo "Slurm is up ($NODES node(s)): export SLURM_CONF=$SLURM_CONF"; return; fi
        sleep 0.2
    done
    echo "Slurm did not come up; logs in $DIR/log" >&2; exit 1
}

can_make_nodes() {  # root and network namespaces, or say why not (exit 3: tests skip on it)
    if [ "$(id -u)" != 0 ]; then echo "RFT_SLURM_NODES=$NODES needs root (network namespaces, a bridge)" >&2; exit 3; fi
    if ! command -v ip >/dev/null || ! command -v nsenter >/dev/null; then
        echo "RFT_SLURM_NODES=$NODES needs ip (iproute2) and nsenter (util-linux): bash tools/slurm_local.sh install" >&2
        exit 3
    fi
    if ! ip netns add "rft-$TAG-probe" 2>/dev/null; then
        echo "RFT_SLURM_NODES=$NODES: this machine does not allow network namespaces (ip netns add failed)" >&2; exit 3
    fi
    ip netns del "rft-$TAG-probe"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        if ! ip link add "$BRIDGE" type bridge 2>/dev/null; then
            echo "RFT_SLURM_NODES=$NODES: this machine cannot make a network bridge (ip link add type bridge failed)" >&2
            exit 3
        fi
        ip link del "$BRIDGE"
    fi
}

start_nodes() {  # a bridge on $NET.1, node K in namespace rft-$TAG-nodeK at $NET.(10+K), its slurmd
    local i ns
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for (( i = 1; i <= NODES; i++ )); do
        ns=rft-$TAG-node$i
        ip netns list | grep -qw "$ns" || ip netns add "$ns"
        if ! ip link show "rft$TAG$i" >/dev/null 2>&1; then
            ip link add "rft$TAG$i" type veth peer name eth0 netns "$ns"
        fi
        ip link set "rft$TAG$i" master "$BRIDGE" up
        ip -n "$ns" addr replace "$NET.$(( 10 + i ))/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        ip -n "$ns" route replace default via "$NET.1"
        if slurmd_running "node$i"; then continue; fi
        # nsenter, not `ip netns exec`: that remounts /sys and slurmd then finds no cgroup fs.
        # A UTS namespace gives the node its own hostname.
        # A mount namespace gives it a node-local scratch at $DIR/local: the same path on every
        # node, each node's own tmpfs there (as /tmp or a local disk is on a cluster).
        mkdir -p "$DIR/local"
        nsenter --net="/var/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
            "hostname node$i && mount -t tmpfs -o size=64m rft-node$i-local '$DIR/local' && exec slurmd -f '$SLURM_CONF' -N node$i"
    done
}

slurmd_running() {  # slurmd_running <node>: this instance's slurmd of that node is up
    local pid
    pid=$(cat "$DIR/slurmd-$1.pid" 2>/dev/null) || return 1
    grep -qsxzF "SLURM_CONF=$DIR/slurm.conf" "/proc/$pid/environ"
}

lose_node() {  # lose_node <K>: every process of node K killed at once, as when the node crashes
    local pids
    pids=$(ip netns pids "rft-$TAG-node$1" 2>/dev/null) || { echo "no node $1 here" >&2; exit 1; }
    # shellcheck disable=SC2086
    if [ -n "$pids" ]; then kill -KILL $pids; fi
}

cut_node() {  # cut_node <K>: node K's link to the bridge down, as a partition; its processes live on
    ip link set "rft$TAG$1" down 2>/dev/null || { echo "no node $1 here" >&2; exit 1; }
}

stop_nodes() {  # what runs in the namespaces, then the namespaces, links and bridge
    local ns pids
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^rft-$TAG-node" || true); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        # shellcheck disable=SC2086
        if [ -n "$pids" ]; then kill -KILL $pids 2>/dev/null || true; fi
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

ours() {  # ours <process name>: pids of those started for this $DIR, found by their environment.
    # start exports SLURM_CONF=$DIR/slurm.conf before launching every daemon, and slurmd passes it
    # on to slurmstepd. Nothing else safely tells them apart from another instance's on the same
    # machine (a second RFT_SLURM_DIR, e.g. someone else's tests): a stepd is re-parented to init
    # and named "slurmstepd: [job.step]", slurmdbd's command line names no config, and a pid file
    # left by a crash may name a pid since reused by anyone.
    local p
    for p in $(pgrep -x "$1"); do  # (a zombie has no environment left: not counted)
        grep -qsxzF "SLURM_CONF=$DIR/slurm.conf" "/proc/$p/environ" && echo "$p"
    done
    return 0
}

any_ours() {  # any_ours <process name>...: is one of ours still running?
    local name
    for name in "$@"; do [ -n "$(ours "$name")" ] && return 0; done
    return 1
}

signal_ours() {  # signal_ours <signal> <process name>...
    local sig=$1 name pids; shift
    for name in "$@"; do
        pids=$(ours "$name")
        # shellcheck disable=SC2086
        if [ -n "$pids" ]; then kill "-$sig" $pids 2>/dev/null || true; fi
    done
}

wait_gone() {  # wait_gone <process name>...: up to 5 s; fails if one of ours is still there
    for _ in $(seq 25); do any_ours "$@" || return 0; sleep 0.2; done
    return 1
}

cancel_jobs() {  # while slurmctld answers: cancel this cluster's jobs and wait (KillWait 5 s) for
    # their steps to end the jobs' processes; a stepd killed instead would leave them orphaned
    local jobs
    any_ours slurmctld || return 0  # (squeue would retry an absent controller for 10 s)
    export SLURM_CONF="$DIR/slurm.conf"
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null) || return 0
    if [ -z "$jobs" ]; then return 0; fi
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null || true
    for _ in $(seq 50); do
        [ -z "$(timeout 10 squeue -h -o %A 2>/dev/null)" ] && return 0
        sleep 0.2
    done
}

stop_slurm() {
    if [ -f "$DIR/slurm.conf" ]; then cancel_jobs; fi
    # SIGTERM to slurmstepd too: a step cancelled just before the controller stopped keeps
    # retrying to report to it and holds slurmd, ignoring SIGTERM; then SIGKILL after 5 s
    signal_ours TERM slurmd slurmctld slurmstepd
    wait_gone slurmd slurmctld slurmstepd || signal_ours KILL slurmd slurmctld slurmstepd
}

stop_accounting() {  # after slurmctld, which reports to slurmdbd until it stops
    signal_ours TERM slurmdbd
    if [ -S "$DIR/mysql.sock" ]; then  # a clean shutdown, so the next start needs no recovery
        mariadb-admin --no-defaults -S "$DIR/mysql.sock" -u root shutdown 2>/dev/null || true
    fi
    wait_gone slurmdbd mariadbd || { signal_ours TERM mariadbd; wait_gone slurmdbd mariadbd; } \
        || signal_ours KILL slurmdbd mariadbd
}

stop() {
    stop_slurm
    stop_accounting
    if [ "$NODES" -gt 1 ]; then stop_nodes; fi
}

case ${1:-start} in
    lose-node) lose_node "${2:?lose-node needs a node number}";;
    cut-node) cut_node "${2:?cut-node needs a node number}";;
    *) "${1:-start}";;
esac
