#!/usr/bin/env bash
# The one call to make on a lent GPU machine (docs/kernels.md, "Running the device check"):
# the kernels' check (scripts/gpu_check.py --quick), the engine end to end on random
# Llama-3-8B-shaped weights (scripts/gpu_engine_check.py, with the synchronous and the
# overlapped loop compared) and the host work per request-step of both loops
# (scripts/bench_host.py, tiny model), merged into one JSON under $OUT.
#
#   scripts/device_check.sh              # on the GPU machine, < 10 minutes
#   scripts/device_check.sh --cpu-smoke  # the same steps here, tiny shapes, Pallas interpreter
#
# Python packages the GPU machine lacks travel as wheels in .whl/ (the embedded model cannot:
# it is 93 MB); they are installed into /tmp/site first when .whl/ exists.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-out/device_check}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

if [ "${1:-}" = "--cpu-smoke" ]; then
  KERNEL_ARGS=(--cpu-smoke)
  ENGINE_ARGS=(--cpu-smoke)
  HOST_ARGS=(--batches 4 --no-core-process)
else
  KERNEL_ARGS=(--quick --budget-s 150)
  ENGINE_ARGS=(--budget-s 210)
  HOST_ARGS=(--batches 64 256)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv \
    > "$OUT_DIR/nvidia_smi.csv" 2>&1 || true
fi

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

t0=$(date +%s)
"$PY" scripts/gpu_check.py "${KERNEL_ARGS[@]}" --out "$OUT_DIR/kernels.json"
kernels_rc=$?
"$PY" scripts/gpu_engine_check.py "${ENGINE_ARGS[@]}" --out "$OUT_DIR/engine.json"
engine_rc=$?
# XLA_FLAGS set (empty unless given): bench_host's XLA:CPU thread flags are for this CPU only.
# Two processes share the GPU with the engine core in its own: neither may take most of it.
XLA_FLAGS=${XLA_FLAGS:-} XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" scripts/bench_host.py \
  --quick --no-embedded --no-plot "${HOST_ARGS[@]}" --out "$OUT_DIR/host.json"
host_rc=$?

"$PY" - "$OUT_DIR" "$kernels_rc" "$engine_rc" "$host_rc" "$(( $(date +%s) - t0 ))" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
krc, erc, hrc, wall = (int(x) for x in sys.argv[2:6])
doc = {"kernels_rc": krc, "engine_rc": erc, "host_rc": hrc, "wall_s": wall}
for name in ("kernels", "engine", "host"):
    f = out / f"{name}.json"
    doc[name] = json.loads(f.read_text()) if f.exists() else None
smi = out / "nvidia_smi.csv"
doc["nvidia_smi"] = smi.read_text() if smi.exists() else None
(out / "device_check.json").write_text(json.dumps(doc, indent=1))
print(f"device_check: kernels rc={krc}, engine rc={erc}, host rc={hrc}, {wall} s -> "
      f"{out}/device_check.json")
PYEOF
[ "$kernels_rc" -eq 0 ] && [ "$engine_rc" -eq 0 ] && [ "$host_rc" -eq 0 ]
