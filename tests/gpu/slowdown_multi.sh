#!/usr/bin/env bash
# A slowed rank in a 4- or 8-rank NCCL job beside the daemon on real NVML (issue 32, the
# multi-GPU part): the daemon on its defaults, then one rank per GPU (bf16 matmuls, then an
# all_reduce, each step), warm, base, rank R given --extra more matmuls per step, then back,
# then the daemon stopped and started again in alternating windows for its cost to the job.
# OUT gets each rank's step times (steps-rank<R>.jsonl), the phases (phases.jsonl), the
# daemon's alerts, /status slowdowns and series every 2 s (polls.jsonl) and summary.json
# (tests/gpu/slowdown_multi_summary.py). About 18 minutes with the defaults. As root, from
# the repository root:
#   bash tests/gpu/slowdown_multi.sh OUT [--ranks N] [--slow-rank R] [--extra 0.1,0.3]
#   bash tests/gpu/slowdown_multi.sh OUT --dry-run   (no GPU: replayed NVML, sleeping ranks)
set -u
out=${1:?usage: slowdown_multi.sh OUT [--ranks N] [--slow-rank R] [--extra 0.1] [--dry-run]}
shift
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
. "$here/carried_site.sh"  # the carried wheels on the path; cd "$repo"
dry=0
for a in "$@"; do [ "$a" = --dry-run ] && dry=1; done
if [ $dry = 0 ]; then
  nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,clocks.max.sm,power.limit \
    --format=csv,noheader >"$out/versions.txt" 2>&1
  nvidia-smi topo -m >>"$out/versions.txt" 2>&1
  $py -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" \
    >>"$out/versions.txt" 2>&1
fi
exec $py "$here/slowdown_multi.py" "$out" "$@"
