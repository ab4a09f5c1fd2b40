"""DeepSeek-LLM-67B shapes: 95 layers, 8192 hidden, 64 query / 8 kv heads (GQA), 22016 MLP,
vocab 102400, seq 4096. 67,425,001,472 parameters.

FSDP inside a pipeline: 5 stages of 19 layers, each stage's params and Adam state sharded over
`data` (ZeRO-3 style) and its heads and MLP over `tensor`. The pipeline gathers a stage's weights
once per step (docs/pipeline.md). On 160 GPUs (20 nodes of 8), with a prepared corpus tokenized
with the DeepSeek tokenizer:
  python launch.py --config configs/deepseek_67b.py --config.data.path=data/ds --workdir runs/ds67b
The recipe's fp8 and recomputation on top (1-bit Adam needs params replicated over `data`, so
it does not combine with mesh.fsdp; AdamW here):
  python launch.py --config configs/deepseek_67b.py --config.train.compute_dtype=fp8 \
      --config.remat.policy=attention_core --config.data.path=data/ds
Prints: one progress line every 10 steps with loss, tokens/s, ms/step and MFU.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_7b  # noqa: E402  pylint: disable=wrong-import-position


def get_config(arg=None):
    c = deepseek_7b.get_config(arg)
    c.model.update(dict(
        num_layers=95,          # decoder blocks (95 = 5 stages x 19)
        hidden_size=8192,       # model width D
        num_heads=64,           # query heads (head_dim 128)
        num_kv_heads=8,         # grouped-query attention: 8 query heads per kv head
        mlp_dim=22016,          # SwiGLU hidden width
    ))
    # 160 GPUs: tensor 8 inside a node, 5 pipeline stages, 4-way data with FSDP in each stage.
    c.mesh.update(dict(data=4, tensor=8, pipeline=5, fsdp=True))
    c.pipeline.update(dict(schedule="1f1b", microbatches=10))  # a multiple of the 5 stages
    c.data.global_batch = 160   # rows per step: 4 data replicas x 10 microbatches x 4 rows
    c.optim.lr = 3.2e-4         # DeepSeek-LLM 67B peak lr
    c.optim.name = "adamw"
    return c
