"""Model FLOPs per token, and the peak that MFU is measured against.

FLOPs convention (stated once, used everywhere): training FLOPs per token =
  6 * N_matmul                      (forward 2N + backward 4N over every matmul weight a token
                                     passes, incl. the output head; the embedding lookup is a
                                     gather, not a matmul; MoE: shared + top-k routed experts)
+ 6 * L * S * H * K                 (attention scores and context: 12 * L * S * H * K for full
                                     attention, halved because the mask is causal; MLA: K is the
                                     mean of the qk and v head dims)
+ vision: per image slot of a row, 6 * the tower's and projector's matmul weights each patch /
  projected token passes + 12 * L_v * P^2 * D_v (full attention over P patches), divided by
  seq_len: every slot counts, filled or not, as the compiled step runs them all
MFU = achieved model FLOPs/s / (peak FLOPs/s per device * devices). On CPU there is no datasheet
peak: we measure a float32 matmul rate on this machine once and label MFU as relative to it.
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig, VisionConfig

# Dense bf16 peak per device (FLOP/s), from vendor datasheets (no sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _attention_params(cfg: ModelConfig) -> int:
    D, H = cfg.hidden_size, cfg.num_heads
    if cfg.attention != "mla":
        N, K = cfg.num_kv_heads, cfg.resolved_head_dim
        return D * H * K * 2 + D * N * K * 2  # q, o; k, v
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk) if cfg.q_lora_rank else D * H * qk
    kv = (D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # latent + the shared RoPE key
          + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    return q + kv + H * cfg.v_head_dim * D


def _mlp_params(cfg: ModelConfig, moe: bool) -> int:
    D = cfg.hidden_size
    if not moe:
        return 3 * D * cfg.mlp_dim
    width = (cfg.n_shared_experts + cfg.num_experts_per_tok) * cfg.moe_intermediate_size
    return 3 * D * width + D * cfg.n_routed_experts  # shared + the top-k routed; the router


def matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights one token passes through (MoE: only its top-k routed experts), output
    head included, embedding excluded; multi-token prediction modules included."""
    D = cfg.hidden_size
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace if cfg.is_moe else 0
    layers = (cfg.num_layers * _attention_params(cfg) + moe_layers * _mlp_params(cfg, True)
              + (cfg.num_layers - moe_layers) * _mlp_params(cfg, False))
    mtp_block = 2 * D * D + _attention_params(cfg) + _mlp_params(cfg, cfg.is_moe)
    return layers + D * cfg.vocab_size + cfg.num_mtp_layers * (mtp_block + D * cfg.vocab_size)


def cost_per_million_tokens(cost_per_device_hour: float, devices: int,
                            tokens_per_sec: float) -> float:
    """What a million training tokens cost at `cost_per_device_hour` (metrics.cost_per_gpu_hour)
    for `devices` devices running at `tokens_per_sec` in all."""
    return cost_per_device_hour * devices / 3600.0 / tokens_per_sec * 1e6


def vision_flops_per_image(v: VisionConfig, model_width: int) -> float:
    """Training FLOPs of one image slot through the tower and the projector."""
    patches, D = (v.image_size // v.patch_size) ** 2, v.hidden_size
    tower = (v.patch_size ** 2 * 3 * D  # the patch embedding
             + v.num_layers * (4 * D * D + 2 * D * v.mlp_dim))
    merged = 4 if v.projector == "downsample_mlp" else 1  # 2 x 2 patches per projected token
    projector = (patches // merged) * (merged * D * model_width + model_width * model_width)
    attention = 12 * v.num_layers * patches * patches * D
    return 6 * (patches * tower + projector) + attention


def flops_per_token(cfg: ModelConfig, seq_len: int, vision: VisionConfig | None = None
                    ) -> float:
    """Training (forward + backward) model FLOPs per token, causal attention; with a vision
    tower, its FLOPs per row (`vision.max_images` slots) spread over the row's tokens."""
    if cfg.attention == "mla":  # scores over qk dims, context over v dims
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        qk = v = cfg.resolved_head_dim
    layers = cfg.num_layers + cfg.num_mtp_layers
    attention = 3 * layers * seq_len * cfg.num_heads * (qk + v)
    text = 6 * matmul_params(cfg) + attention
    if vision is None or not vision.enabled:
        return text
    return text + vision.max_images * vision_flops_per_image(vision, cfg.hidden_size) / seq_len


def compiled_flops(compiled) -> float:
    """XLA's FLOP count of one compiled program (one device's). It counts a loop body once:
    compile with the scans unrolled to count every iteration."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def peak_flops_per_device(override: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from)."""
    if override:
        return override, "config"
    device = jax.devices()[0]
    for name, peak in PEAK_BF16.items():
        if name in device.device_kind:
            return peak, f"{name} bf16 datasheet"
    if device.platform == "cpu":
        return measured_cpu_matmul_rate() / len(jax.devices()), "measured CPU float32 matmul rate"
    return float("nan"), f"unknown device {device.device_kind!r}"


def measured_cpu_matmul_rate(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 n x n matmul on this host (the whole machine: simulated CPU devices
    share its cores, so each device's share is this divided by the device count)."""
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best
