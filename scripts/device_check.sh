#!/usr/bin/env bash
# The one call to make on a lent GPU machine (docs/kernels.md, "Running the device check"):
# the kernels' check (scripts/gpu_check.py --quick: the attention kernels, and the copy rate
# with 16-byte accesses, the honest ceiling), the decode matmul kernels alone against XLA and
# their ideal bytes with a sweep of their tiles (python -m jpaged.bench.matmul_check), the
# decode step rows that `make gpu-aot` predicts, each of at most 64 sequences timed with the
# decode matmul kernels and with XLA's GEMMs (ms_kernels, ms_xla), speculative decoding's
# verifying steps beside plain decode (verify_rows), the quantized weights (fp8,
# int4: the decode matmul kernels alone and the 8B decode step beside their bf16 twins, python
# -m jpaged.bench.quant_check), and the engine end to end,
# all on random Llama-3-8B-shaped weights (scripts/gpu_engine_check.py --part decode / --part
# check; the bf16 rows at batch 1 and 256 also traced by jax's profiler, their kernels' time
# summed by kind into the rows, and timed again drawing at random through every sampling
# filter; the engine check with the synchronous and the overlapped loop compared), and the
# host work per request-step of both loops (scripts/bench_host.py, tiny model), merged into
# one JSON under $OUT, with the whole log. The bf16 decode rows again with XLA's split-K
# heuristic forced off (docs/benchmarks.md) run when named (--stages ...,split_k), and so does
# the mixture-of-experts grouped matmul beside XLA's ragged_dot, on bf16 and int4 experts, and
# a whole sparse block with the one-launch routing beside the sorted path (--stages moe:
# python -m jpaged.bench.moe_check, Qwen3-30B-A3B's expert shapes).
#
#   scripts/device_check.sh                      # on the GPU machine, stage limits 560 s in all
#   scripts/device_check.sh --stages engine,split_k   # a second call: only those stages
#   scripts/device_check.sh --stages quant       # the quantized weights alone
#   scripts/device_check.sh --stages moe         # the MoE grouped matmul alone (~60 s)
#   scripts/device_check.sh --cpu-smoke          # every stage here, tiny shapes, interpreter
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

SMOKE=0
STAGES=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --stages) STAGES=$2; shift ;;
    --stages=*) STAGES=${1#--stages=} ;;
    *) echo "device_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

# Each stage has its own wall-clock limit (seconds), so one that overruns cannot take the
# next one's time; every stage prints its figures as it goes, into $OUT_DIR/device_check.log.
if [ "$SMOKE" = 1 ]; then
  STAGES=${STAGES:-kernels,matmuls,decode,split_k,quant,moe,engine,host}
  KERNEL_ARGS=(--cpu-smoke)
  MOE_ARGS=(--cpu-smoke)
  MATMUL_ARGS=(--cpu-smoke)
  QUANT_ARGS=(--cpu-smoke)
  ENGINE_ARGS=(--cpu-smoke)
  DECODE_ARGS=(--cpu-smoke --profile-batches 4 --sampled-batches 4 --verify-rows 1x3)
  HOST_ARGS=(--batches 4 --no-core-process)
  SPLITK_ARGS=(--cpu-smoke --decode-batches 4)
  L_KERNELS=300 L_MATMULS=300 L_DECODE=300 L_SPLITK=300 L_QUANT=300 L_ENGINE=300 L_HOST=300
  L_MOE=300
else
  STAGES=${STAGES:-kernels,matmuls,decode,quant,engine,host}
  # Estimated on an H200 (docs/kernels.md, "Running the device check"): step programs compile
  # in 10-30 s, a matmul program in about a second; each budget leaves its stage's limit
  # room for the job in flight when it runs out.
  KERNEL_ARGS=(--quick --budget-s 45)
  MATMUL_ARGS=(--budget-s 65)
  # The verifying steps (speculative decoding), each a program of its own (a ragged step of
  # B sequences, T = R rows): 1x7 is 8 rows of one sequence in the bucket of 16, 16x3 64 rows
  # of 16 sequences. Each costs a compile; rows past the stage's budget are skipped, named.
  # VERIFY_ROWS=1x1,1x3,1x7,16x3 in a call of their own runs more.
  DECODE_ARGS=(--decode-budget-s 100 --profile-batches 1 256 --sampled-batches 1 256
    --verify-rows "${VERIFY_ROWS:-1x7,16x3}")
  QUANT_ARGS=(--budget-s 75)
  ENGINE_ARGS=(--budget-s 75)
  HOST_ARGS=(--batches 64 256)
  SPLITK_ARGS=(--decode-budget-s 40 --decode-batches 256 --no-decode-ab)
  MOE_ARGS=(--budget-s 60)
  L_MOE=90
  # The default stages: 70 + 85 + 130 + 100 + 140 + 35 = 560 s, under the run's 600.
  L_KERNELS=70 L_MATMULS=85 L_DECODE=130 L_QUANT=100 L_ENGINE=140 L_HOST=35 L_SPLITK=90
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv \
    > "$OUT_DIR/nvidia_smi.csv" 2>&1 || true
fi
want() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
t0=$(date +%s)
ts=$t0
# Each stage's wall time, in the log: what the next run's limits are set from.
stage_done() { local now; now=$(date +%s); echo "== stage took $((now - ts)) s"; ts=$now; }
# run_stage RC_VAR TITLE LIMIT CMD...: the stage under its own time limit, its exit status into
# RC_VAR (124: the limit), its wall time logged.
run_stage() {
  local var=$1 title=$2 limit=$3
  shift 3
  echo "== $title (limit $limit s)"
  timeout -k 5 "$limit" "$@"
  printf -v "$var" '%s' "$?"
  stage_done
}
echo "== stages: $STAGES"
# A stage not run has rc "null" in the merged JSON.
kernels_rc=null matmuls_rc=null decode_rc=null splitk_rc=null quant_rc=null engine_rc=null
host_rc=null moe_rc=null
want kernels && run_stage kernels_rc "kernels" "$L_KERNELS" \
  "$PY" scripts/gpu_check.py "${KERNEL_ARGS[@]}" --out "$OUT_DIR/kernels.json"
# The decode matmul kernels alone; their % of copy is of the kernels stage's 16-byte copy
# (measured here when that stage left none).
want matmuls && run_stage matmuls_rc "decode matmuls" "$L_MATMULS" \
  "$PY" -m jpaged.bench.matmul_check "${MATMUL_ARGS[@]}" \
  --ceiling-json "$OUT_DIR/kernels.json" --out "$OUT_DIR/matmul.json"
# The decode step rows (the figures `make gpu-aot` predicts; the decode matmul A/B), then the
# bf16 ones again with XLA's split-K off when asked, then the engine check.
want decode && run_stage decode_rc "decode step rows" "$L_DECODE" \
  "$PY" scripts/gpu_engine_check.py --part decode "${DECODE_ARGS[@]}" --out "$OUT_DIR/decode.json"
want split_k && run_stage splitk_rc "decode step rows, bf16 KV, XLA split-K off" "$L_SPLITK" \
  env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_force_split_k=1" \
  "$PY" scripts/gpu_engine_check.py --part decode --decode-kv bfloat16 "${SPLITK_ARGS[@]}" \
  --out "$OUT_DIR/decode_split_k_off.json"
# The quantized weights (fp8, int4): the kernels alone and the 8B decode step, each beside its
# bf16 twin (the matmul and decode stages' rows when they have them, else timed here).
want quant && run_stage quant_rc "quantized weights" "$L_QUANT" \
  "$PY" -m jpaged.bench.quant_check "${QUANT_ARGS[@]}" --ceiling-json "$OUT_DIR/kernels.json" \
  --matmul-json "$OUT_DIR/matmul.json" --decode-json "$OUT_DIR/decode.json" \
  --out "$OUT_DIR/quant.json"
# The mixture-of-experts grouped matmul kernel beside XLA's ragged_dot (opt-in on a GPU).
want moe && run_stage moe_rc "MoE grouped matmul" "$L_MOE" \
  "$PY" -m jpaged.bench.moe_check "${MOE_ARGS[@]}" --ceiling-json "$OUT_DIR/kernels.json" \
  --out "$OUT_DIR/moe.json"
want engine && run_stage engine_rc "engine check" "$L_ENGINE" \
  "$PY" scripts/gpu_engine_check.py --part check "${ENGINE_ARGS[@]}" --out "$OUT_DIR/engine.json"
# XLA_FLAGS set (empty unless given): bench_host's XLA:CPU thread flags are for this CPU only.
# Two processes share the GPU with the engine core in its own: neither may take most.
want host && run_stage host_rc "host work per step" "$L_HOST" \
  env XLA_FLAGS="${XLA_FLAGS:-}" XLA_PYTHON_CLIENT_PREALLOCATE=false \
  "$PY" scripts/bench_host.py --quick --no-embedded --no-plot "${HOST_ARGS[@]}" \
  --out "$OUT_DIR/host.json"

"$PY" - "$OUT_DIR" "$kernels_rc" "$matmuls_rc" "$decode_rc" "$engine_rc" "$host_rc" \
  "$splitk_rc" "$quant_rc" "$(( $(date +%s) - t0 ))" "$STAGES" "$moe_rc" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
krc, mrc, drc, erc, hrc, src, qrc = (json.loads(x) for x in sys.argv[2:9])
wall, stages, moerc = int(sys.argv[9]), sys.argv[10].split(","), json.loads(sys.argv[11])
doc = {"stages": stages, "kernels_rc": krc, "matmuls_rc": mrc, "decode_rc": drc,
       "engine_rc": erc, "host_rc": hrc, "decode_split_k_off_rc": src, "quant_rc": qrc,
       "moe_rc": moerc, "wall_s": wall}
for name, f in (("kernels", "kernels"), ("matmuls", "matmul"), ("decode", "decode"),
                ("engine", "engine"), ("host", "host"),
                ("decode_split_k_off", "decode_split_k_off"), ("quant", "quant"),
                ("moe", "moe")):
    p = out / f"{f}.json"
    doc[name] = json.loads(p.read_text()) if p.exists() else None
# The ceilings at the top level: the kernels stage's, else what the matmul stage measured.
kern, mm = doc["kernels"] or {}, doc["matmuls"] or {}
src16 = kern if kern.get("copy_GBps_16byte") else (mm.get("copy_source") or {})
for k in ("copy_GBps_16byte", "copy_16byte_method", "copy_GBps_jax_bf16"):
    doc[k] = src16.get(k)
doc["matmul_best_plans"] = mm.get("matmul_best_plans")
doc["decode_ab"] = [{k: r.get(k) for k in ("kv_cache_dtype", "batch", "context_len", "ms_xla",
                                           "ms_kernels", "xla_over_kernels")}
                    for r in (doc["decode"] or {}).get("decode_rows", []) if "ms_kernels" in r]
# Speculative decoding's verifying steps beside the plain decode step of their batch.
doc["verify_rows"] = [{k: r.get(k) for k in ("kv_cache_dtype", "batch", "k", "rows", "bucket",
                                             "context_len", "verify_ms", "decode_ms", "ratio",
                                             "break_even_accepted")}
                      for r in (doc["decode"] or {}).get("verify_rows", []) if "verify_ms" in r]
# The quantized weights beside their bf16 twins: each kernel alone, and the decode step.
quant = doc["quant"] or {}
doc["quant_ab"] = [{k: r.get(k) for k in ("weights", "kernel", "rows", "us", "bf16_us",
                                          "bf16_over_quant", "pct_of_copy_16byte", "ok")}
                   for r in quant.get("quant_matmul_timings", [])]
doc["quant_decode"] = [{k: r.get(k) for k in ("weights", "batch", "context_len", "step_ms",
                                              "bf16_step_ms", "bf16_over_quant",
                                              "decode_matmuls", "weight_bytes")}
                       for r in quant.get("quant_decode_rows", [])]
# The MoE grouped matmul beside XLA's ragged_dot (the opt-in moe stage).
doc["moe_ab"] = (doc["moe"] or {}).get("moe_rows", [])
# A whole sparse block at decode: the one-launch routing against the sorted path.
doc["moe_block"] = (doc["moe"] or {}).get("block_rows", [])
smi = out / "nvidia_smi.csv"
doc["nvidia_smi"] = smi.read_text() if smi.exists() else None
(out / "device_check.json").write_text(json.dumps(doc, indent=1))
print(f"device_check: kernels rc={krc}, matmuls rc={mrc}, decode rc={drc}, engine rc={erc}, "
      f"host rc={hrc}, split-K off rc={src}, quant rc={qrc} (124: stage time limit; null: "
      f"not run), "
      f"copy16 {doc['copy_GBps_16byte']} GB/s ({doc['copy_16byte_method']}), "
      f"jax bf16 copy {doc['copy_GBps_jax_bf16']} GB/s, {wall} s -> {out}/device_check.json")
for r in doc["decode_ab"]:
    print(f"  decode A/B {r['kv_cache_dtype']} B={r['batch']} ctx={r['context_len']}: "
          f"XLA's GEMMs {r['ms_xla']} ms, kernels {r['ms_kernels']} ms "
          f"(xla/kernels {r['xla_over_kernels']}x)")
for r in doc["verify_rows"]:
    print(f"  verify {r['kv_cache_dtype']} B={r['batch']} k={r['k']} ({r['rows']} rows, bucket "
          f"{r['bucket']}) ctx={r['context_len']}: {r['verify_ms']} ms, decode "
          f"{r['decode_ms']} ms (break-even {r['break_even_accepted']} tokens/step)")
for r in doc["moe_ab"]:
    print(f"  moe T={r['tokens']} ({r['experts_chosen']} experts): kernel {r['us_kernel']} us, "
          f"ragged_dot {r.get('us_xla')} us ({r.get('kernel_GBps')} GB/s of chosen experts)")
for r in doc["moe_block"]:
    print(f"  moe block T={r['tokens']}: fused routing {r['us_fused']} us, sorted "
          f"{r['us_sorted']} us (sorted/fused {r['sorted_over_fused']}x)")
for r in doc["quant_decode"]:
    print(f"  decode {r['weights']} B={r['batch']}: {r['step_ms']} ms, bf16 "
          f"{r['bf16_step_ms']} ms (bf16/quant {r['bf16_over_quant']}x; {r['decode_matmuls']})")
PYEOF
for rc in "$kernels_rc" "$matmuls_rc" "$decode_rc" "$splitk_rc" "$quant_rc" "$engine_rc" \
    "$host_rc" "$moe_rc"; do
  [ "$rc" = null ] || [ "$rc" -eq 0 ] || exit 1
done
exit 0
