#!/usr/bin/env bash
# The hang scenarios on a real GPU: `record` (RAS answers, rank missing at start,
# peer death) or `healthy` (a bf16 matmul loop and a copy loop, 3 min each);
# `remote-rank-missing` or `kernel-never-ends`: that hang beside the daemon (stacks on),
# JSON with seconds to verdict and alert on stdout and in OUTDIR/result.json, the
# recording in OUTDIR/run and as a fixture in OUTDIR/fixture (hang_daemon_e2e.py).
# `cause-kills`: a rank OOM-killed, segfaulting, hitting Xid 31, and the cause the daemon
# names (cause_kills.py; JSON on stdout and in OUTDIR/result.json, logs in OUTDIR).
#   bash tests/gpu/hang_run.sh record|ras|healthy|remote-rank-missing|kernel-never-ends|cause-kills OUTDIR
set -u
mode=$1
out=$2
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
jobs_py="$here/hang_jobs.py"
watch="$here/hang_watch.py"
spy() { timeout 30 py-spy dump --native --pid "$1" >"$2" 2>&1; echo "py-spy pid $1 rc=$? $(wc -l <"$2") lines"; }
wait_file() { for _ in $(seq 1 "$2"); do [ -e "$1" ] && return 0; sleep 0.5; done; echo "timeout waiting for $1"; return 1; }

ras_job() {  # NAME go-teardown|go-abort ADDR
  local d p
  d=$(mktemp -d)
  NCCL_RAS_ADDR=$3 $py "$jobs_py" ras1 "$d" >"$out/ras1-$1.log" 2>&1 &
  p=$!
  wait_file "$d/ready" 60 && sleep 1
  $py "$here/hang_ras_record.py" "$3" "$out/ras-$1-running"
  touch "$d/$2"
  if [ "$2" = go-teardown ]; then wait_file "$d/destroying" 30; else wait_file "$d/aborted" 30; fi
  sleep 4
  $py "$here/hang_ras_record.py" "$3" "$out/ras-$1"
  spy $p "$out/pyspy-$1.txt"
  sleep 3
  $py "$here/hang_ras_record.py" "$3" "$out/ras-$1-later"
  kill -9 $p; wait $p 2>/dev/null
}
ras_phase() {
  ras_job teardown go-teardown localhost:28028 &
  ras_job abort go-abort localhost:28029 &
  wait
}

if [ "$mode" = remote-rank-missing ] || [ "$mode" = kernel-never-ends ] || [ "$mode" = cause-kills ]; then
  repo=$(cd "$here/../.." && pwd)
  out=$(cd "$out" && pwd)
  . "$here/carried_site.sh"  # the carried wheels (py-spy, the daemon's dependencies)
  if [ "$mode" = cause-kills ]; then  # OOM kill, segfault, Xid 31: the cause named (cause_kills.py)
    exec $py "$here/cause_kills.py" --out-dir "$out"
  fi
  exec $py "$here/hang_daemon_e2e.py" --scenario "$mode" --record "$out" \
    ${FIXTURE_SUFFIX:+--fixture-suffix "$FIXTURE_SUFFIX"}
elif [ "$mode" = ras ]; then
  ras_phase
elif [ "$mode" = record ]; then
  # (1) one-rank NCCL jobs: RAS while running, while destroy_process_group polls, after abort
  ras_phase
  # (2) rank missing at start: WORLD_SIZE=2, only rank 0 runs
  t0=$(date +%s.%N)
  $py "$watch" --seconds 95 --out "$out" --tag rendezvous --since "$t0" &
  w=$!
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 \
    $py "$jobs_py" rendezvous >"$out/rendezvous.log" 2>&1 &
  p=$!
  wait $w
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >>"$out/rendezvous.log" 2>&1
  kill -9 $p; wait $p 2>/dev/null
  sleep 2

  # (3) peer death mid-spin: two ranks share flags through CUDA IPC; rank 1 is killed
  d=$(mktemp -d)
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=29544 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2
  RANK=0 LOCAL_RANK=0 $py "$jobs_py" peer 0 "$d" >"$out/peer0.log" 2>&1 &
  p0=$!
  RANK=1 LOCAL_RANK=1 $py "$jobs_py" peer 1 "$d" >"$out/peer1.log" 2>&1 &
  p1=$!
  kill_at=$(( $(date +%s) + 25 ))
  $py "$watch" --seconds 115 --out "$out" --tag peerdeath --since "$kill_at" &
  w=$!
  sleep $(( kill_at - $(date +%s) ))
  kill -9 $p1
  echo "killed rank 1 (pid $p1) at $(date +%s.%N)"
  sleep 8
  nvidia-smi --query-gpu=utilization.gpu,utilization.memory,power.draw,power.limit --format=csv >>"$out/peer0.log" 2>&1
  top -b -n 1 -p $p0 | tail -2 >>"$out/peer0.log"
  wait $w
  kill -9 $p0; wait $p0 2>/dev/null
elif [ "$mode" = healthy ]; then
  # one watcher over both loops: matmul for 180 s, then copy for 180 s
  t0=$(date +%s.%N)
  $py "$watch" --seconds 362 --out "$out" --tag healthy --since "$t0" &
  w=$!
  for load in matmul copy; do
    $py "$jobs_py" $load 180 >"$out/$load.log" 2>&1
    echo "$load ended at +$($py -c "import time; print(round(time.time() - $t0, 1))") s: $(cat "$out/$load.log")"
  done
  wait $w
fi
