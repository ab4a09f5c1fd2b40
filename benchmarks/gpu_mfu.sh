#!/usr/bin/env bash
# The GPU MFU benchmark: one H100 (80 GB) or H200 (141 GB), on the GPU image's own packages, one
# process per piece (benchmarks/gpu_mfu.py), in order of value, each under its own limit (the
# limits sum to 390 s; tests/test_gpu_image.py holds them to 420):
#   preflight (15 s: nvidia-smi, JAX/jaxlib/cuDNN versions, device kind and memory, and that these
#   exact XLA_FLAGS start a GPU process; a failure stops the run with one line naming it), then
#   DeepSeek-7B width at S 4096, 2 and 6 layers, bf16 and fp8 (batch 4 where it fits, else the
#   largest that does), attention xla vs cudnn (causal; one document a row and packed), the GEMM
#   and bandwidth ceilings, the fp8 GEMM census (fp8_hlo.py), and the summary (full-depth MFU
#   extrapolated to 30 layers). Settings as MaxText's GPU recipe: unrolled layers, command
#   buffers off, Triton GEMMs off (cuBLAS(Lt) takes every GEMM, fp8 included), XLA's
#   rematerialization pass off, no overlap profile (one GPU: nothing to overlap).
# Writes under $OUT (or benchmarks/results/gpu) exactly two files: gpu_mfu.json (every row,
# written as each piece finishes, a stub before it compiles) and gpu_mfu.log (every piece's full
# output). The last line lists each piece as ok / failed / timed out; any piece that is not ok
# makes the exit status 1, after every other piece has run. The compilation cache lives outside
# $OUT ($GPU_MFU_CACHE), so the 6-layer rows reuse the 2-layer rows' autotuning.
# GPU_MFU_PRESET=smoke dry-runs every piece at tiny sizes on CPU (tests/test_gpu_image.py).
#
# The GPU image has JAX, flax, optax and orbax but not ml-collections; carry it as a wheel:
#   pip download --no-deps -d .gpu_wheels ml-collections && echo /.gpu_wheels/ >> .git/info/exclude
#   device run: command="bash benchmarks/gpu_mfu.sh", carry=[".gpu_wheels"], timeout_s=480
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/gpu}"
mkdir -p "$RESULTS"
RECORD="$RESULTS/gpu_mfu.json"
LOG="$RESULTS/gpu_mfu.log"
rm -f "$RECORD"
: > "$LOG"
PY="${PYTHON:-python3}"
PRESET="${GPU_MFU_PRESET:-gpu}"
export PYTHONUNBUFFERED=1
WHEELS="${GPU_WHEELS:-.gpu_wheels}"  # the carried wheels (the tests point it at their cache)
if [ -d "$WHEELS" ]; then
  SITE="$(mktemp -d)"
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl \
      >>"$LOG" 2>&1; then
    echo "gpu_mfu: preflight failed: the carried wheels in $WHEELS did not install (see $LOG)"
    exit 2
  fi
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=false --xla_disable_hlo_passes=rematerialization"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export JAX_COMPILATION_CACHE_DIR="${GPU_MFU_CACHE:-/tmp/dsjax_gpu_mfu_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
echo "XLA_FLAGS=$XLA_FLAGS" | tee -a "$LOG"

SUMMARY=()
FAILED=0
# piece NAME LIMIT_S SCRIPT ARGS...: runs SCRIPT under the limit, its whole output to the log
# (its last lines to stdout), then marks its row in the record ok / failed / timed out.
piece() {
  local name=$1 limit=$2 rc status out
  shift 2
  out="$(mktemp)"  # outside $OUT: the machine returns few files
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  timeout -k 5 "$limit" "$PY" "$@" >"$out" 2>&1
  rc=$?
  cat "$out" >>"$LOG"
  tail -n 3 "$out"
  rm -f "$out"
  case $rc in
    0) status=ok ;;
    124|137) status="timed out" ;;
    *) status=failed ;;
  esac
  [ "$status" = ok ] || FAILED=1
  echo "-- $name: $status (exit $rc)" >>"$LOG"
  "$PY" benchmarks/gpu_record.py mark "$RECORD" "$name" "$status" "$rc" "$limit" >>"$LOG" 2>&1
  SUMMARY+=("$name $status")
  return $rc
}
run() {  # run NAME LIMIT_S PIECE ARGS...: one gpu_mfu.py piece
  local name=$1 limit=$2
  shift 2
  piece "$name" "$limit" benchmarks/gpu_mfu.py "$@" --row "$name" --record "$RECORD" \
    --preset "$PRESET"
}

if ! piece preflight 15 benchmarks/gpu_preflight.py --record "$RECORD" --preset "$PRESET"; then
  why="$(grep '^preflight failed: ' "$LOG" | tail -n 1)"
  echo "gpu_mfu: ${why:-preflight failed: ${SUMMARY[-1]} (see $LOG)}"
  exit 2
fi
run model_bfloat16_2 65 model --layers 2 --dtype bfloat16
run model_bfloat16_6 50 model --layers 6 --dtype bfloat16
run model_fp8_2 65 model --layers 2 --dtype fp8
run model_fp8_6 50 model --layers 6 --dtype fp8
run attention 50 attention
run ceilings 30 ceilings
run fp8_census 50 fp8_census
run summary 15 summary

line="gpu_mfu pieces: $(IFS=,; echo "${SUMMARY[*]}" | sed 's/,/, /g')"
echo "$line" | tee -a "$LOG"
exit $FAILED
