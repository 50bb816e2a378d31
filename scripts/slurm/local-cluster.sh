#!/usr/bin/env bash
# A real single-node Slurm on this machine (as root, no systemd), for the sbatch tests and for trying
# `nanodist sbatch` locally: `scripts/slurm/local-cluster.sh start | stop`.
# Packages: slurmctld slurmd slurm-client munge libpmix-dev (scripts/setup.sh installs them).
set -euo pipefail
cmd=${1:-start}

stop() {
    scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    # A pid file can outlive its daemon (a machine image, a container restarted): its number may now
    # belong to any process, the caller's shell included, so only a process of that name is stopped.
    local daemon pid
    for daemon in slurmd slurmctld; do
        pid=$(cat "/run/$daemon.pid" 2>/dev/null || true)
        if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$daemon" ]; then
            kill "$pid" 2>/dev/null || true
        fi
        rm -f "/run/$daemon.pid"
    done
    pkill -x slurmstepd 2>/dev/null || true
}

if [ "$cmd" = stop ]; then
    stop
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "local-cluster.sh: must run as root (it starts munged, slurmctld and slurmd)" >&2
    exit 2
fi
for exe in slurmctld slurmd sinfo munged; do
    command -v "$exe" >/dev/null || [ -x "/usr/sbin/$exe" ] || {
        echo "local-cluster.sh: $exe is missing; run scripts/setup.sh (Debian: slurmctld slurmd slurm-client munge)" >&2
        exit 2
    }
done
if sinfo -h -N -o %T 2>/dev/null | grep -qx idle; then
    echo "Slurm already up: $(sinfo -h -N -o '%N %T %c CPUs')"
    exit 0
fi
stop

install -d -o munge -g munge -m 0755 /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
install -d -o slurm -g slurm /var/spool/slurmctld /var/log/slurm
install -d /var/spool/slurmd

# The node claims 4 CPUs (config_overrides) so that 4-rank jobs fit on a 2-core machine.
mem=$(/usr/sbin/slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
mem=$(( ${mem:-2000} * 9 / 10 ))
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=localcluster
SlurmctldHost=localhost
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=5
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
MinJobAge=600
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=$mem
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

/usr/sbin/slurmctld -c
/usr/sbin/slurmd -N localhost
# The controller and munge before the jobs: on a 2-core machine a job's busy MPI ranks otherwise starve
# them, and sbatch, scancel and signals wait for seconds to minutes (slurmd is left alone: the tasks
# inherit its priority).
for daemon in slurmctld munged; do
    renice -n -10 -p $(pgrep -x "$daemon") >/dev/null 2>&1 || true
done
for _ in $(seq 1 150); do
    if [ "$(sinfo -h -N -o %T 2>/dev/null)" = idle ]; then
        echo "Slurm up: $(sinfo -h -N -o '%N %T %c CPUs')"
        exit 0
    fi
    sleep 0.2
done
echo "local-cluster.sh: the node did not become idle; see /var/log/slurm/" >&2
sinfo -N -l >&2 || true
exit 1
