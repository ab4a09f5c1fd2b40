"""The embedded post-training default: cpu_tiny's model pretrained, fine-tuned on chat (SFT),
then aligned on preference pairs (DPO), on a chat task whose answers are checked exactly:
one-step arithmetic word problems (dsjax/data/arithmetic_chat.py), all on 8 simulated CPU
devices, offline.

Run:    python launch.py --config configs/cpu_sft.py --workdir runs/cpu_sft
Prints: the stages' progress lines, and exact match on 100 held-out prompts before SFT (0),
        after SFT and after DPO, with DPO's reward accuracy; WORKDIR/summary.json carries
        sft_exact_match_before, sft_exact_match, dpo_exact_match, dpo_reward_accuracy.
With runs/cpu_tiny holding a `make train` checkpoint, that run is the starting point and the
pretrain stage is skipped. docs/posttraining.md has what was measured.
"""

from dsjax.config import defaults


def get_config(arg=None):
    del arg
    c = defaults()
    c.model.update(dict(    # cpu_tiny's model, so that its checkpoint can be the start
        num_layers=6,        # decoder blocks (scanned)
        hidden_size=256,     # model width D
        num_heads=8,         # query heads H (head_dim = 32)
        num_kv_heads=4,      # kv heads N: grouped-query attention
        mlp_dim=832,         # SwiGLU hidden width F
        vocab_size=512,      # 257 byte-tokenizer ids, padded so it divides mesh.tensor
    ))
    c.mesh.update(dict(
        data=4,              # data-parallel size
        tensor=2,            # tensor-parallel size; no pipeline: DPO does not pipeline
        pipeline=1,
    ))
    c.data.update(dict(
        seq_len=224,         # tokens per row: three conversations of 67-77 byte tokens (94%
                             # of the row), or one preference pair
        global_batch=8,      # rows per step across all devices
        eval_batches=4,      # held-out batches per evaluation (each stage's own split)
    ))
    c.train.update(dict(
        log_every=25,        # steps between progress lines / metrics.jsonl records
        sample_tokens=96,    # the pretrain stage's sample (the chat stages score instead)
    ))
    c.optim.update(dict(
        lr=3e-3,             # pretrain stage: peak learning rate (as cpu_tiny)
        warmup_steps=20,     # linear warmup steps of every stage
    ))
    c.checkpoint.update(dict(
        every=0,             # checkpoints only at each stage's end
        keep=1,
    ))
    c.posttrain.update(dict(
        recipe="pretrain,sft,dpo",  # the stages, each a run under WORKDIR/<stage>
        start_from="runs/cpu_tiny",  # skip pretraining when `make train` has run
        pretrain_steps=100,  # steps on the stdlib corpus
        sft_steps=400,       # steps on the arithmetic conversations
        sft_lr=2e-3,         # SFT peak learning rate
        dpo_steps=60,        # steps on the preference pairs (logged every 3)
        dpo_lr=2e-5,         # DPO peak learning rate
        eval_prompts=100,    # held-out prompts scored by exact match
    ))
    return c
