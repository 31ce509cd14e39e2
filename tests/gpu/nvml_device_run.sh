#!/usr/bin/env bash
# One run on a GPU test machine (as root): nvidia-smi output, the comparison
# table idle and under load, GPM cost, a normal capture, then MIG on, a MIG
# capture, MIG devices, and MIG off again. Everything lands in $DEST (a
# directory) and is packed into $DEST.tar.gz.
set -u
DEST=${1:?usage: nvml_device_run.sh DEST}
GPU=${GPU:-0}
mkdir -p "$DEST"
PY=${PYTHON:-python3}
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
load() {  # $1 seconds of fp16/fp32 matmuls on the visible GPU
    "$PY" - "$1" <<'PYEOF' &
import sys, time, torch
end = time.time() + float(sys.argv[1])
a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
b = torch.randn(4096, 4096, device="cuda", dtype=torch.float32)
while time.time() < end:
    for _ in range(20):
        a @ a
        b @ b
    torch.cuda.synchronize()
PYEOF
}

step versions
nvidia-smi > "$DEST/smi.txt" 2>&1
nvidia-smi -q > "$DEST/smi-q-idle.txt" 2>&1
nvidia-smi --help-query-gpu > "$DEST/smi-help-query-gpu.txt" 2>&1
fields=$(grep -o '^"[a-z0-9_.]*"' "$DEST/smi-help-query-gpu.txt" | tr -d '"' | paste -sd,)
nvidia-smi --query-gpu="$fields" --format=csv > "$DEST/smi-query-gpu-idle.csv" 2>&1
systemctl show nvidia-fabricmanager.service > "$DEST/fabricmanager.txt" 2>&1 || echo "rc=$?" >> "$DEST/fabricmanager.txt"

step compare idle
"$PY" tests/gpu/compare_nvidia_smi.py --json "$DEST/compare-idle.json" --markdown "$DEST/compare-idle.md" > /dev/null 2>&1
tail -2 "$DEST/compare-idle.md"

step record idle
"$PY" -m gpuwatchd.cli.record --out "$DEST/h100-idle-record.json" --polls 3 --interval 1 2>&1 | tail -2

step load + compare + record + dmon
load 40
sleep 5
"$PY" tests/gpu/compare_nvidia_smi.py --json "$DEST/compare-load.json" --markdown "$DEST/compare-load.md" > /dev/null 2>&1
tail -2 "$DEST/compare-load.md"
"$PY" -m gpuwatchd.cli.record --out "$DEST/h100-gpm-record.json" --polls 5 --interval 1 2>&1 | tail -2
timeout 20 nvidia-smi dmon -c 3 --gpm-metrics 1,2,3,5,10,11,12,13,20,21,60,61 > "$DEST/dmon-gpm.txt" 2>&1
step bench gpm
"$PY" benchmarks/bench_gpm.py --json "$DEST/bench-gpm.json" --polls 100 --gap 0.05 > /dev/null 2>&1
cat "$DEST/bench-gpm.json"
wait

step MIG on
nvidia-smi -i "$GPU" -mig 1 > "$DEST/mig-enable.txt" 2>&1; echo "rc=$?" >> "$DEST/mig-enable.txt"
cat "$DEST/mig-enable.txt"
nvidia-smi mig -lgip > "$DEST/mig-lgip.txt" 2>&1
nvidia-smi mig -i "$GPU" -cgi 9,19,19 -C > "$DEST/mig-create.txt" 2>&1; echo "rc=$?" >> "$DEST/mig-create.txt"
cat "$DEST/mig-create.txt"
nvidia-smi -L > "$DEST/mig-list.txt" 2>&1
nvidia-smi mig -lgi >> "$DEST/mig-list.txt" 2>&1
nvidia-smi mig -lci >> "$DEST/mig-list.txt" 2>&1
cat "$DEST/mig-list.txt"
mig=$(nvidia-smi -L | grep -o 'MIG-[0-9a-f-]*' | head -1)
if [ -n "$mig" ]; then export CUDA_VISIBLE_DEVICES=$mig; load 25; unset CUDA_VISIBLE_DEVICES; sleep 5; fi
nvidia-smi -q > "$DEST/smi-q-mig.txt" 2>&1
"$PY" tests/gpu/compare_nvidia_smi.py --json "$DEST/compare-mig.json" --markdown "$DEST/compare-mig.md" > /dev/null 2>&1
tail -2 "$DEST/compare-mig.md"
"$PY" -m gpuwatchd.cli.record --out "$DEST/h100-mig-record.json" --polls 4 --interval 1 2>&1 | tail -2
wait

step MIG off
{ nvidia-smi mig -dci; nvidia-smi mig -dgi; nvidia-smi -i "$GPU" -mig 0; echo "rc=$?"; nvidia-smi -q | grep -A2 "MIG Mode"; } > "$DEST/mig-disable.txt" 2>&1
cat "$DEST/mig-disable.txt"
step pack
tar -C "$(dirname "$DEST")" -czf "$DEST.tar.gz" "$(basename "$DEST")"
ls -la "$DEST"
