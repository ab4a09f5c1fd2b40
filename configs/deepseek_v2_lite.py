"""DeepSeek-V2-Lite shapes (deepseek-ai/DeepSeek-V2-Lite config.json): 27 layers, 2048 hidden,
16 MLA heads (no q compression, 512 KV latent, 128+64 q/k, 128 v), YaRN x40 over 4k, the first
layer dense (10944), then DeepSeekMoE: 2 shared + 64 routed experts of 1408, top-6 softmax.

15,706,484,224 parameters (the published 15.7B; 2.7B activated per token). Needs GPUs and a
corpus tokenized with the DeepSeek tokenizer; start from the released weights with
  python -m dsjax.convert hf-to-orbax --hf DeepSeek-V2-Lite --config configs/deepseek_v2_lite.py --out ckpt
  python launch.py --config configs/deepseek_v2_lite.py --config.checkpoint.init_from=ckpt \
      --config.data.path=data/ds --workdir runs/v2lite
Prints: one progress line every 10 steps with loss, tokens/s, ms/step and MFU; metrics.jsonl
        holds each logged step's per-expert load.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_7b  # noqa: E402  pylint: disable=wrong-import-position


def get_config(arg=None):
    del arg
    c = deepseek_7b.get_config()
    c.model.update(dict(
        num_layers=27,              # decoder blocks
        hidden_size=2048,           # model width D
        num_heads=16,               # MLA heads
        num_kv_heads=16,            # = num_heads (MLA)
        mlp_dim=10944,              # the dense first block's SwiGLU width
        vocab_size=102400,          # DeepSeek tokenizer vocabulary
        attention="mla",            # multi-head latent attention (q projected directly: no
                                    # q_lora_rank)
        kv_lora_rank=512,           # compressed KV latent
        qk_nope_head_dim=128,       # per-head q/k dims without RoPE
        qk_rope_head_dim=64,        # per-head q/k dims with RoPE
        v_head_dim=128,             # per-head value dim
        rope_scaling="yarn",        # 4k -> 160k context
        rope_factor=40.0,
        rope_original_max_len=4096,
        rope_mscale=0.707,
        rope_mscale_all_dim=0.707,
        n_routed_experts=64,        # routed experts per MoE layer
        n_shared_experts=2,         # shared experts
        moe_intermediate_size=1408,  # expert width
        num_experts_per_tok=6,      # top-6, greedy (no group limit), softmax router (V2)
        first_k_dense_replace=1,    # layer 0 dense
        aux_loss_alpha=0.001,       # V2's expert-level balance loss weight
        bias_update_speed=0.0,      # no correction bias with a softmax router
        expert_parallel=True,       # experts over `data`, all-to-all dispatch
        moe_impl="auto",            # dropless: sorted rows, grouped GEMMs (docs/moe.md)
    ))
    c.mesh.update(dict(data=8, tensor=1, fsdp=False))  # 8 GPUs: 8 experts each
    # optim.lr: deepseek_7b's, which is V2-Lite's published peak learning rate too
    return c
