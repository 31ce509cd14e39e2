#!/usr/bin/env bash
# The real-GPU smoke every change to a source, the CLI or the daemon's lifecycle runs
# on a 1-GPU machine (as root, from the repository root), one phase or several:
#   bash tests/gpu/smoke.sh check,footprint,xid,diag,hang OUTDIR
# check      `gpuwatchd check` wall time, every source on, four ways (check_timing.py)
# footprint  the daemon beside a bare pynvml floor (footprint.py), and the floor started
#            five ways at once (floor_probe.py), 60 s each, side by side
# xid        a real Xid 31 through the daemon to /metrics and /events (xid31_e2e.py)
# diag       `gpuwatchd diag --tier quick --json`, its wall time and exit status
# hang       one-rank hangs with the daemon watching (hang_run.sh modes named in
#            HANG_MODES, default: remote-rank-missing kernel-never-ends), each
#            writing its CI fixture under OUTDIR/hang-MODE/fixture
# Each phase writes OUTDIR/PHASE.json (and logs); the last line of each phase says
# what it measured. Needs nothing from outside the machine.
set -u
phases=${1:?usage: smoke.sh PHASE[,PHASE...] OUTDIR}
out=${2:?usage: smoke.sh PHASE[,PHASE...] OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
summary() { "$py" -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in sys.argv[2:] if k in d})" "$@"; }

step versions
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/versions.txt"
"$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__)" 2>&1 | tee -a "$out/versions.txt"

for phase in ${phases//,/ }; do
  case $phase in
  check)
    step "check timing"
    "$py" tests/gpu/check_timing.py --runs "${CHECK_RUNS:-8}" --out "$out/check.json" >"$out/check.log" 2>&1
    echo "rc=$?"
    "$py" -c "import json; d=json.load(open('$out/check.json')); print({k: v for k, v in d.items() if k != 'profile_top'})" 2>&1 | cut -c1-1500
    ;;
  footprint)
    step "footprint + floor probe (${FOOTPRINT_SECONDS:-60} s)"
    "$py" tests/gpu/floor_probe.py --seconds "${FOOTPRINT_SECONDS:-60}" --out "$out/floor.json" >"$out/floor.log" 2>&1 &
    probe=$!
    "$py" tests/gpu/footprint.py --seconds "${FOOTPRINT_SECONDS:-60}" --out "$out/footprint.json" >"$out/footprint.log" 2>&1
    echo "footprint rc=$?"
    wait $probe
    echo "floor probe rc=$?"
    summary "$out/footprint.json" daemon_rss_mib floor_rss_mib rss_above_floor_mib daemon_cpu_percent_of_one_core
    "$py" -c "import json; d=json.load(open('$out/floor.json')); print({k: v.get('rss_mib', v) for k, v in d.items() if isinstance(v, dict)})"
    ;;
  xid)
    step "real Xid 31"
    "$py" tests/gpu/xid31_e2e.py --out "$out/xid.json" >"$out/xid.log" 2>&1
    echo "rc=$?"
    tail -c 1500 "$out/xid.json" 2>/dev/null || tail -20 "$out/xid.log"
    ;;
  diag)
    step "diag quick"
    t0=$(date +%s%N)
    "$py" -m gpuwatchd diag --tier quick --json >"$out/diag.json" 2>"$out/diag.log"
    rc=$?
    echo "rc=$rc wall_ms=$((($(date +%s%N) - t0) / 1000000))"
    head -c 800 "$out/diag.json"; echo
    ;;
  hang)
    for mode in ${HANG_MODES:-remote-rank-missing kernel-never-ends}; do
      step "hang $mode"
      FIXTURE_SUFFIX=${FIXTURE_SUFFIX:-1xh200} bash tests/gpu/hang_run.sh "$mode" "$out/hang-$mode" \
        >"$out/hang-$mode.log" 2>&1
      echo "rc=$?"
      tail -c 1500 "$out/hang-$mode/result.json" 2>/dev/null || tail -20 "$out/hang-$mode.log"
      echo
    done
    ;;
  *) echo "unknown phase $phase" ;;
  esac
done
step done
