#!/bin/bash
# The progress detector against a real 2-rank NCCL job, default daemon config:
#   OUT=dir bash tests/gpu/hang_progress_run.sh deadpeer|unbalanced|checkpoint [SETTLE_S]
# Starts `gpuwatchd run`, the job (hang_progress_job.py), lets it run SETTLE_S (75: past
# the RAS grace), makes the fault (SIGKILL of rank 1, or the job's FLAG), then polls
# /hangs every second and prints how long the daemon took, its verdict and signals.
set -u
mode=$1; settle=${2:-75}
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/hang-progress}; mkdir -p "$OUT"
export PYTHONPATH=$here/../..:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
st=/tmp/gw-$mode; rm -rf $st; mkdir -p $st
printf 'sources:\n  udev:\n    enabled: false\n' > $st/config.yaml
python3 -m gpuwatchd run --config $st/config.yaml --listen 127.0.0.1:10370 --state-dir $st > $OUT/daemon-$mode.log 2>&1 &
dpid=$!
sleep 3
flag=/tmp/flag-$mode; rm -f $flag
port=$((29500 + RANDOM % 400))
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r \
    python3 $here/hang_progress_job.py $mode $flag > $OUT/job-$mode-$r.log 2>&1 &
  eval "p$r=\$!"
done
sleep $settle
t0=$(date +%s.%N)
echo "fault at $t0 (job up $settle s)"
curl -s localhost:10370/hangs | python3 -c 'import json,sys; print("before fault: hangs", json.load(sys.stdin)["count"])'
if [ $mode = deadpeer ]; then kill -9 $p1; else touch $flag; fi
for i in $(seq 1 ${WAIT:-90}); do
  sleep 1
  n=$(curl -s localhost:10370/hangs | python3 -c 'import json,sys; d=json.load(sys.stdin); print(sum(1 for h in d["hangs"] if not h["resolved_at"]))')
  if [ "$n" != 0 ] && [ -z "${found:-}" ]; then found=$(date +%s.%N); echo "hang found after $(python3 -c "print(round($found-$t0,1))") s"; curl -s localhost:10370/hangs > $OUT/hangs-$mode-first.json; [ $mode != checkpoint ] && break; fi
done
sleep 3
curl -s localhost:10370/hangs > $OUT/hangs-$mode.json
python3 - $OUT/hangs-$mode.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for h in d["hangs"]:
    print(h["id"], h["severity"] if "severity" in h else "", h["conditions"], h["signals"], h["signature"], "resolved" if h["resolved_at"] else "open")
    print("  ", h["reason"]); print("  ", h["where"], h.get("missing"))
PY
curl -s localhost:10370/metrics | grep -E "gpuwatchd_gpu_(sm_active|utilization|power_watts|nvlink_bytes)" | grep -v "^#" | head -20
kill -9 $p0 $p1 2>/dev/null; kill $dpid; wait 2>/dev/null
grep -E "hang|Traceback|ERROR" $OUT/daemon-$mode.log | head -20
