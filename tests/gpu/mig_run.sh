#!/usr/bin/env bash
# MIG on a GPU test machine (as root): switch MIG on, create GPU and compute
# instances, record a capture while a process holds a context on one MIG device,
# provoke a real Xid 31 inside that MIG device, then switch MIG off again.
#   bash tests/gpu/mig_run.sh OUTDIR
set -u
DEST=${1:?usage: mig_run.sh OUTDIR}
GPU=${GPU:-0}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
here=$(cd "$(dirname "$0")" && pwd)

step MIG on
nvidia-smi -i "$GPU" -mig 1 > "$DEST/mig-enable.txt" 2>&1; echo "rc=$?" >> "$DEST/mig-enable.txt"
cat "$DEST/mig-enable.txt"
nvidia-smi mig -i "$GPU" -cgi 9,19,19 -C > "$DEST/mig-create.txt" 2>&1; echo "rc=$?" >> "$DEST/mig-create.txt"
cat "$DEST/mig-create.txt"
{ nvidia-smi -L; nvidia-smi mig -lgi; nvidia-smi mig -lci; } > "$DEST/mig-list.txt" 2>&1
cat "$DEST/mig-list.txt"
mig=$(nvidia-smi -L | grep -o 'MIG-[0-9a-f-]*' | head -1)

step hold a context on "$mig" and record
CUDA_VISIBLE_DEVICES=$mig "$PY" -c "
import ctypes, time
cuda = ctypes.CDLL('libcuda.so.1'); cuda.cuInit(0)
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
cuda.cuDeviceGet(ctypes.byref(dev), 0); cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
p = ctypes.c_void_p(); cuda.cuMemAlloc_v2(ctypes.byref(p), 256 << 20)
time.sleep(25)
" &
holder=$!
sleep 6
nvidia-smi > "$DEST/smi-mig.txt" 2>&1
"$PY" -m gpuwatchd record --out "$DEST/h100-mig-instances-record.json" --polls 3 --interval 1 2>&1 | tail -3
wait $holder

step Xid 31 inside "$mig"
before=$(dmesg | wc -l)
CUDA_VISIBLE_DEVICES=$mig "$PY" -c "
import json, sys
sys.path.insert(0, '$here')
import faults
print(json.dumps(faults.illegal_write_ptx(), default=str))
" 2>&1 | tail -2
sleep 2
dmesg | tail -n +"$((before + 1))" > "$DEST/dmesg-mig-xid.txt"
cat /dev/null > "$DEST/kmsg-mig-xid.txt"
timeout 2 cat /dev/kmsg > "$DEST/kmsg-raw.txt" 2>/dev/null
grep -a 'NVRM' "$DEST/kmsg-raw.txt" | tail -20 > "$DEST/kmsg-mig-xid.txt"
cat "$DEST/dmesg-mig-xid.txt"
"$PY" -m gpuwatchd xid scan "$DEST/dmesg-mig-xid.txt" > "$DEST/xid-scan-mig.txt" 2>&1
cat "$DEST/xid-scan-mig.txt"

step MIG off
{ nvidia-smi mig -i "$GPU" -dci; nvidia-smi mig -i "$GPU" -dgi; nvidia-smi -i "$GPU" -mig 0; echo "rc=$?"; nvidia-smi -q | grep -A2 "MIG Mode"; } > "$DEST/mig-disable.txt" 2>&1
cat "$DEST/mig-disable.txt"
