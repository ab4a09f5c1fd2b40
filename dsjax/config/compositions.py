"""What does not combine with what: every rule that two valid settings cannot be on together.

The one idea: this is the one list to read before switching features on together (the README's
"what does not combine"). Each rule is one `if`, and its `ConfigError` names the field to change
and says why. It runs after every section passed its own checks (validate.py), so a rule may rely
on each section being well-formed (e.g. the layers split into pipeline chunks).
"""

from __future__ import annotations

from dsjax import remat
from dsjax.config.sections import (HAND_BACKWARD_SCHEDULES, INTERLEAVED_SCHEDULES,
                                   TRAINABLE_GROUPS, Config, chunks_per_stage, trainable_groups)
from dsjax.errors import ConfigError


def warnings(cfg: Config) -> list[str]:
    """Settings that combine but are probably not meant (the run logs each as a warning at its
    start; docs/onebit.md says why these are warnings and not errors)."""
    out = []
    o = cfg.optim
    if o.name == "onebit_adam" and o.freeze_step < o.warmup_steps:
        out.append(f"optim.freeze_step {o.freeze_step} < optim.warmup_steps {o.warmup_steps}: "
                   f"1-bit Adam freezes v while the learning rate is still warming up, on "
                   f"early gradients larger than the later ones (DeepSpeed freezes after the "
                   f"warmup); set freeze_step >= warmup_steps unless this is a short test")
    return out


def compositions(cfg: Config) -> None:
    """Raises a ConfigError for the first pair of settings that does not combine."""
    m, o, f, S = cfg.model, cfg.optim, cfg.fp8, cfg.mesh.pipeline
    fp8 = cfg.train.compute_dtype == "fp8"

    # Architecture.
    if m.attention == "mla" and m.num_kv_heads != m.num_heads:
        raise ConfigError(f"model.num_kv_heads: mla expands its latent to every head; set it "
                          f"to num_heads {m.num_heads}, got {m.num_kv_heads}")
    if m.rope_scaling == "yarn" and m.attention != "mla":
        raise ConfigError("model.rope_scaling: yarn is implemented for attention='mla' only")
    if m.expert_parallel and not m.is_moe:
        raise ConfigError("model.expert_parallel: needs routed experts (model.n_routed_experts); "
                          "a dense model has no experts to place over `data`")
    if (fp8 and m.is_moe and m.moe_impl != "capacity"
            and {"gate", "up", "down"} & set(f.matmul_names)):
        # The padded tile loop scales per expert (current or delayed); per-row scales
        # (rowwise) and ragged_dot's fp8 backward are not written for the grouped GEMMs.
        if m.moe_impl == "ragged":
            raise ConfigError("model.moe_impl: fp8 routed experts run in the padded grouped "
                              "GEMMs, not ragged ('auto' picks padded on CPU and GPU); use "
                              "moe_impl='padded', or leave gate, up, down out of fp8.matmuls")
        if f.recipe == "rowwise":
            raise ConfigError(f"fp8.recipe: 'rowwise' for routed experts needs "
                              f"model.moe_impl='capacity'; the grouped GEMMs ({m.moe_impl!r}) "
                              f"scale each expert with the 'current' or 'delayed' recipe")

    # 1-bit Adam.
    if o.hierarchical and o.name != "onebit_adam":
        raise ConfigError(f"optim.hierarchical: only optim.name='onebit_adam' has a hierarchical "
                          f"reduction; got optim.name={o.name!r}")
    if o.name == "onebit_adam" and cfg.mesh.fsdp:
        raise ConfigError("mesh.fsdp: optim.name='onebit_adam' needs parameters and optimizer "
                          "state replicated over `data` (each worker compresses its own "
                          "momentum of the whole model); set mesh.fsdp=False")
    if o.name == "onebit_adam" and cfg.mesh.data == 1:
        # One worker: nothing to compress, and the frozen-v compressed steps only lose accuracy.
        raise ConfigError("mesh.data: optim.name='onebit_adam' compresses the data-parallel "
                          "gradient reduction, and mesh.data is 1 (nothing to reduce); use "
                          "optim.name='adamw', or mesh.data >= 2")
    if o.name == "onebit_adam" and m.is_moe and not m.expert_parallel:
        # Expert parallelism's experts are each device's own (exact Adam, docs/onebit.md); the
        # dense fallback would need every expert on every worker of 1-bit Adam's step.
        raise ConfigError("model.expert_parallel: optim.name='onebit_adam' trains a MoE model's "
                          "experts where they live, one slice per `data` device, which needs "
                          "the all-to-all dispatch; set expert_parallel=True (or use adamw)")

    if o.name == "onebit_adam" and trainable_groups(cfg.train.trainable) != TRAINABLE_GROUPS:
        # Its compressed buckets and error buffers span every parameter (docs/multimodal.md).
        raise ConfigError(f"train.trainable: optim.name='onebit_adam' trains every parameter "
                          f"group; freezing some ({cfg.train.trainable!r}) needs "
                          f"optim.name='adamw' (stage 1 of a vision-language run is short)")

    # Preference training (DPO, docs/posttraining.md).
    if cfg.train.task == "dpo":
        if not cfg.checkpoint.init_from:
            # The reference is the starting policy: from random weights both policies are noise
            # and the implicit rewards measure nothing.
            raise ConfigError("checkpoint.init_from: train.task='dpo' trains against the frozen "
                              "weights it starts from; name a pretrained or SFT checkpoint "
                              "(DPO from random weights is meaningless)")
        if S > 1:
            raise ConfigError("mesh.pipeline: train.task='dpo' needs the unpipelined model (the "
                              "schedules compute the token loss inside their last stage, not "
                              "per-sequence log-probs and a reference pass); set mesh.pipeline=1")
        if o.name == "onebit_adam":
            raise ConfigError("optim.name: train.task='dpo' runs on the adamw step (1-bit Adam's "
                              "step differentiates inside its own shard_map, with no reference "
                              "pass); use optim.name='adamw'")

    # Context parallelism (docs/context.md).
    if cfg.mesh.context > 1:
        if m.attention_impl not in ("auto", "flash"):
            # The split rows attend through dsjax's flash blocks, which take every query's and
            # key's global index; the other kernels assume one whole causal row.
            raise ConfigError(f"model.attention_impl: mesh.context > 1 runs the flash blocks "
                              f"over the split sequence; set 'flash' or 'auto', got "
                              f"{m.attention_impl!r}")
        if cfg.vision.enabled:
            raise ConfigError("mesh.context: vision-language rows place image features at their "
                              "placeholder tokens in row order, which the context layout "
                              "permutes; set mesh.context=1 for a vision model")
        if m.context_impl == "ring" and S > 1 and cfg.pipeline.schedule in HAND_BACKWARD_SCHEDULES:
            # Measured: XLA:CPU crashes (segfault) running the ring's collective-permutes inside
            # the 1F1B ticks; not yet run on a GPU.
            raise ConfigError(f"model.context_impl: 'ring' inside the {cfg.pipeline.schedule!r} "
                              f"schedule crashes XLA:CPU; use context_impl='all_gather', or "
                              f"pipeline.schedule 'gpipe' / 'circular'")

    if cfg.remat.policy == "auto" and cfg.remat.layers != "all":
        raise ConfigError("remat.layers: 'auto' chooses the layer pattern too; leave "
                          "remat.layers at 'all'")

    # Pipeline parallelism.
    p = cfg.pipeline
    if p.repeats > 1 and p.schedule not in INTERLEAVED_SCHEDULES:
        raise ConfigError(f"pipeline.repeats: only the schedules {INTERLEAVED_SCHEDULES} "
                          f"interleave layer chunks; got repeats={p.repeats} with schedule "
                          f"{p.schedule!r}")
    if S == 1:
        return
    # A MoE model's dense first blocks run on stage 0 before the stages (dsjax/pipeline/).
    k = m.first_k_dense_replace if m.is_moe else 0
    # Every stage runs one program, so every chunk of layers must make the same choices.
    chunks = S * chunks_per_stage(p.schedule, p.repeats)
    chunk = (m.num_layers - k) // chunks
    if cfg.remat.policy != "auto":
        per_layer = remat.layer_policies(cfg.remat.policy, cfg.remat.layers, m.num_layers)[k:]
        if per_layer != per_layer[:chunk] * chunks:
            # Recomputation decides what a layer saves for the backward; a choice made at run
            # time (per stage) would have to save for both, so the pattern must repeat.
            fits = ", ".join(["all"] + [f"every_{d}" for d in range(1, chunk + 1)
                                        if chunk % d == 0])
            raise ConfigError(f"remat.layers: the per-layer pattern {cfg.remat.layers!r} differs "
                              f"between pipeline chunks of {chunk} layers (every stage runs one "
                              f"program); use a period that divides {chunk}: {fits}, or a list "
                              f"that repeats every {chunk} layers")
    if fp8:
        if f.recipe == "delayed" and p.schedule not in HAND_BACKWARD_SCHEDULES:
            # jax.grad would sum each stage's amax observations over the ticks, not max them.
            raise ConfigError(f"fp8.recipe: 'delayed' needs pipeline.schedule '1f1b' or "
                              f"'interleaved_1f1b' (which max-combine their amax observations "
                              f"themselves), got {p.schedule!r}; or use 'current' / 'rowwise'")
