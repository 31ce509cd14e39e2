#!/usr/bin/env bash
# A one-rank job slowed by extra work beside the daemon on real NVML (issue 32, the
# 1-GPU part): a steady step (bf16 matmuls, then a one-SM spin kernel standing for the
# NCCL wait), then 10 % and 30 % more matmuls per step, then back. OUTDIR gets the job's
# step times (steps.jsonl, phases.jsonl), the daemon's /metrics series of the GPU and
# /status over time (metrics.jsonl, status.jsonl, every 2 s; NVML polled every 2 s) and
# summary.json: per phase the step time against the baseline and the GPU's SM activity
# against what the slowdown detector's model predicts. About 6 minutes. As root, from the
# repository root:
#   bash tests/gpu/slowdown_run.sh OUTDIR            (SLOWDOWN_PHASES=... to change phases)
#   bash tests/gpu/slowdown_run.sh OUTDIR --dry-run  (no GPU: replayed NVML, a sleeping job)
set -u
out=${1:?usage: slowdown_run.sh OUTDIR [--dry-run]}
shift
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
. "$here/carried_site.sh"  # the carried wheels on the path; cd "$repo"
if [ "${1:-}" != --dry-run ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader \
    >"$out/versions.txt" 2>&1
  $py -c "import torch; print('torch', torch.__version__)" >>"$out/versions.txt" 2>&1
fi
exec $py "$here/slowdown_watch.py" "$out" ${SLOWDOWN_PHASES:+--phases "$SLOWDOWN_PHASES"} "$@"
