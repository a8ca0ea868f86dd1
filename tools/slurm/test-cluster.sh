#!/usr/bin/env bash
# `make test-cluster`: the smoke grid through a real SLURM (workflow/profiles/slurm) and on this machine
# (workflow/profiles/default); the two must give the same summary.json numbers, run for run.
#
# Starts a single-node cluster with tools/slurm/start-cluster.sh (root; writes /etc/slurm) unless one runs. The runs go
# to $WORK (default /tmp/ief-cluster-test/{local,slurm}); SEEDS (default [0]) picks the seeds of the smoke grid.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${WORK:-/tmp/ief-cluster-test}
SEEDS=${SEEDS:-[0]}
export SLURM_ACCOUNT=${SLURM_ACCOUNT:-ief} SLURM_PARTITION=${SLURM_PARTITION:-debug}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
started=$(date +%s)

if ! sinfo -h >/dev/null 2>&1; then
    bash tools/slurm/start-cluster.sh
fi
echo "==> cluster: $(sinfo -h -N -o '%N %T %c CPUs')"
rm -rf "$WORK"
mkdir -p "$WORK"
common=(--snakefile workflow/Snakefile --directory "$PWD" --config scale=smoke "seeds=$SEEDS")

echo "==> the smoke grid on this machine (workflow/profiles/default)"
t0=$(date +%s)
"$PYTHON" -m snakemake --profile workflow/profiles/default "${common[@]}" "runs=$WORK/local" --quiet rules -- runs
local_s=$(( $(date +%s) - t0 ))

echo "==> the smoke grid through SLURM (workflow/profiles/slurm, account $SLURM_ACCOUNT, no GPU on this node)"
first_job=$(( $(sacct -X -n -a -o JobID --starttime now-1days 2>/dev/null | tail -1 | tr -dc 0-9) + 1 ))
t0=$(date +%s)
"$PYTHON" -m snakemake --profile workflow/profiles/slurm "${common[@]}" "runs=$WORK/slurm" \
    --set-resources train:gpu=0 evaluate:gpu=0 --default-resources "slurm_account=$SLURM_ACCOUNT" \
    "slurm_partition=$SLURM_PARTITION" runtime=15 mem_mb=2000 \
    --slurm-init-seconds-before-status-checks 5 --jobs 4 --quiet rules -- runs
slurm_s=$(( $(date +%s) - t0 ))

echo "==> jobs SLURM ran (sacct):"
sacct -X -a -n -o JobID,JobName%40,State,ExitCode,Elapsed --starttime now-1hours \
    | awk -v first="$first_job" '$1+0 >= first'

echo "==> comparing summary.json, run for run"
"$PYTHON" - "$WORK" <<'EOF'
import json
import sys
from pathlib import Path

work = Path(sys.argv[1])
local = sorted((work / "local").rglob("summary.json"))
assert local, "no local run finished"
keys = ("final_train_loss", "best_validation", "test", "diverged")
bad = []
for path in local:
    twin = work / "slurm" / path.relative_to(work / "local")
    if not twin.exists():
        bad.append(f"{twin}: missing")
        continue
    a, b = json.loads(path.read_text()), json.loads(twin.read_text())
    for key in keys:
        if a.get(key) != b.get(key):
            bad.append(f"{path.relative_to(work / 'local').parent}: {key} differs: {a.get(key)} vs {b.get(key)}")
    run = path.relative_to(work / "local").parent
    print(f"  {str(run):45s} final_train_loss local {a['final_train_loss']!r:>22} slurm {b['final_train_loss']!r:>22}")
if bad:
    print("MISMATCH:\n  " + "\n  ".join(bad))
    sys.exit(1)
print(f"OK: {len(local)} runs, identical final_train_loss, best validation and test metrics")
EOF
echo "==> test-cluster passed: local grid ${local_s} s, SLURM grid ${slurm_s} s, total $(( $(date +%s) - started )) s"
