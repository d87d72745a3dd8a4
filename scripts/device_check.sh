#!/usr/bin/env bash
# The one call to make on a lent GPU machine (docs/kernels.md, "Running the device check"):
# the kernels' check (scripts/gpu_check.py --quick), the decode step rows that `make gpu-aot`
# predicts and the engine end to end, both on random Llama-3-8B-shaped weights
# (scripts/gpu_engine_check.py --part decode / --part check; the bf16 rows at batch 1 and 256
# also traced by jax's profiler, their kernels' time summed by kind into the rows, and timed
# again drawing at random through every sampling filter; the
# engine check with the synchronous and the overlapped loop compared),
# the bf16 decode rows again with XLA's split-K heuristic
# forced off (docs/benchmarks.md: it trades HBM bytes for parallel GEMM tiles; which is faster
# needs this GPU), and the host work per request-step of both loops (scripts/bench_host.py,
# tiny model), merged into one JSON under $OUT, with the whole log.
#
#   scripts/device_check.sh              # on the GPU machine, stage limits 560 s in all
#   scripts/device_check.sh --cpu-smoke  # the same steps here, tiny shapes, Pallas interpreter
#
# Python packages the GPU machine lacks travel as wheels in .whl/ (the embedded model cannot:
# it is 93 MB); they are installed into /tmp/site first when .whl/ exists.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# jpaged is not installed on the GPU machine: the checkout itself is on the path, for the
# scripts and the processes they start (bench_host's engine core).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT_DIR=${OUT:-out/device_check}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

# Each stage has its own wall-clock limit (seconds), so one that overruns cannot take the
# next one's time; every stage prints its figures as it goes, into $OUT_DIR/device_check.log.
if [ "${1:-}" = "--cpu-smoke" ]; then
  KERNEL_ARGS=(--cpu-smoke)
  ENGINE_ARGS=(--cpu-smoke)
  DECODE_ARGS=(--cpu-smoke --profile-batches 4 --sampled-batches 4)
  HOST_ARGS=(--batches 4 --no-core-process)
  SPLITK_ARGS=(--cpu-smoke --decode-batches 4)
  LIMITS=(300 300 300 300 300)
else
  KERNEL_ARGS=(--quick --budget-s 90)
  DECODE_ARGS=(--decode-budget-s 100 --profile-batches 1 256 --sampled-batches 1 256)
  ENGINE_ARGS=(--budget-s 100)
  HOST_ARGS=(--batches 64 256)
  SPLITK_ARGS=(--decode-budget-s 40 --decode-batches 64 256)
  # kernels, decode rows, engine check, host, split-K off rows: 560 s, under the run's 600.
  LIMITS=(140 150 160 40 70)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv \
    > "$OUT_DIR/nvidia_smi.csv" 2>&1 || true
fi

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
t0=$(date +%s)
echo "== kernels (limit ${LIMITS[0]} s)"
timeout -k 5 "${LIMITS[0]}" "$PY" scripts/gpu_check.py "${KERNEL_ARGS[@]}" \
  --out "$OUT_DIR/kernels.json"
kernels_rc=$?
# The decode step rows first (the figures `make gpu-aot` predicts), the bf16 ones again with
# XLA's split-K off, then the engine check.
echo "== decode step rows (limit ${LIMITS[1]} s)"
timeout -k 5 "${LIMITS[1]}" "$PY" scripts/gpu_engine_check.py --part decode "${DECODE_ARGS[@]}" \
  --out "$OUT_DIR/decode.json"
decode_rc=$?
echo "== decode step rows, bf16 KV, XLA split-K off (limit ${LIMITS[4]} s)"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_force_split_k=1" timeout -k 5 "${LIMITS[4]}" \
  "$PY" scripts/gpu_engine_check.py --part decode --decode-kv bfloat16 "${SPLITK_ARGS[@]}" \
  --out "$OUT_DIR/decode_split_k_off.json"
splitk_rc=$?
echo "== engine check (limit ${LIMITS[2]} s)"
timeout -k 5 "${LIMITS[2]}" "$PY" scripts/gpu_engine_check.py --part check "${ENGINE_ARGS[@]}" \
  --out "$OUT_DIR/engine.json"
engine_rc=$?
echo "== host work per step (limit ${LIMITS[3]} s)"
# XLA_FLAGS set (empty unless given): bench_host's XLA:CPU thread flags are for this CPU only.
# Two processes share the GPU with the engine core in its own: neither may take most of it.
XLA_FLAGS=${XLA_FLAGS:-} XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "${LIMITS[3]}" \
  "$PY" scripts/bench_host.py --quick --no-embedded --no-plot "${HOST_ARGS[@]}" \
  --out "$OUT_DIR/host.json"
host_rc=$?

"$PY" - "$OUT_DIR" "$kernels_rc" "$decode_rc" "$engine_rc" "$host_rc" "$splitk_rc" \
  "$(( $(date +%s) - t0 ))" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
krc, drc, erc, hrc, src, wall = (int(x) for x in sys.argv[2:8])
doc = {"kernels_rc": krc, "decode_rc": drc, "engine_rc": erc, "host_rc": hrc,
       "decode_split_k_off_rc": src, "wall_s": wall}
for name in ("kernels", "decode", "engine", "host", "decode_split_k_off"):
    f = out / f"{name}.json"
    doc[name] = json.loads(f.read_text()) if f.exists() else None
smi = out / "nvidia_smi.csv"
doc["nvidia_smi"] = smi.read_text() if smi.exists() else None
(out / "device_check.json").write_text(json.dumps(doc, indent=1))
print(f"device_check: kernels rc={krc}, decode rc={drc}, engine rc={erc}, host rc={hrc}, "
      f"split-K off rc={src} (124: stage time limit), {wall} s -> {out}/device_check.json")
PYEOF
[ "$kernels_rc" -eq 0 ] && [ "$decode_rc" -eq 0 ] && [ "$engine_rc" -eq 0 ] && [ "$host_rc" -eq 0 ] \
  && [ "$splitk_rc" -eq 0 ]
