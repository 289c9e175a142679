#!/usr/bin/env bash
# A one-machine SLURM cluster for the tests: Debian's munge, slurmctld and slurmd, on 127.0.0.1, with
# one partition `cpu` of two CPUs (one job of two tasks). Its configuration, state, logs and ports
# (16817, 16818) are its own, under $LIT_IMAGENET_SLURM_DIR (default /var/tmp/lit_imagenet_slurm), so
# that it leaves any other SLURM or munge installation alone.
#
#   bash tests/local_slurm.sh     # prints the configuration's path: export SLURM_CONF=<it> to use it
#
# Installs the packages with apt-get when they are missing, and starts what is not running; a second
# call finds the cluster up and only prints the path. Exit status 77, with one line on stderr saying
# why, where SLURM cannot be started here (not root, no apt-get); any other failure is status 1 with
# the daemons' log lines.
set -euo pipefail

dir=${LIT_IMAGENET_SLURM_DIR:-/var/tmp/lit_imagenet_slurm}
conf=$dir/slurm.conf
socket=$dir/munge/munge.socket
host=$(hostname -s)
export SLURM_CONF=$conf

cannot() {
    echo "$*" >&2
    exit 77
}

fail() {
    echo "error: $*" >&2
    for log in "$dir"/munge/munged.log "$dir"/slurmctld.log "$dir"/slurmd.log "$dir"/apt.log; do
        [ -f "$log" ] && { echo "--- $log" >&2; tail -n 15 "$log" >&2; }
    done
    exit 1
}

# The configuration, written anew whenever the daemons are (re)started.
config() {
    cat <<EOF
# Written by tests/local_slurm.sh: one machine, reached on 127.0.0.1.
ClusterName=lit-imagenet
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (120 s by default).
AuthInfo=socket=$socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
# debug2 logs the controller's time-limit checks (every 30 s), which the tests read.
SlurmctldDebug=debug2
SlurmdDebug=info
MailProg=/bin/true
# Neither cgroups nor systemd: processes are tracked by their parents, tasks are not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
KillWait=15
# Two CPUs whatever the machine has: the node is not drained for having fewer.
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

up() {  # running, with this configuration
    [ -f "$conf" ] && [ "$(config)" = "$(cat "$conf")" ] && scontrol ping 2>/dev/null | grep -q "is UP" \
        && sinfo -h -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated|completing)'
}

if command -v scontrol >/dev/null && up; then
    echo "$conf"
    exit 0
fi

[ "$(id -u)" = 0 ] || cannot "a local SLURM cluster needs root to install and start its daemons (this is uid $(id -u))"

if ! command -v munged >/dev/null || ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sbatch >/dev/null; then
    command -v apt-get >/dev/null \
        || cannot "SLURM is not installed and there is no apt-get to install Debian's slurmctld, slurmd and munge"
    mkdir -p "$dir"
    # Debian's packages also start the daemons under systemd, with the distribution's configuration;
    # they are not used here.
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        munge slurmctld slurmd slurm-client; } >"$dir/apt.log" 2>&1 \
        || fail "apt-get could not install munge, slurmctld, slurmd and slurm-client (see $dir/apt.log)"
fi

mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
chmod 755 "$dir" "$dir/munge"  # munged refuses a socket folder that others cannot search
if [ ! -s "$dir/munge/munge.key" ]; then
    head -c 1024 /dev/urandom >"$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
fi
if ! munge -n -S "$socket" 2>/dev/null | unmunge -S "$socket" >/dev/null 2>&1; then
    munged --force --socket="$socket" --key-file="$dir/munge/munge.key" --log-file="$dir/munge/munged.log" \
        --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/munged.seed" || fail "munged did not start"
fi

# Daemons of an earlier start that no longer answer, or have another configuration: stop them, by their
# own pid files.
for daemon in slurmctld slurmd; do
    pid=$(cat "$dir/$daemon.pid" 2>/dev/null || true)
    if [ -n "$pid" ] && grep -qs "$daemon" "/proc/$pid/cmdline"; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
    fi
done

# Each start logs to new files: the tests read the controller's log, which must be this controller's alone.
for log in slurmctld.log slurmd.log; do
    if [ -f "$dir/$log" ]; then mv -f "$dir/$log" "$dir/$log.1"; fi
done
config >"$conf"

slurmctld -c -f "$conf" || fail "slurmctld did not start"
slurmd -f "$conf" || fail "slurmd did not start"
for _ in $(seq 150); do
    if scontrol ping 2>/dev/null | grep -q "is UP"; then
        state=$(sinfo -h -o %T 2>/dev/null || true)
        case $state in
            idle* | mixed* | allocated*) echo "$conf"; exit 0 ;;
            down* | drain*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
        esac
    fi
    sleep 0.2
done
fail "the SLURM node did not come up within 30 s"
