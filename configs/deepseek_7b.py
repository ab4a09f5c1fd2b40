"""DeepSeek-LLM-7B shapes: 30 layers, 4096 hidden, 32 heads (MHA), 11008 MLP, vocab 102400, seq 4096.

6,910,365,696 parameters. Needs GPUs and a prepared corpus tokenized with the DeepSeek tokenizer:
  python -m dsjax.data.prepare --input corpus.jsonl --format jsonl --tokenizer tokenizer.json --out data/ds
  python launch.py --config configs/deepseek_7b.py --config.data.path=data/ds --workdir runs/ds7b
Prints: one progress line every 10 steps with loss, tokens/s, ms/step and MFU against the bf16 peak.
Sets only what differs from the defaults in dsjax/config/sections.py.

`configs/deepseek_7b.py:long`: rows of 65,536 tokens on the same 8 GPUs, each row split over
mesh.context = 2 (zigzag, all_gather; docs/context.md) with tensor 4 and full recomputation;
8 rows a step, one at a time (accumulation). Its per-device memory, predicted from the compiled
step: python benchmarks/context_table.py --config configs/deepseek_7b.py:long --model
"""

from dsjax.config import defaults


def get_config(arg=None):
    c = defaults()
    c.model.update(dict(
        num_layers=30,          # decoder blocks
        hidden_size=4096,       # model width D
        num_heads=32,           # query heads (head_dim 128)
        num_kv_heads=32,        # multi-head attention (7B has no GQA)
        mlp_dim=11008,          # SwiGLU hidden width
        vocab_size=102400,      # DeepSeek tokenizer vocabulary
    ))
    # 8 GPUs, ZeRO-3 over data. Multi-node: data spans the hosts, tensor stays inside one.
    c.mesh.update(dict(tensor=8, fsdp=True))
    c.data.update(dict(
        source="prepared",      # a directory written by `python -m dsjax.data.prepare`
        path="data/deepseek",   # with train/ and eval/ splits
        seq_len=4096,           # tokens per row
        global_batch=64,        # rows per step
        eval_batches=16,        # held-out batches per evaluation
    ))
    c.train.update(dict(
        steps=1000,             # optimizer steps
        compute_dtype="bfloat16",  # bf16 matmuls, float32 master weights
        sample_tokens=32,       # greedy sample after training
    ))
    c.optim.update(dict(
        lr=4.2e-4,              # DeepSeek-LLM 7B peak lr
        freeze_step=200,        # 1-bit Adam: exact Adam steps before compression (20% of steps)
    ))
    c.remat.policy = "full"     # recompute each block: 7B activations at 4k are large
    c.pipeline.microbatches = 8  # when mesh.pipeline > 1 (docs/pipeline.md)
    c.checkpoint.every = 200    # steps between checkpoints
    c.metrics.profile_every = 100  # trace one step every N steps: communication share
    if arg == "long":
        # 64k-token rows: the sequence split over 2 devices, heads over 4; each device holds
        # 32,768 tokens of a row. fsdp has no `data` axis to shard over here (data = 1).
        c.mesh.update(dict(data=1, tensor=4, context=2, fsdp=False))
        c.model.context_impl = "all_gather"  # keys and values whole (MHA: 1 GiB a layer, bf16)
        c.data.update(dict(seq_len=65536, global_batch=8))
        c.batch.micro_batch = 1  # one row per micro-step, 8 accumulated: 512k tokens a step
    return c
