#!/usr/bin/env bash
# Stop what tools/slurm/start-cluster.sh started, each daemon by its pid file or exact name.
set -uo pipefail
for pidfile in /run/slurm/slurmd.pid /run/slurm/slurmctld.pid /run/slurm/slurmdbd.pid; do
    [[ -s $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null
done
sleep 1
for daemon in slurmd slurmctld slurmdbd; do
    pid=$(pgrep -x "$daemon") && kill $pid 2>/dev/null
done
[[ -s /run/mysqld/mysqld.pid ]] && kill "$(cat /run/mysqld/mysqld.pid)" 2>/dev/null
pid=$(pgrep -x mariadbd) && kill $pid 2>/dev/null
[[ -s /run/munge/munged.pid ]] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null
for _ in $(seq 60); do  # wait until every daemon has exited (slurmdbd and mariadbd take a few seconds)
    running=$(for d in slurmd slurmctld slurmdbd munged mariadbd; do pgrep -x "$d" >/dev/null && echo "$d"; done)
    [[ -z $running ]] && break
    sleep 0.5
done
if [[ -n $running ]]; then
    echo "==> still running after 30 s: $running" >&2
    exit 1
fi
echo "==> SLURM test cluster stopped"
