"""DeepSeek-V3 shapes (deepseek-ai/DeepSeek-V3 config.json), for eval_shape, memory and
parallelism planning: 61 layers, 7168 hidden, 128 MLA heads (1536 q rank, 512 KV latent),
YaRN x40 over 4k, 3 dense layers (18432), then 58 DeepSeekMoE layers of 1 shared + 256 routed
experts (2048 wide, top-8, sigmoid router with correction bias, 8 groups / 4 kept), one MTP module.

671,026,419,200 parameters without MTP (the published 671B); the MTP module adds 11.6B in dsjax,
which shares the embedding and output head; the released checkpoint stores its own copies of
them, which make the published 685B (tests/test_moe.py checks both).
  python -c "from dsjax import config; from dsjax.model.decoder import *; \
             print(count_params(abstract_params(config.load('configs/deepseek_v3.py').model)))"
Training it needs a cluster: experts over `data`, MLA heads and expert widths over `tensor`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_7b  # noqa: E402  pylint: disable=wrong-import-position


def get_config(arg=None):
    del arg
    c = deepseek_7b.get_config()
    c.model.update(dict(
        num_layers=61,              # decoder blocks
        hidden_size=7168,           # model width D
        num_heads=128,              # MLA heads
        num_kv_heads=128,           # = num_heads (MLA)
        mlp_dim=18432,              # the 3 dense blocks' SwiGLU width
        vocab_size=129280,          # DeepSeek-V3 tokenizer vocabulary
        init_std=0.006,             # DeepSeek-V3 §4.2
        attention="mla",            # multi-head latent attention
        q_lora_rank=1536,           # query compression rank
        kv_lora_rank=512,           # compressed KV latent
        qk_nope_head_dim=128,       # per-head q/k dims without RoPE
        qk_rope_head_dim=64,        # per-head q/k dims with RoPE
        v_head_dim=128,             # per-head value dim
        rope_scaling="yarn",        # 4k -> 128k context
        rope_factor=40.0,
        rope_original_max_len=4096,
        rope_mscale_all_dim=1.0,
        n_routed_experts=256,       # routed experts per MoE layer
        n_shared_experts=1,         # shared expert
        moe_intermediate_size=2048,  # expert width
        num_experts_per_tok=8,      # top-8
        n_group=8, topk_group=4,    # node-limited routing: 4 of 8 groups
        routed_scaling_factor=2.5,
        scoring="sigmoid",          # V3 router with correction bias
        norm_topk_prob=True,
        first_k_dense_replace=3,    # layers 0-2 dense
        aux_loss_alpha=0.0001,      # V3's sequence-wise balance loss weight
        bias_update_speed=0.001,    # V3's bias update speed gamma (first 14.3T tokens)
        expert_parallel=True,       # experts over `data`, all-to-all dispatch
        moe_impl="auto",            # dropless: sorted rows, grouped GEMMs (docs/moe.md)
        num_mtp_layers=1,           # one MTP module, loss weight 0.3 (V3 §4.2, first 10T tokens)
    ))
    c.mesh.update(dict(data=64, tensor=8, fsdp=True))  # 512 GPUs: 4 experts each
    c.data.update(dict(seq_len=4096, global_batch=1536))
    c.optim.lr = 2.2e-4
    return c
