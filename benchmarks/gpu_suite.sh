#!/usr/bin/env bash
# The one prepared GPU check (one H200/H100, under 9 minutes: the step timeouts sum to 530 s):
# proves fp8 GEMMs are emitted and measures bf16 vs fp8 step time, MFU and memory of a ~1.2B
# DeepSeek-architecture model, plus recomputation table rows compiled for the GPU and the
# attention implementations' table in bf16 (cudnn and pallas against xla). Results: $OUT (the
# device tool's folder) or benchmarks/results/gpu/.
#
# The GPU image has JAX, flax, optax and orbax but not ml-collections; carry it as a wheel:
#   pip download --no-deps -d .gpu_wheels ml-collections && echo /.gpu_wheels/ >> .git/info/exclude
#   device run: command="bash benchmarks/gpu_suite.sh", carry=[".gpu_wheels"], timeout_s=560
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/gpu}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
PRESET="${SUITE_PRESET:-1b}"  # SUITE_PRESET=smoke dry-runs the script on CPU
if [ -d .gpu_wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/dsjax_site .gpu_wheels/*.whl
  export PYTHONPATH="/tmp/dsjax_site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
LOG="$RESULTS/gpu_suite.log"
step() { echo "== $*" | tee -a "$LOG"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
"$PY" -c "import jax, flax, optax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOG"

step "fp8 GEMMs in the compiled train step (1.2B preset)"
timeout 120 "$PY" benchmarks/fp8_hlo.py --config configs/h100_fp8.py --preset "$PRESET" \
  --out "$RESULTS/fp8_hlo_1b.json" 2>&1 | tail -n 12 | tee -a "$LOG"

step "bf16 vs fp8 step time, MFU, memory (1.2B preset, alternating rounds)"
timeout 240 "$PY" benchmarks/step_time.py --preset "$PRESET" --steps 4 --rounds 2 \
  --config configs/h100_bf16.py \
  --config "configs/h100_bf16.py|train.compute_dtype=fp8" \
  --config "configs/h100_fp8.py|optim.name=adamw" \
  --out "$RESULTS/step_time_1b.json" 2>&1 | tail -n 8 | tee -a "$LOG"

step "recomputation rows compiled for the GPU (DeepSeek-7B width, seq 4096)"
timeout 110 "$PY" benchmarks/remat_table.py --config configs/deepseek_7b.py \
  --rows none/all,attention_core/all --out "$RESULTS/remat_7b_gpu.json" 2>&1 \
  | tail -n 6 | tee -a "$LOG"
step "attention implementations in bf16: temp bytes, |diff| against xla, ms (7B width and V2-Lite MLA)"
# On an NVIDIA GPU the table adds cudnn and pallas rows; the smoke preset runs tiny shapes on CPU.
ATTN_SIZES=(--seq_lens 1024,4096)
if [ "$PRESET" = "smoke" ]; then
  ATTN_SIZES=(--heads 4 --head_dim 16 --mla_dims 4,16,8,16 --seq_lens 64,128 --check_seq 128)
fi
timeout 60 "$PY" benchmarks/attention_table.py --dtype bfloat16 "${ATTN_SIZES[@]}" \
  --out "$RESULTS/attention_table_gpu.json" 2>&1 | tail -n 20 | tee -a "$LOG"
step "done"
