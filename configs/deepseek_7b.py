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
        # DeepSeek-V2/V3 architecture (docs/moe.md); these values mean standard attention, dense.
        attention="mha",     # mha (grouped-query) | mla (multi-head latent attention)
        q_lora_rank=0,       # mla: query compression rank (0 = plain q projection)
        kv_lora_rank=0,      # mla: compressed KV latent width
        qk_nope_head_dim=0,  # mla: per-head q/k dims without RoPE
        qk_rope_head_dim=0,  # mla: per-head q/k dims with decoupled RoPE
        v_head_dim=0,        # mla: per-head value dim
        rope_scaling="none",  # mla: none | yarn
        rope_factor=1.0,     # yarn: context extension factor
        rope_original_max_len=0,  # yarn: pretraining context length
        rope_beta_fast=32.0,  # yarn: ramp boundary (rotations), extrapolated above
        rope_beta_slow=1.0,  # yarn: ramp boundary (rotations), interpolated below
        rope_mscale=1.0,     # yarn: RoPE'd q/k temperature term
        rope_mscale_all_dim=0.0,  # yarn: softmax-scale temperature term (0 = off)
        n_routed_experts=0,  # MoE: routed experts per MoE layer (0 = dense model)
        n_shared_experts=0,  # MoE: shared experts
        moe_intermediate_size=0,  # MoE: hidden width of one expert
        num_experts_per_tok=0,  # MoE: experts per token (top-k)
        n_group=1,           # MoE: expert groups (group-limited routing)
        topk_group=1,        # MoE: groups a token may use
        routed_scaling_factor=1.0,  # MoE: routed output multiplier
        scoring="softmax",   # MoE router: softmax (V2) | sigmoid + correction bias (V3)
        norm_topk_prob=False,  # MoE: normalise the top-k weights
        first_k_dense_replace=0,  # MoE: leading layers that keep the dense MLP
        aux_loss_alpha=0.0,  # MoE: sequence-wise balance loss weight (0 = off)
        bias_update_speed=0.001,  # MoE sigmoid: aux-loss-free bias step gamma (0 = off)
        expert_parallel=False,  # MoE: all-to-all dispatch with experts over `data`
        capacity_factor=0.0,  # MoE: expert capacity factor (0 = dropless)
        num_mtp_layers=0,    # multi-token prediction modules (0 = off)
        mtp_loss_weight=0.3,  # MTP loss weight
    ))
    c.mesh = ConfigDict(dict(data=1, tensor=8, pipeline=1, fsdp=True))  # 8 GPUs, ZeRO-3 over data
    # Multi-node: data spans the hosts (0: one per process), tensor stays inside one; XLA defaults.
    c.mesh.update(dict(dcn_data=0, dcn_pipeline=1, xla_profile="none"))
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
        compress="update",      # 1-bit Adam: all-reduce m / sqrt(v) (momentum: DeepSpeed's m)
        refresh_every=10,       # 1-bit Adam: every 10th step after the freeze exact, v refreshed
                                # (0: v frozen, DeepSpeed; docs/onebit.md: +8.2% vs +0.5% on cpu_tiny)
        refresh_catchup=True,   # 1-bit Adam: a refresh weighs g^2 as the K steps since the last
        update_bound=True,      # 1-bit Adam: clip |m / sqrt(v)| to exact Adam's bound (stale v)
        hierarchical=False,     # 1-bit Adam: exact inside a node, 1-bit across nodes (multi-node)
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
    # Used when mesh.pipeline > 1 (docs/pipeline.md): 1F1B keeps activation memory flat in M.
    c.pipeline = ConfigDict(dict(schedule="1f1b", microbatches=8, repeats=1))
    c.batch = ConfigDict(dict(
        policy="fixed",         # fixed | ramp | adaptive global batch size (docs/batching.md)
        ladder="",              # allowed global batch sizes ("" = data.global_batch)
        reference_batch=0,      # the batch optim.lr is tuned for (0 = data.global_batch)
        lr_scaling="sqrt",      # lr rescaling on a batch change: none | linear | sqrt
        micro_batch=0,          # rows per data replica per micro-step (0 = largest that fits)
        mem_fraction=0.9,       # memory budget: fraction of device memory (adaptive's threshold)
        device_memory_gb=0.0,   # per-device memory (0 = the device's own limit)
        ramp="",                # ramp: "tokens:batch,..." points, e.g. "0:64,1e9:256"
        grow=1.5,               # adaptive: grow factor
        shrink=0.8,             # adaptive: shrink factor
        target_step_ms=0.0,     # adaptive: grow only while steps are faster (0 = no time rule)
        patience=3,             # adaptive: agreeing readings before a change; ramp: lookahead
        cooldown=10,            # adaptive: steps after a change before the next
    ))
    c.checkpoint = ConfigDict(dict(every=200, keep=3, async_save=True, init_from=""))
    c.metrics = ConfigDict(dict(
        peak_flops_per_device=0.0,  # 0: the device's datasheet bf16 peak
        tensorboard=True,        # write tensorboard/ event files
        profile_every=100,       # trace one step every N steps: communication share
    ))
    return c
