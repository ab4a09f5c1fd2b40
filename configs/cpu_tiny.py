"""The embedded default: a tiny DeepSeek-architecture model on 8 simulated CPU devices.

Run:    make train        (= python launch.py --workdir runs/cpu_tiny)
Prints: a progress line every 25 steps (loss falling from ~6.2 to ~1.6 nats/token), then the
        held-out loss, perplexity and bits per byte, and a sample of Python-like text
        (temperature 0.8, top-p 0.9).
Sets only what differs from the defaults in dsjax/config/sections.py; every field there can be
overridden (`--config.SECTION.FIELD=VALUE`).
"""

from dsjax.config import defaults


def get_config(arg=None):
    del arg
    c = defaults()
    c.model.update(dict(
        num_layers=6,        # decoder blocks (scanned)
        hidden_size=256,     # model width D
        num_heads=8,         # query heads H (head_dim = 32)
        num_kv_heads=4,      # kv heads N: grouped-query attention, 2 query heads per kv head
        mlp_dim=832,         # SwiGLU hidden width F (divisible by mesh.tensor)
        vocab_size=512,      # 257 byte-tokenizer ids, padded so it divides mesh.tensor
    ))
    c.mesh.update(dict(
        data=2,              # data-parallel size
        tensor=2,            # tensor-parallel size (heads, MLP, vocab)
        pipeline=2,          # pipeline stages: 3 layers each, 1f1b (docs/pipeline.md);
                             # --config.mesh.data=4 --config.mesh.pipeline=1 runs unpipelined
    ))
    c.data.update(dict(
        seq_len=128,         # tokens per row
        global_batch=16,     # rows per step across all devices
        eval_batches=16,     # held-out batches per evaluation
    ))
    c.train.update(dict(
        steps=600,           # optimizer steps (compute_dtype float32: CPUs have no fast bf16)
        log_every=25,        # steps between progress lines / metrics.jsonl records
        sample_tokens=96,    # tokens of the sample printed after training
    ))
    c.optim.update(dict(
        lr=3e-3,             # peak learning rate
        warmup_steps=50,     # linear warmup steps
        freeze_step=120,     # --config.optim.name=onebit_adam: exact Adam for 20% of the steps
                             # (its other settings: +0.5% over AdamW's held-out loss here,
                             # docs/onebit.md)
    ))
    c.pipeline.microbatches = 4  # per step (a multiple of mesh.pipeline; divides the batch)
    c.checkpoint.update(dict(
        every=200,           # steps between checkpoints (and one at the end)
        keep=2,              # checkpoints kept
    ))
    c.metrics.profile_every = 200  # trace one step every N steps: communication share
    return c
