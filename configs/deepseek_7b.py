"""DeepSeek-LLM-7B shapes: 30 layers, 4096 hidden, 32 heads (MHA), 11008 MLP, vocab 102400, seq 4096.

6,910,365,696 parameters. Needs GPUs and a prepared corpus tokenized with the DeepSeek tokenizer:
  python -m dsjax.data.prepare --input corpus.jsonl --format jsonl --tokenizer tokenizer.json --out data/ds
  python launch.py --config configs/deepseek_7b.py --config.data.path=data/ds --workdir runs/ds7b
Prints: one progress line every 10 steps with loss, tokens/s, ms/step and MFU against the bf16 peak.
"""

from ml_collections import ConfigDict


def get_config(arg=None):
    del arg
    c = ConfigDict()
    c.model = ConfigDict(dict(
        num_layers=30,          # decoder blocks
        hidden_size=4096,       # model width D
        num_heads=32,           # query heads (head_dim 128)
        num_kv_heads=32,        # multi-head attention (7B has no GQA)
        mlp_dim=11008,          # SwiGLU hidden width
        vocab_size=102400,      # DeepSeek tokenizer vocabulary
        rope_theta=10000.0,     # rotary base
        norm_eps=1e-6,          # RMSNorm epsilon
        init_std=0.02,          # init std (initializer_range of the HF config)
    ))
    c.mesh = ConfigDict(dict(data=1, tensor=8, pipeline=1, fsdp=True))  # 8 GPUs, ZeRO-3 over data
    c.data = ConfigDict(dict(
        source="prepared",      # a directory written by `python -m dsjax.data.prepare`
        path="data/deepseek",   # with train/ and eval/ splits
        tokenizer="byte",       # informational; the prepared split records its tokenizer
        seq_len=4096,           # tokens per row
        global_batch=64,        # rows per step
        eval_batches=16,        # held-out batches per evaluation
        prefetch=2,             # batches prefetched by Grain
    ))
    c.train = ConfigDict(dict(
        steps=1000, log_every=10, seed=0,   # optimizer steps, logging cadence, seed
        compute_dtype="bfloat16",           # bf16 matmuls, float32 master weights
        eval_every=0,                       # evaluate only at the end
        sample_prompt="def ", sample_tokens=32,  # greedy sample after training
        nonfinite="stop", max_consecutive_skips=10,  # non-finite steps: stop | skip
        loss_scale_init=32768.0, loss_scale_growth=2000,  # float16 dynamic loss scaling
    ))
    c.optim = ConfigDict(dict(
        name="adamw", lr=4.2e-4, warmup_steps=100, min_lr_ratio=0.1,  # DeepSeek-LLM 7B peak lr
        b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0,
        freeze_step=200,        # 1-bit Adam: exact Adam steps before compression (20% of steps)
        bucket_mb=0.0,          # 1-bit Adam: one compressed all-reduce per tensor (DeepSpeed)
        bias_correction=False,  # 1-bit Adam: no bias correction, as DeepSpeed
        error_feedback=True,    # 1-bit Adam: carry the compression error into the next step
    ))
    c.fp8 = ConfigDict(dict(
        recipe="current",       # per-tensor current scaling (when compute_dtype = fp8)
        history_len=1024, margin=0.0,  # delayed scaling settings
        matmuls="q,k,v,o,gate,up,down",  # projections run as fp8 GEMMs
        keep_first_layers=0, keep_last_layers=0,  # layers kept in other_dtype
        other_dtype="bfloat16",  # embedding, head, attention core, norms stay higher precision
    ))
    c.remat = ConfigDict(dict(
        policy="full",          # recompute each block: 7B activations at 4k are large
        layers="all",           # every layer
        memory_budget_gb=0.0,   # only for policy "auto"
    ))
    c.pipeline = ConfigDict(dict(schedule="gpipe", microbatches=1, repeats=1))
    c.batch = ConfigDict(dict(policy="fixed", ladder=""))
    c.checkpoint = ConfigDict(dict(every=200, keep=3, async_save=True, init_from=""))
    c.metrics = ConfigDict(dict(
        peak_flops_per_device=0.0,  # 0: the device's datasheet bf16 peak
        tensorboard=True,        # write tensorboard/ event files
        profile_every=100,       # trace one step every N steps: communication share
    ))
    return c
