#!/usr/bin/env bash
# One multi-GPU device session in phases, one phase (or a comma list) per call:
#   bash tests/gpu/multi_gpu_session.sh start|scenarios-a|scenarios-b|scenarios-NAME[+NAME]|finish OUTDIR
#   bash tests/gpu/multi_gpu_session.sh start,scenarios-a OUTDIR       (several phases in one call)
#
# start        install the carried wheels (.whl/*.whl) into /tmp/site, start `gpuwatchd run`
#              (default config, state /tmp/gw-state, 127.0.0.1:10370) under setsid so it
#              outlives this call, record an idle NVML capture, nvidia-smi topology and NVLink.
# scenarios-a  the hang scenarios and the evaluation pause (tests/gpu/nccl_scenarios.py a);
#              an NVML capture during the first hangs.
# scenarios-b  the other controls (healthy DDP/FSDP 3 min, checkpoint 3 min, slow loader,
#              compile, normal end); an NVML capture and nvidia-smi NVLink reads under load.
# extras       every GPU idle (capture, tests/gpu/compare_nvidia_smi.py, nvlink_bandwidth.py),
#              then one DDP job on every GPU: compare again, nvidia-smi dmon and NVLink reads,
#              a capture, the daemon's CPU, tests/gpu/footprint.py under that load.
# finish       last reads of the daemon, SIGTERM to it, its log, state and footprint, then
#              tests/gpu/footprint.py (daemon beside bare pynvml, 60 s, idle).
#
# Every phase writes OUTDIR/PHASE.tar.gz (everything; PHASE with characters other than
# letters, digits, '.', '_', '-' made '_': scenarios-a+b -> scenarios-a_b.tar.gz) and adds
# its part to OUTDIR/session-summary.json and OUTDIR/session.log: at most 6 phases per
# call, so at most 8 files. A `scenarios-*` phase on a fresh machine (daemon gone) installs
# the wheels and starts the daemon first. Every phase says at its start and end whether
# the daemon this session started (pid + start time) still runs, and keeps the daemon's
# fault log, run marker and new kernel `segfault` lines. NVLink multicast stays off.
# Env: DRILL_VARIANTS (a scenarios phase also runs tests/gpu/nvml_crash_drill.py with these),
# TRAIN_SECONDS (extras' training job, 170), RECORD_IDLE_POLLS (start's idle capture, 30; 0 none), FOOTPRINT_SECONDS (finish, 60), PYTHON (python3), GW_CONFIG (a config file for the daemon; default: none = defaults),
# BUDGET (harness seconds per scenarios phase, 520), HANG_SECONDS (90), CONTROL_SECONDS (180),
# GW_ARGS (extra `gpuwatchd run` arguments), GW_PORT (10370), GW_STATE (/tmp/gw-state),
# GW_RUN (/tmp/gw-daemon: its pid, log, identity files), WORK_ROOT (/tmp: phase work dirs), HARNESS_ARGS (extra harness arguments, e.g.
# `--dry-run` to try the phases without a GPU, with GW_ARGS="--nvml-replay FILE").
set -u
phases=${1:?phase}
outdir=${2:?outdir}
mkdir -p "$outdir"
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo" || exit 1
py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$repo${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
gw_listen=127.0.0.1:${GW_PORT:-10370}
gw_url=http://$gw_listen
gw_state=${GW_STATE:-/tmp/gw-state}
gw_run=${GW_RUN:-/tmp/gw-daemon}  # the session's own files about the daemon: .pid .log .id .seen
gw_pidfile=$gw_run.pid
gw_log=$gw_run.log
gw_id=$gw_run.id      # "PID STARTTIME" of the daemon this session started last
gw_seen=$gw_run.seen  # kernel segfault lines already reported

note() { echo "$(date -u +%H:%M:%S) $*"; }
run_to() { # FILE SECONDS CMD...: output to FILE, bounded
  local f=$1 s=$2
  shift 2
  timeout -k 5 "$s" "$@" >"$f" 2>&1
  echo "rc=$? $*" >>"$f"
}
http_get() { # PATH FILE
  timeout 10 "$py" -c 'import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r: sys.stdout.buffer.write(r.read())
except urllib.error.HTTPError as e:  # an answer all the same (503 while sources start)
    sys.stdout.buffer.write(e.read())' "$gw_url$1" >"$2" 2>&1
}
proc_start() { # PID: its start time (clock ticks after boot; with the pid, unique); fails
  local st      # once it is gone or a zombie (an unreaped daemon keeps its /proc entry)
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  # shellcheck disable=SC2086  # split into the fields on purpose
  set -- $st
  case $1 in Z | X) return 1 ;; esac
  echo "${20}"
}
daemon_pid() { [ -s $gw_pidfile ] && proc_start "$(cat $gw_pidfile)" >/dev/null && cat $gw_pidfile; }
daemon_proc() { # FILE: the daemon's RSS and CPU seconds now (for CPU % over a phase)
  local pid
  pid=$(daemon_pid) || { echo '{"daemon": "not running"}' >"$1"; return; }
  "$py" - "$pid" >"$1" <<'EOF'
import json, os, sys, time
pid = sys.argv[1]
stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
rss = [l for l in open(f"/proc/{pid}/status") if l.startswith(("VmRSS", "VmHWM", "Threads"))]
tck = os.sysconf("SC_CLK_TCK")
print(json.dumps({"pid": int(pid), "t": time.time(), "cpu_s": (int(stat[11]) + int(stat[12])) / tck,
                  "status": {l.split(":")[0]: l.split(":")[1].strip() for l in rss}}))
EOF
}

install_wheels() {
  if [ -e /tmp/site/.installed ]; then return; fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    note "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    timeout 300 "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.installed
  else
    note "no .whl/*.whl carried; using the installed packages"
  fi
}

ensure_daemon() { # W: starts the daemon when it is not running (a fresh machine)
  if daemon_pid >/dev/null && http_get /healthz "$1/healthz-before.txt"; then
    note "daemon running (pid $(cat $gw_pidfile))"
    return
  fi
  install_wheels
  mkdir -p $gw_state
  local cfg=() pid
  [ -n "${GW_CONFIG:-}" ] && cfg=(--config "$GW_CONFIG")
  rm -f $gw_pidfile
  # setsid + nohup: its own session, so it outlives this call and survives its end; started
  # from a subshell, so it is no job of this script (a bare `wait` would wait for it)
  # shellcheck disable=SC2086  # GW_ARGS: extra daemon arguments, split on purpose
  (setsid nohup bash -c 'echo $$ >'$gw_pidfile'; exec "$@"' gw "$py" -m gpuwatchd run "${cfg[@]}" \
    --state-dir $gw_state --listen $gw_listen ${GW_ARGS:-} >>$gw_log 2>&1 </dev/null &)
  for _ in $(seq 1 20); do [ -s $gw_pidfile ] && break; sleep 0.25; done
  pid=$(cat $gw_pidfile 2>/dev/null)
  echo "$pid $(proc_start "$pid")" >$gw_id
  note "daemon started (pid $pid, start time $(proc_start "$pid")), waiting for /healthz"
  for _ in $(seq 1 60); do
    http_get /healthz "$1/healthz-start.txt" && { note "daemon answers"; return; }
    daemon_pid >/dev/null || break
    sleep 0.5
  done
  note "daemon did not answer within 30 s; tail of its log:"
  tail -20 $gw_log
}

new_segfaults() { # FILE: kernel segfault/trap lines not reported before (dmesg, bounded)
  timeout 10 dmesg 2>/dev/null | grep -E 'segfault|traps:' >"$1.all"
  touch $gw_seen
  grep -vxFf $gw_seen "$1.all" >"$1"
  cat "$1" >>$gw_seen
  rm -f "$1.all"
  [ -s "$1" ] || rm -f "$1"
}

daemon_check() { # W TAG: is the daemon this session started still running? its fault traces
  local w=$1 tag=$2 pid='' start='' state f
  [ -s $gw_id ] && read -r pid start <$gw_id
  if [ -z "$pid" ]; then
    state="none expected (not started yet, or stopped by finish)"
  elif [ -n "$start" ] && [ "$(proc_start "$pid")" = "$start" ]; then
    state=alive
  else
    state=GONE
  fi
  note "daemon check at $tag: pid ${pid:-none} (start time ${start:-?}) $state"
  printf '{"at": "%s", "t": %s, "pid": "%s", "starttime": "%s", "state": "%s"}\n' \
    "$tag" "$(date +%s)" "$pid" "$start" "$state" >>"$w/daemon-check.jsonl"
  # the run marker says a run did not stop cleanly; a new start moves the fault log to .1
  for f in gpuwatchd.run gpuwatchd-fault.log gpuwatchd-fault.log.1; do
    [ -s "$gw_state/$f" ] && cp "$gw_state/$f" "$w/$tag-$f"
  done
  new_segfaults "$w/$tag-segfaults.txt"
  [ -s "$w/$tag-segfaults.txt" ] && { note "new kernel segfault lines:"; cat "$w/$tag-segfaults.txt"; }
  if [ "$state" = GONE ]; then
    note "the daemon died; its fault log and the tail of its log:"
    head -60 "$gw_state/gpuwatchd-fault.log" 2>/dev/null
    tail -20 $gw_log
  fi
}

versions() { # FILE
  {
    nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id --format=csv 2>&1
    timeout 60 "$py" -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())' 2>&1
    timeout 30 "$py" -c 'import cupy; print("cupy", cupy.__version__)' 2>&1
    timeout 10 py-spy --version 2>&1
    timeout 10 "$py" -m gpuwatchd --version 2>&1
  } >"$1"
}

smi_nvlink() { # W TAG: nvidia-smi topology and NVLink reads, bounded
  run_to "$1/smi-nvlink-s-$2.txt" 60 nvidia-smi nvlink -s
  run_to "$1/smi-nvlink-e-$2.txt" 60 nvidia-smi nvlink -e
  run_to "$1/smi-nvlink-gt-$2.txt" 60 nvidia-smi nvlink -gt d
  run_to "$1/smi-query-$2.csv" 30 nvidia-smi --format=csv \
    --query-gpu=index,utilization.gpu,utilization.memory,power.draw,clocks.sm,temperature.gpu
}

daemon_reads() { # W TAG
  http_get /metrics "$1/metrics-$2.txt"
  http_get /status "$1/status-$2.json"
  http_get /hangs "$1/hangs-$2.json"
  http_get /alerts "$1/alerts-$2.json"
}

phase_start() { # W
  local w=$1
  install_wheels
  versions "$w/versions.txt"
  ensure_daemon "$w"
  run_to "$w/smi-topo.txt" 30 nvidia-smi topo -m
  run_to "$w/smi-q.txt" 60 nvidia-smi -q
  smi_nvlink "$w" idle
  if [ "${RECORD_IDLE_POLLS:-30}" -gt 0 ]; then
    run_to "$w/record-idle.log" 120 "$py" -m gpuwatchd record --out "$w/record-idle.json" \
      --polls "${RECORD_IDLE_POLLS:-30}" --interval 1
  fi
  daemon_reads "$w" start
}

phase_scenarios() { # W SUITE
  local w=$1 names=${2//+/ } bg=()
  ensure_daemon "$w"
  daemon_proc "$w/daemon-proc-before.json"
  daemon_reads "$w" before
  local knobs=(--budget "${BUDGET:-520}" --hang-seconds "${HANG_SECONDS:-90}"
    --control-seconds "${CONTROL_SECONDS:-180}")
  # shellcheck disable=SC2086  # HARNESS_ARGS: extra harness arguments (--dry-run ...)
  "$py" tests/gpu/nccl_scenarios.py --plan "${knobs[@]}" ${HARNESS_ARGS:-} $names >"$w/plan.txt" 2>&1
  if [ "$names" = a ]; then  # a capture while the first hangs (dead peers) last
    (sleep 50 && run_to "$w/record-hang.log" 120 "$py" -m gpuwatchd record \
      --out "$w/record-hang.json" --polls 30 --interval 2) >/dev/null 2>&1 &
    bg+=($!)
  else  # a capture and nvidia-smi reads while controls train on every GPU
    (sleep 60 && run_to "$w/record-load.log" 150 "$py" -m gpuwatchd record \
      --out "$w/record-load.json" --polls 60 --interval 2) >/dev/null 2>&1 &
    bg+=($!)
    (sleep 90 && smi_nvlink "$w" load) >/dev/null 2>&1 &
    bg+=($!)
  fi
  if [ -n "${DRILL_VARIANTS:-}" ]; then  # other NVML clients beside daemons of these variants
    (sleep 20 && run_to "$w/crash-drill.log" 400 "$py" tests/gpu/nvml_crash_drill.py \
      --variants "$DRILL_VARIANTS" --out "$w/crash-drill.json") >/dev/null 2>&1 &
    bg+=($!)
  fi
  note "scenarios: $names (plan: $(tail -1 "$w/plan.txt"))"
  # shellcheck disable=SC2086  # HARNESS_ARGS: extra harness arguments (--dry-run ...)
  timeout -k 15 "$(( ${BUDGET:-520} + 60 ))" "$py" tests/gpu/nccl_scenarios.py --out "$w/scen" \
    "${knobs[@]}" --daemon-url $gw_url ${HARNESS_ARGS:-} $names
  note "harness rc=$?"
  rm -rf /tmp/gpuscen-ckpt  # checkpoint files of killed jobs
  for p in "${bg[@]}"; do  # the side captures, by pid: their children first
    pkill -TERM -P "$p" 2>/dev/null
    kill "$p" 2>/dev/null
  done
  wait "${bg[@]}" 2>/dev/null  # these only: the daemon is no child of ours, but be sure
  cp "$w/scen/summary.json" "$w/summary.json" 2>/dev/null
  daemon_proc "$w/daemon-proc-after.json"
  daemon_reads "$w" after
}

phase_extras() { # W: every GPU idle, then every GPU in one DDP job: the node-wide reads
  local w=$1 train=$1/train-all pid n
  ensure_daemon "$w"
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  run_to "$w/record-idle.log" 60 "$py" -m gpuwatchd record --out "$w/record-idle.json" --polls 20 --interval 1
  run_to "$w/compare-idle.log" 90 "$py" tests/gpu/compare_nvidia_smi.py --util-rounds 5 \
    --json "$w/compare-idle.json" --markdown "$w/compare-idle.md"
  run_to "$w/nvlink-bw.log" 150 "$py" tests/gpu/nvlink_bandwidth.py --seconds 20 \
    --metrics-url $gw_url/metrics --out "$w/nvlink-bw.json"
  mkdir -p "$train"
  note "DDP training on all $n GPUs for ${TRAIN_SECONDS:-170} s"
  (setsid bash -c 'echo $$ >'"$train"'/pid; exec "$@"' train "$py" -m torch.distributed.run --standalone \
    --nproc-per-node="$n" tests/gpu/nccl_jobs.py healthy_ddp --dir "$train" \
    --seconds "${TRAIN_SECONDS:-170}" --warm 5 --scratch /tmp/gpuscen-ckpt \
    >"$train/torchrun.log" 2>&1 </dev/null &)
  sleep 35
  daemon_proc "$w/daemon-proc-train-before.json"
  run_to "$w/compare-load.log" 90 "$py" tests/gpu/compare_nvidia_smi.py --util-rounds 10 \
    --json "$w/compare-load.json" --markdown "$w/compare-load.md"
  run_to "$w/smi-dmon-load.txt" 30 nvidia-smi dmon -c 5 -s pucm
  smi_nvlink "$w" load-all
  run_to "$w/record-load.log" 60 "$py" -m gpuwatchd record --out "$w/record-load-all.json" --polls 15 --interval 2
  daemon_proc "$w/daemon-proc-train-after.json"
  daemon_reads "$w" train
  run_to "$w/footprint-train.log" 150 "$py" tests/gpu/footprint.py --seconds 45 --out "$w/footprint-train.json"
  if pid=$(cat "$train/pid" 2>/dev/null) && proc_start "$pid" >/dev/null; then
    note "training still running after the reads; stopping it"
    kill -TERM -- "-$pid" 2>/dev/null
    sleep 5
    kill -KILL -- "-$pid" 2>/dev/null
  fi
  rm -rf /tmp/gpuscen-ckpt
}

phase_finish() { # W
  local w=$1 pid
  daemon_proc "$w/daemon-proc-before.json"
  daemon_reads "$w" final
  run_to "$w/hang-show.json" 60 "$py" -m gpuwatchd hang show --state-dir $gw_state --json --limit 100
  run_to "$w/record-final.log" 60 "$py" -m gpuwatchd record --out "$w/record-final.json" --polls 10 --interval 1
  smi_nvlink "$w" final
  if pid=$(daemon_pid); then
    kill -TERM "$pid"
    for _ in $(seq 1 40); do proc_start "$pid" >/dev/null || break; sleep 0.5; done
    if proc_start "$pid" >/dev/null; then note "daemon ignored SIGTERM for 20 s; SIGKILL"; kill -KILL "$pid"; fi
    note "daemon stopped"
  fi
  rm -f $gw_pidfile $gw_id  # stopped on purpose: the end check expects no daemon
  cp $gw_log "$w/daemon.log" 2>/dev/null
  tar -C "$(dirname $gw_state)" -czf "$w/gw-state.tar.gz" "$(basename $gw_state)" 2>/dev/null
  run_to "$w/footprint.log" 200 "$py" tests/gpu/footprint.py --seconds "${FOOTPRINT_SECONDS:-60}" \
    --out "$w/footprint.json"
}

summarize() { # W PHASE START: the phase's part of OUTDIR/session-summary.json
  "$py" - "$1" "$2" "$3" "$outdir/session-summary.json" <<'EOF'
import json, os, sys, time
w, phase, start, out = sys.argv[1:5]
doc = {"phase": phase, "seconds": round(time.time() - float(start), 1), "files": sorted(os.listdir(w))}
try:
    doc["daemon_checks"] = [json.loads(ln) for ln in open(os.path.join(w, "daemon-check.jsonl"))]
except (OSError, ValueError) as e:
    doc["daemon_checks"] = f"absent: {e.__class__.__name__}"
doc["segfaults"] = [ln.rstrip() for n in doc["files"] if n.endswith("segfaults.txt")
                    for ln in open(os.path.join(w, n))]
for name in ("summary.json", "daemon-proc-before.json", "daemon-proc-after.json", "footprint.json"):
    try:
        doc[name] = json.load(open(os.path.join(w, name)))
    except (OSError, ValueError) as e:
        doc[name] = f"absent: {e.__class__.__name__}"
b, a = doc.get("daemon-proc-before.json"), doc.get("daemon-proc-after.json")
if isinstance(b, dict) and isinstance(a, dict) and "cpu_s" in b and "cpu_s" in a \
        and a.get("pid") == b.get("pid"):  # one daemon all along, else no rate
    doc["daemon_cpu_percent_of_one_core"] = round(100 * (a["cpu_s"] - b["cpu_s"]) / (a["t"] - b["t"]), 3)
try:
    session = json.load(open(out))
except (OSError, ValueError):
    session = {"phases": []}
session["phases"].append(doc)
json.dump(session, open(out, "w"), indent=1, default=str)
EOF
}

pack() { # W PHASE: OUTDIR/PHASE.tar.gz under 15 MiB (big bulk files dropped first)
  local w=$1 tgz="$outdir/$2.tar.gz" ex=()
  for drop in "" "*metrics-full.jsonl" "*nvml.jsonl" "*daemon-metrics.jsonl" "*smi-q.txt"; do
    [ -n "$drop" ] && ex+=(--exclude="$drop")
    tar -C "$(dirname "$w")" "${ex[@]}" --exclude='*.pipe' -czf "$tgz" "$(basename "$w")"
    [ "$(stat -c %s "$tgz")" -lt $((15 << 20)) ] && break
    note "$tgz over 15 MiB; dropping $drop and the next bulk file"
  done
}

read -ra list <<<"${phases//,/ }"
for phase in "${list[@]}"; do
  case $phase in start | scenarios-?* | extras | finish) ;; *) note "unknown phase $phase"; exit 2 ;; esac
done
if [ ${#list[@]} -gt 6 ]; then  # files back per call: one tar.gz per phase + 2
  note "at most 6 phases per call (${#list[@]} given)"
  exit 2
fi
for phase in "${list[@]}"; do
  tag=${phase//[^A-Za-z0-9._-]/_}  # the only characters a returned file name may hold
  start=$(date +%s.%N)
  w=${WORK_ROOT:-/tmp}/gpuscen-$tag-$(date -u +%H%M%S)
  mkdir -p "$w"
  {
    note "phase $phase -> $w"
    daemon_check "$w" begin
    case $phase in
      start) phase_start "$w" ;;
      scenarios-*) phase_scenarios "$w" "${phase#scenarios-}" ;;
      extras) phase_extras "$w" ;;
      finish) phase_finish "$w" ;;
    esac
    daemon_check "$w" end
    note "phase $phase done"
  } 2>&1 | tee "$w/phase.log"
  cat "$w/phase.log" >>"$outdir/session.log"
  summarize "$w" "$phase" "$start"
  pack "$w" "$tag"
  note "$phase: $(stat -c %s "$outdir/$tag.tar.gz") bytes in $outdir/$tag.tar.gz" | tee -a "$outdir/session.log"
done
