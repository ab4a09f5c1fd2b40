"""A tiny DeepSeek-V3-architecture model on 8 simulated CPU devices: MLA, one dense layer then
DeepSeekMoE layers (sigmoid router with the auxiliary-loss-free bias, group-limited top-2 of 8
routed experts + 1 shared), experts over `data` with all-to-all dispatch, and one MTP module.

Run:    python launch.py --config configs/cpu_moe.py --workdir runs/cpu_moe
Prints: a progress line every 25 steps (loss falling from ~6.2 nats/token); metrics.jsonl holds
        each logged step's per-expert load (`expert_load`: each expert's share of its layer's
        assignments, 0.125 when balanced), `aux_loss` and `mtp_loss`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_tiny  # noqa: E402  pylint: disable=wrong-import-position


def get_config(arg=None):
    del arg
    c = cpu_tiny.get_config()
    c.model.update(dict(
        num_layers=4,              # 1 dense block, then 3 MoE blocks
        hidden_size=128,           # model width D
        num_heads=4,               # MLA heads (num_kv_heads = num_heads: MLA has no GQA)
        num_kv_heads=4,
        mlp_dim=384,               # the dense block's SwiGLU width
        attention="mla",           # multi-head latent attention
        q_lora_rank=64,            # low-rank query path
        kv_lora_rank=32,           # compressed KV latent
        qk_nope_head_dim=32,       # per-head q/k dims without RoPE
        qk_rope_head_dim=16,       # per-head q/k dims with RoPE (shared key)
        v_head_dim=32,             # per-head value dim
        n_routed_experts=8,        # routed experts per MoE layer (2 per data-parallel device)
        n_shared_experts=1,        # one always-on shared expert
        moe_intermediate_size=96,  # expert width
        num_experts_per_tok=2,     # top-2 routing
        n_group=2,                 # group-limited: each token uses 1 (topk_group) of 2 groups
                                   # of 4 experts
        scoring="sigmoid",         # V3 router
        norm_topk_prob=True,       # normalised top-k weights
        first_k_dense_replace=1,   # first block dense
        aux_loss_alpha=0.0001,     # V3's small sequence-wise balance loss
        expert_parallel=True,      # all-to-all dispatch, experts over `data` (dropless)
        num_mtp_layers=1,          # one multi-token prediction module
    ))
    c.mesh.update(dict(
        data=4,                    # 8 experts, 2 per data-parallel device
        pipeline=1,                # its 3 MoE blocks do not split into 2 stages (docs/moe.md)
    ))
    c.train.steps = 300
    c.checkpoint.every = 100
    return c
