#!/usr/bin/env bash
# The runtime on CUDA: one GPU shared by the workers, gloo over CUDA tensors (NCCL needs a GPU
# per rank: set KEEL_BACKEND=nccl on a machine with one GPU per worker). Prints the fault-free
# step time, local-8's four faults absorbed (downtime, breakdown) and the recovery benchmark
# (absorb vs checkpoint_restart) for a killed worker, then the emulated 12-node cluster
# (scenarios/multiregion-12.toml: 12 workers sharing the GPU, one fault of each class).
#   bash bench/gpu_check.sh            (from the repository root; needs torch with CUDA)
#   KEEL_DEVICE=cpu bash bench/gpu_check.sh   (the same script on CPU: checks the script itself)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export KEEL_DEVICE=${KEEL_DEVICE:-cuda}
export KEEL_BACKEND=${KEEL_BACKEND:-gloo}
OUT=${OUT:-$(mktemp -d)}
$PY - <<'PY'
import os, sys, torch
if not os.environ["KEEL_DEVICE"].startswith("cuda"):
    print(f"device {os.environ['KEEL_DEVICE']} (not CUDA), torch {torch.__version__}")
elif not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False; nothing to check here")
else:
    print(f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}")
PY
S=scenarios/local-8.toml
SET=(--set model.d_model=128 --set model.layers=4 --set workload.micro_batch=8)
echo "== fault-free (device=$KEEL_DEVICE backend=$KEEL_BACKEND)"
$PY -m keel.cli run $S "${SET[@]}" --steps 40 --no-faults --out "$OUT/clean" --json > "$OUT/clean.json"
echo "== local-8's schedule (one fault of each class), absorbed"
$PY -m keel.cli run $S "${SET[@]}" --out "$OUT/hw" --json > "$OUT/hw.json" || true
$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
clean = json.load(open(f"{out}/clean.json"))
print(f"fault-free step time: {clean['step_time_s'] * 1000:.1f} ms over {clean['steps']} steps, "
      f"final loss {clean['losses'][-1]:.4f}")
try:
    hw = json.load(open(f"{out}/hw.json"))
except Exception as e:
    sys.exit(f"absorb run failed: {e}")
for f in hw["faults"]:
    print(f"  {f['class']:22} {f['target']:16} {f['action']:24} downtime {f['downtime_s']:.3f} s  cost {f['cost_s']:.3f} s")
events = [json.loads(l) for l in open(f"{out}/hw/events.jsonl")]
for e in events:
    if e["kind"] == "recover_end" and e["fault"] == "hardware_fault":
        d = e["detail"]
        print("  breakdown: " + ", ".join(f"{k} {d[k]:.3f} s" for k in ("detect_s", "reform_s", "state_s", "redo_s") if k in d))
print(f"restarts {hw['restarts']}")
PY
if [ "${RECOVERY:-1}" = 1 ]; then  # RECOVERY=0 leaves the slow restart baseline out
  echo "== recovery benchmark (absorb vs checkpoint_restart), device=$KEEL_DEVICE"
  $PY bench/recovery.py --repeats 1
fi
echo "== the emulated 12-node cluster, device=$KEEL_DEVICE"
$PY -m keel.cli run scenarios/multiregion-12.toml --emulate --out "$OUT/emu12"
