"""Optimized group: DeepSeek-7B with the recipe's features switched on as they land.

Landed: fp8 GEMMs for the attention/MLP projections where a probe measures them safe (fp8.select
auto, current per-tensor scaling; embedding, output head, norms and the attention core stay in
bf16/fp32), selective recomputation `attention_core`
(benchmarks/results/remat_deepseek_7b.txt: 71% of `none`'s temporaries, FLOPs unchanged at 1.000),
1-bit Adam with error compensation after 20% of the steps (benchmarks/results/comm_bytes_*.json:
the compressed step sends ~1/32 of the warmup step's data-parallel bytes; every 10th step is
exact and refreshes v, so 1/7.8 on average: the optim.refresh_every default; docs/onebit.md),
the adaptive batch size between 512 and 2048 rows with gradient accumulation, and tensor x
pipeline x data parallelism (2 x 2 x 2, the default 1f1b schedule), the XLA overlap flag profile.

Run on 8 H100s:  python launch.py --config configs/h100_fp8.py --config.data.path=DIR
On CPU (everything landed, on a tiny model):  python launch.py --config configs/h100_fp8.py:smoke
At 67B, FSDP inside a pipeline (configs/deepseek_67b.py: 5 stages x tensor 8 x data 4, AdamW,
since 1-bit Adam needs params replicated over `data`):
  python launch.py --config configs/deepseek_67b.py --config.train.compute_dtype=fp8 \
      --config.remat.policy=attention_core --config.data.path=DIR
Prints: a progress line every 10 steps; compare with configs/h100_bf16.py (the control group).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h100_bf16  # noqa: E402  pylint: disable=wrong-import-position


def get_config(arg=None):
    c = h100_bf16.get_config(arg)
    # No ZeRO-3: 1-bit Adam compresses each worker's momentum of the whole model, so params and
    # optimizer state stay replicated over `data` (mesh.fsdp with onebit_adam is a ConfigError).
    c.mesh.fsdp = False
    c.mesh.xla_profile = "overlap"      # latency-hiding scheduler + pipelined collectives (GPU)
    c.optim.name = "onebit_adam"        # exact Adam, then 1-bit compressed momentum all-reduce
    c.optim.freeze_step = c.train.steps // 5  # freeze v after 20% of the steps (200; smoke: 4)
    # fp8 projections with the default fp8 section: per-tensor current scaling (stateless), the
    # embedding, head and attention core in fp8.other_dtype (bfloat16).
    c.train.compute_dtype = "fp8"
    # Which projections of which layers run in fp8 is chosen from measured error (a float32
    # probe on training rows before step 1 and every fp8.probe_every steps, hysteresis, spike
    # demotion: docs/precision.md). The probe runs the unpipelined float32 model: 2 rows of
    # 4,096 tokens (one per data replica) keep it small beside the training state (not yet run
    # on a GPU).
    c.fp8.select = "auto"
    c.fp8.probe_rows = 2
    c.remat.policy = "attention_core"   # Megatron-style selective recompute, every layer (see
                                        # docstring)
    # Dynamic batch size (docs/batching.md): start at 512 rows (2M tokens), grow x1.5 up the
    # ladder while the predicted memory stays under 90% (batch.mem_fraction), shrink x0.8 past
    # it; each size is micro-batch x accumulation x data. No step-time rule
    # (batch.target_step_ms = 0): with accumulation a step's time grows with the batch by design.
    c.data.global_batch = 512           # the starting size (a ladder size)
    c.batch.update(dict(
        policy="adaptive", ladder="512,768,1024,1536,2048",
        reference_batch=512))           # optim.lr is the lr at 512 rows; sqrt-scaled above
    # Tensor x pipeline x data on 8 GPUs: 2 x 2 x 2 keeps two data-parallel workers for 1-bit
    # Adam (the recipe's tensor 4 x pipeline 2 needs 16 GPUs for that: --config.mesh.tensor=4).
    # The default 1f1b schedule (deepseek_7b's 8 microbatches): activation memory flat in the
    # microbatch count (docs/pipeline.md); the pipeline's shard_map nests inside 1-bit Adam's
    # gradient shard_map.
    c.mesh.update(dict(data=2, tensor=2, pipeline=2))
    c.batch.micro_batch = 8             # rows per replica per micro-step: the 8 pipeline microbatches
    if arg == "smoke":
        c.pipeline.microbatches = 2     # pipelined smoke: mesh (2, 2, 2), 8 rows
        c.fp8.other_dtype = "float32"   # CPUs have no fast bf16; fp8 GEMMs are emulated exactly
        c.fp8.probe_every = 4           # re-probe at steps 4, 8, ... (across the batch change)
        c.data.global_batch = 8         # 2 rows per data-parallel replica
        # A two-rung ladder and micro-batch 2 (the 2 pipeline microbatches of one row), so
        # accumulation (2, then 4 micro-steps) composes
        # with fp8 and 1-bit Adam; CPU reports no memory limit, so adaptive grows once the
        # cooldown is over. Deterministic (no step-time rule): resuming reproduces the run.
        c.batch.update(dict(ladder="8,16", reference_batch=8, micro_batch=2, patience=2,
                            cooldown=2))
    return c
