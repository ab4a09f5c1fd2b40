"""Optimized group: DeepSeek-7B with the recipe's features switched on as they land.

Landed so far: the spine only (bf16, data x tensor parallel, ZeRO-3 style parameter sharding).
fp8 (#4), selective recomputation (#5), 1-bit Adam (#6), pipeline parallelism (#7) and the dynamic
batch size (#8) each switch themselves on here when they land.

Run on 8 H100s:  python launch.py --config configs/h100_fp8.py --config.data.path=DIR
On CPU (everything landed, on a tiny model):  python launch.py --config configs/h100_fp8.py:smoke
Prints: a progress line every 10 steps; compare with configs/h100_bf16.py (the control group).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h100_bf16  # noqa: E402  pylint: disable=wrong-import-position


def get_config(arg=None):
    c = h100_bf16.get_config(arg)
    c.mesh.fsdp = True  # shard params/optimizer state over `data` too
    if arg == "smoke":
        c.model.hidden_size = 128  # divisible by mesh.data (fsdp)
    return c
