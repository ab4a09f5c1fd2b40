#!/usr/bin/env bash
# The GPU MFU benchmark: one H100/H200, under 8 minutes, one process per configuration
# (benchmarks/gpu_mfu.py has the pieces). Ceilings (bf16 and fp8 GEMMs at 8192^3, memory
# bandwidth), the attention impls at B 2, S 4096, 32 x 128 heads, causal and packed, then
# DeepSeek-7B width at S 4096 with 2 and 6 layers in bf16 and fp8, extrapolated to 30 layers.
# Then the fp8 GEMM count of the compiled step (fp8_hlo.py) and the recomputation rows compiled
# for the GPU (remat_table.py). Timeouts sum to 500 s. Writes $OUT/gpu_mfu.json (or
# benchmarks/results/gpu/gpu_mfu.json), fp8_hlo.json and remat_7b.json, and prints the table.
# GPU_MFU_PRESET=smoke dry-runs every step at tiny sizes on CPU (tests/test_benchmarks.py).
#
# The GPU image has JAX, flax, optax and orbax but not ml-collections; carry it as a wheel:
#   pip download --no-deps -d .gpu_wheels ml-collections && echo /.gpu_wheels/ >> .git/info/exclude
#   device run: command="bash benchmarks/gpu_mfu.sh", carry=[".gpu_wheels"], timeout_s=540
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/gpu}"
ROWS="$RESULTS/gpu_mfu_rows"
mkdir -p "$ROWS"
PY="${PYTHON:-python3}"
PRESET="${GPU_MFU_PRESET:-gpu}"
REMAT="${GPU_MFU_REMAT:-none}"  # a policy that fits: none fits 6 layers of 7B width on 141 GB
export PYTHONUNBUFFERED=1
if [ -d .gpu_wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/dsjax_site .gpu_wheels/*.whl
  export PYTHONPATH="/tmp/dsjax_site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
# The overlap profile (dsjax/runtime/xla_flags.py: latency-hiding scheduler, pipelined
# collectives), Triton GEMMs off (cuBLAS(Lt) takes the GEMMs, fp8 included), XLA's own
# rematerialisation pass off (dsjax chooses recomputation), 90% of device memory.
PROFILE="$("$PY" -c 'from dsjax.runtime import xla_flags; print(" ".join(xla_flags.flags("overlap")))')"
export XLA_FLAGS="${XLA_FLAGS:-} $PROFILE --xla_gpu_enable_triton_gemm=false --xla_disable_hlo_passes=rematerialization"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
echo "XLA_FLAGS=$XLA_FLAGS" | tee "$RESULTS/gpu_mfu_flags.txt"
piece() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$PY" benchmarks/gpu_mfu.py "$@" --preset "$PRESET" 2>&1 | tail -n 4; }

piece 45 ceilings --out "$ROWS/ceilings.json"
piece 75 attention --out "$ROWS/attention.json"
for dtype in bfloat16 fp8; do
  for layers in 2 6; do
    piece 60 model --layers "$layers" --dtype "$dtype" --remat "$REMAT" \
      --out "$ROWS/model_${dtype}_${layers}.json"
  done
done
piece 20 combine "$ROWS" --out "$RESULTS/gpu_mfu.json"

# fp8 GEMMs in the compiled step (cuBLASLt count, fp8 dots left in the optimised HLO, upcasts)
# and the recomputation rows compiled for the GPU. The smoke preset uses tiny shapes.
if [ "$PRESET" = "smoke" ]; then
  FP8=(--config configs/h100_fp8.py:smoke)
  REMAT_ROWS=(--set model.num_layers=2 --set model.hidden_size=128 --set model.num_heads=4
              --set model.num_kv_heads=4 --set model.mlp_dim=256 --set model.vocab_size=512
              --set data.seq_len=128)
else
  FP8=(--config configs/h100_fp8.py --preset 1b)
  REMAT_ROWS=()
fi
echo "== fp8 GEMMs in the compiled train step"
timeout 60 "$PY" benchmarks/fp8_hlo.py "${FP8[@]}" --out "$RESULTS/fp8_hlo.json" 2>&1 | tail -n 3
echo "== recomputation rows compiled for this device (DeepSeek-7B width)"
timeout 60 "$PY" benchmarks/remat_table.py --config configs/deepseek_7b.py "${REMAT_ROWS[@]}" \
  --rows none/all,attention_core/all --out "$RESULTS/remat_7b.json" 2>&1 | tail -n 4
