"""The embedded default: a tiny DeepSeek-architecture model on 8 simulated CPU devices.

Run:    make train        (= python launch.py --workdir runs/cpu_tiny)
Prints: a progress line every 25 steps (loss falling from ~6.2 to ~1.6 nats/token), then the
        held-out loss, perplexity and bits per byte, and a greedy sample of Python-like text.
"""

from ml_collections import ConfigDict


def get_config(arg=None):
    del arg
    c = ConfigDict()
    c.model = ConfigDict(dict(
        num_layers=6,        # decoder blocks (scanned)
        hidden_size=256,     # model width D
        num_heads=8,         # query heads H (head_dim = 32)
        num_kv_heads=4,      # kv heads N: grouped-query attention, 2 query heads per kv head
        mlp_dim=832,         # SwiGLU hidden width F (divisible by mesh.tensor)
        vocab_size=512,      # 257 byte-tokenizer ids, padded so it divides mesh.tensor
        rope_theta=10000.0,  # rotary base
        norm_eps=1e-6,       # RMSNorm epsilon
        init_std=0.02,       # normal init std of every matrix
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
    c.mesh = ConfigDict(dict(
        data=2,              # data-parallel size
        tensor=2,            # tensor-parallel size (heads, MLP, vocab)
        pipeline=2,          # pipeline stages: 3 layers each, 1f1b (docs/pipeline.md);
                             # --config.mesh.data=4 --config.mesh.pipeline=1 runs unpipelined
        fsdp=False,          # also shard params/optimizer state over `data`
        dcn_data=0,          # hosts `data` spans (0: one per process; docs/multihost.md)
        dcn_pipeline=1,      # hosts `pipeline` spans
        xla_profile="none",  # XLA flag profile: none | overlap (GPU comm/compute overlap)
    ))
    c.data = ConfigDict(dict(
        source="stdlib",     # the Python standard library's own .py files, byte tokens
        path="",             # cache dir for the corpus ("" = WORKDIR/data/stdlib)
        tokenizer="byte",    # byte-level tokens
        seq_len=128,         # tokens per row
        global_batch=16,     # rows per step across all devices
        eval_batches=16,     # held-out batches per evaluation
        prefetch=2,          # batches prefetched by Grain
    ))
    c.train = ConfigDict(dict(
        steps=600,           # optimizer steps
        log_every=25,        # steps between progress lines / metrics.jsonl records
        seed=0,              # init and data-order seed
        compute_dtype="float32",  # CPUs have no fast bf16 matmul
        eval_every=0,        # 0: evaluate only at the end
        sample_prompt="def ",  # greedy sample prompt printed after training
        sample_tokens=96,    # tokens to generate
        nonfinite="stop",    # non-finite loss/gradient: stop | skip (float16 always skips)
        max_consecutive_skips=10,  # stop after this many skipped steps in a row
        loss_scale_init=32768.0,   # float16 dynamic loss scale: initial value
        loss_scale_growth=2000,    # float16: double the scale after this many finite steps
    ))
    c.optim = ConfigDict(dict(
        name="adamw",        # optimizer
        lr=3e-3,             # peak learning rate
        warmup_steps=50,     # linear warmup steps
        min_lr_ratio=0.1,    # cosine decays to lr * this
        b1=0.9, b2=0.95, eps=1e-8,  # Adam moments
        weight_decay=0.1,    # decoupled weight decay (not on norms)
        clip_norm=1.0,       # global-norm gradient clipping (0 = off)
        # 1-bit Adam (name="onebit_adam"; docs/onebit.md). Not used by adamw.
        freeze_step=120,     # exact Adam steps before v freezes and 1-bit compression starts (20%)
        bucket_mb=0.0,       # MiB per compressed all-reduce; 0 = one per tensor (converges best)
        bias_correction=False,  # Adam's bias correction (False = DeepSpeed's OnebitAdam)
        error_feedback=True,    # carry each step's compression error into the next (ablation: off)
        compress="update",      # 1-bit all-reduce of m / sqrt(v) (momentum: DeepSpeed's m)
        refresh_every=10,       # every N-th step after the freeze is exact and updates v (0: never)
        refresh_catchup=True,   # a refresh weighs g^2 as the N steps since the last (1 - b2^N)
        update_bound=True,      # clip |m / sqrt(v)| to what exact Adam can reach (False: DeepSpeed)
                                # all three: +0.5% over AdamW's held-out loss here, docs/onebit.md
        hierarchical=False,     # exact inside a host, 1-bit across hosts (needs >= 2 hosts)
    ))
    c.fp8 = ConfigDict(dict(
        recipe="current",    # current | delayed | rowwise scaling (when compute_dtype = fp8)
        history_len=1024,    # delayed: amax history length
        margin=0.0,          # delayed: scale headroom in powers of two
        matmuls="q,k,v,o,gate,up,down",  # projections run as fp8 GEMMs
        keep_first_layers=0,  # first N layers stay in other_dtype
        keep_last_layers=0,   # last N layers stay in other_dtype
        other_dtype="bfloat16",  # dtype of everything not in fp8
    ))
    c.remat = ConfigDict(dict(
        policy="none",       # none | full | dots | dots_no_batch | attention_core | names:.. | auto
        layers="all",        # all | every_N | one policy per layer, comma-separated
        memory_budget_gb=0.0,  # "auto": per-device budget (0 = 90% of device memory)
    ))
    c.pipeline = ConfigDict(dict(
        schedule="1f1b",     # gpipe | circular | 1f1b (used when mesh.pipeline > 1)
        microbatches=4,      # microbatches per step (a multiple of mesh.pipeline; divides the batch)
        repeats=1,           # circular only: interleaved layer chunks per stage
    ))
    c.batch = ConfigDict(dict(
        policy="fixed",      # fixed | ramp | adaptive global batch size
        ladder="",           # allowed global batch sizes, comma-separated ("" = data.global_batch)
        reference_batch=0,   # the batch optim.lr is tuned for (0 = data.global_batch)
        lr_scaling="sqrt",   # lr rescaling on a batch change: none | linear | sqrt
        micro_batch=0,       # rows per data replica per micro-step (0 = largest that fits memory)
        mem_fraction=0.9,    # memory budget: fraction of device memory (and adaptive's threshold)
        device_memory_gb=0.0,  # per-device memory (0 = the device's own limit; CPU has none)
        ramp="",             # ramp: "tokens:batch,..." (linear between points, snapped to the ladder)
        grow=1.5,            # adaptive: grow factor while memory and step time allow
        shrink=0.8,          # adaptive: shrink factor when memory passes mem_fraction
        target_step_ms=0.0,  # adaptive: grow only while steps are faster (0 = no time rule)
        patience=3,          # adaptive: agreeing readings before a change; ramp: steps of lookahead
        cooldown=10,         # adaptive: steps after a change before the next
    ))
    c.checkpoint = ConfigDict(dict(
        every=200,           # steps between checkpoints (and one at the end)
        keep=2,              # checkpoints kept
        async_save=True,     # save in the background
        init_from="",        # start weights from another checkpoint (e.g. a converted HF model)
    ))
    c.metrics = ConfigDict(dict(
        peak_flops_per_device=0.0,  # 0: measure a CPU matmul rate (MFU is relative to it)
        tensorboard=True,    # write tensorboard/ event files
        profile_every=200,   # trace one step every N steps: communication share (0 = off)
    ))
    return c
