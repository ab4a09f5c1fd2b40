"""Control group: DeepSeek-7B, bf16 compute, data x tensor parallel, no recomputation.

Run on 8 H100s:  python launch.py --config configs/h100_bf16.py --config.data.path=DIR
On CPU (the same feature set on a tiny model):  python launch.py --config configs/h100_bf16.py:smoke
Prints: a progress line every 10 steps; compare with configs/h100_fp8.py (the optimized group).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_7b  # noqa: E402  pylint: disable=wrong-import-position
from dsjax.errors import unknown_choice  # noqa: E402  pylint: disable=wrong-import-position


def get_config(arg=None):
    c = deepseek_7b.get_config()
    c.mesh.update(dict(data=2, tensor=4, fsdp=False))  # TP inside a 4-GPU group, DP x2
    c.train.compute_dtype = "bfloat16"  # the control group's precision
    c.remat.policy = "none"             # no activation recomputation
    c.data.global_batch = 16            # 8 rows of 4096 tokens per data-parallel replica
    if arg == "smoke":
        _shrink_for_cpu(c)
    elif arg:
        raise ValueError(unknown_choice("variant", arg, ("smoke",)))
    return c


def _shrink_for_cpu(c):
    """Same features, a model and batch that run on 8 simulated CPU devices in seconds."""
    c.model.update(dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4, mlp_dim=256,
                        vocab_size=512))
    c.mesh.update(dict(data=4, tensor=2))
    c.data.update(dict(source="stdlib", path="", seq_len=64, global_batch=8, eval_batches=2))
    c.train.update(dict(steps=20, log_every=5, compute_dtype="float32", sample_tokens=16))
    c.optim.update(dict(lr=3e-3, warmup_steps=5, freeze_step=4))  # 1-bit Adam: 20% of 20 steps
    c.checkpoint.update(dict(every=10))
