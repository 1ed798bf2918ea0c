#!/usr/bin/env bash
# A real single-node Slurm on localhost, for CI and laptops: slurmctld + slurmd from Debian's
# slurm-wlm, no munge (auth/none), state and logs under one directory.
#
#   bash tools/slurm_local.sh install   # apt-get install slurm-wlm (root) if sbatch is missing
#   bash tools/slurm_local.sh start     # write $RFT_SLURM_DIR/slurm.conf, start both daemons
#   bash tools/slurm_local.sh stop      # stop them by their pid files
#   export SLURM_CONF=$RFT_SLURM_DIR/slurm.conf   # what sbatch/srun/squeue need to find it
#
# RFT_SLURM_DIR defaults to /tmp/rft-slurm. The node advertises RFT_SLURM_CPUS CPUs (default: this
# machine's count, at least 4, so a 2-task job and a 2-job array fit; slurmd is told to accept
# the difference) and one partition, `debug`.
set -euo pipefail
DIR=${RFT_SLURM_DIR:-/tmp/rft-slurm}
CPUS=${RFT_SLURM_CPUS:-$(( $(nproc) > 4 ? $(nproc) : 4 ))}

install() {
    if command -v sbatch >/dev/null && command -v slurmctld >/dev/null; then return; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm >/dev/null; }
}

start() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    local mem; mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    cat > "$DIR/slurm.conf" <<EOF
ClusterName=rftlocal
SlurmctldHost=localhost
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
SlurmdPidFile=$DIR/slurmd.pid
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait=5
MinJobAge=300
NodeName=localhost NodeHostname=localhost CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$DIR/slurm.conf"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N localhost
    for _ in $(seq 100); do
        if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "Slurm is up: export SLURM_CONF=$SLURM_CONF"; return; fi
        sleep 0.2
    done
    echo "Slurm did not come up; logs in $DIR/log" >&2; exit 1
}

stop() {
    for daemon in slurmd slurmctld; do
        if [ -f "$DIR/$daemon.pid" ]; then kill "$(cat "$DIR/$daemon.pid")" 2>/dev/null || true; fi
        # slurmd drops its pid file before it exits; find it by its config too
        pkill -f "^$daemon -f $DIR/slurm.conf" 2>/dev/null || true
    done
    # a step cancelled just before the controller stopped keeps retrying to report to it and
    # holds slurmd, ignoring SIGTERM; on this single-node test cluster every step is ours
    pkill -f '^slurmstepd:' 2>/dev/null || true
    for _ in $(seq 25); do
        pgrep -f "^slurm(d|ctld) -f $DIR/slurm.conf|^slurmstepd:" >/dev/null || return 0
        sleep 0.2
    done
    pkill -9 -f "^slurm(d|ctld) -f $DIR/slurm.conf|^slurmstepd:" 2>/dev/null || true
}

"${1:-start}"
