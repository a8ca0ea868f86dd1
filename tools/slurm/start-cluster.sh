#!/usr/bin/env bash
# A real single-node SLURM cluster on localhost, for `make test-cluster` (tools/slurm/test-cluster.sh).
#
# Debian's packages (installed here when missing: slurm-wlm slurmdbd slurm-client munge mariadb-server), started by
# hand without systemd: munged, mariadbd (accounting database), slurmdbd (sacct, which the Snakemake plugin uses to
# track jobs), slurmctld and `slurmd -N localhost`. No cgroups: ProctrackType=proctrack/linuxproc,
# TaskPlugin=task/none. Needs root, and writes /etc/slurm/{slurm,slurmdbd}.conf: run it on a CI runner or a
# throw-away machine, not on a machine that already has SLURM. State and logs go to $STATE (default /tmp/ief-slurm).
# Stop it with tools/slurm/stop-cluster.sh.
set -euo pipefail
STATE=${STATE:-/tmp/ief-slurm}
CLUSTER=ief
ACCOUNT=${SLURM_ACCOUNT:-ief}

if [[ $(id -u) -ne 0 ]]; then
    echo "start-cluster.sh: needs root (it starts munged, mariadbd and the SLURM daemons)" >&2
    exit 2
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v mariadbd >/dev/null; then
    echo "==> installing SLURM, munge and MariaDB from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurm-wlm slurmdbd slurm-client munge mariadb-server >/dev/null
fi
if pgrep -x slurmctld >/dev/null; then
    echo "start-cluster.sh: slurmctld already runs (stop it with tools/slurm/stop-cluster.sh)" >&2
    exit 2
fi

mkdir -p "$STATE"/{log,spool/slurmd,spool/slurmctld} /run/munge /run/mysqld /run/slurm /var/log/mysql
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld /var/log/mysql

# munge: the key Debian's package made (or a new one)
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

# MariaDB for accounting (slurmdbd wants innodb_buffer_pool_size >= 512M)
if [[ ! -d /var/lib/mysql/mysql ]]; then
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$STATE/log/mariadb-install.log" 2>&1
fi
if ! pgrep -x mariadbd >/dev/null; then
    mariadbd --user=mysql --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
        --innodb_buffer_pool_size=512M --innodb_lock_wait_timeout=900 --skip-networking=0 \
        --bind-address=127.0.0.1 >"$STATE/log/mariadb.log" 2>&1 &
fi
for _ in $(seq 60); do
    mariadb -u root -e "select 1" >/dev/null 2>&1 && break
    sleep 0.5
done
mariadb -u root <<'SQL'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL

NODE=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
DebugLevel=info
LogFile=$STATE/log/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
chmod 600 /etc/slurm/slurmdbd.conf

cat >/etc/slurm/slurm.conf <<EOF
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageEnforce=associations
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
StateSaveLocation=$STATE/spool/slurmctld
SlurmdSpoolDir=$STATE/spool/slurmd
MpiDefault=none
NodeName=localhost $NODE State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

slurmdbd
for _ in $(seq 60); do
    sacctmgr -n list cluster >/dev/null 2>&1 && break
    sleep 0.5
done
sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description=ief organization=ief >/dev/null 2>&1 || true
sacctmgr -i add user root account="$ACCOUNT" cluster="$CLUSTER" >/dev/null 2>&1 || true

slurmctld
slurmd -N localhost
for _ in $(seq 60); do
    state=$(sinfo -h -N -o '%T' 2>/dev/null | head -1)
    [[ $state == idle* || $state == mixed* ]] && break
    sleep 0.5
done
echo "==> SLURM cluster '$CLUSTER' up on localhost: $(sinfo -h -N -o '%N %T %c CPUs %m MB')"
echo "    account: $ACCOUNT; logs: $STATE/log"
