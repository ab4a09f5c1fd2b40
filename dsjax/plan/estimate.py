"""The planner's analytic model: per-device memory and a roofline step time of one layout over
one device profile, from the config's shapes alone (docs/planner.md states every term).

Memory = parameters, gradients and Adam moments (exact: each parameter's logical axes under the
layout's rules) + saved activations (per layer and token, by recomputation policy, times the
tokens a stage holds at once) + one layer's backward working set + the loss chunk's logits.
Time = GEMMs (each max(FLOPs / peak, bytes / bandwidth)) + elementwise traffic + fixed kernel
costs, over the schedule's ticks, + the exposed communication along each mesh axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax

from dsjax import sharding
from dsjax.config import Config
from dsjax.config.sections import HAND_BACKWARD_SCHEDULES, chunks_per_stage
from dsjax.metrics.flops import flops_per_token, matmul_params
from dsjax.model.attention import head_dims, resolve_impl
from dsjax.pipeline.stages import bubble_fraction, ticks
from dsjax.plan.layouts import Layout
from dsjax.plan.profiles import DeviceProfile

# float32 copies of each parameter a step holds: the state (parameter, Adam's two moments) and,
# in XLA's temporaries, the gradient, the layer scan's gradient stack and the update's
# intermediates (2.7: measured on compiled cpu_tiny steps, docs/planner.md)
STATE_COPIES, TEMP_COPIES = 3, 2.7
KERNELS_PER_LAYER = 60  # kernels (fusions, GEMMs, collectives) of one layer's fwd + bwd


class ParamTable:
    """Each parameter's shape and logical axes (abstract, nothing allocated), so the bytes one
    device holds under any layout's rules are exact."""

    def __init__(self, boxed: Any):
        specs = nn.get_partition_spec(boxed)
        self.leaves = [(tuple(x.shape), tuple(s) if s is not None else ())
                       for x, s in zip(jax.tree.leaves(nn.unbox(boxed)),
                                       jax.tree.leaves(specs, is_leaf=lambda s: s is None
                                                       or isinstance(s, jax.sharding.PartitionSpec)))]
        self.count = sum(math.prod(shape) for shape, _ in self.leaves)

    def local(self, layout: Layout) -> float:
        """Parameters one device holds under `layout`."""
        rules = dict(sharding.logical_rules(layout.fsdp, pipeline=layout.pipeline > 1,
                                            context=layout.context > 1))
        sizes = layout.mesh()
        total = 0.0
        for shape, axes in self.leaves:
            n = 1.0
            for dim, name in zip(shape, axes + (None,) * (len(shape) - len(axes))):
                axis = rules.get(name) if name else None
                n *= dim / sizes[axis] if axis and dim % sizes[axis] == 0 else dim
            total += n
        return total


@dataclasses.dataclass(frozen=True)
class Estimate:
    mem_bytes: float  # per device
    static_bytes: float  # parameters, gradients, optimizer state (per device)
    activation_bytes: float
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: dict[str, float]  # per mesh axis, before overlap
    comm_bytes: dict[str, float]  # per mesh axis, bytes one device sends per step
    bubble: float
    model_flops: float  # per step, all devices (the MFU numerator)

    def mfu(self, profile: DeviceProfile, devices: int, dtype: str) -> float:
        return self.model_flops / (self.step_s * devices * profile.flops(dtype))


def core_dtype(cfg: Config) -> str:
    """The attention core's dtype: the compute dtype (fp8 runs the core in fp8.other_dtype)."""
    dtype = cfg.train.compute_dtype
    return cfg.fp8.other_dtype if dtype == "fp8" else dtype


def _act_bytes(cfg: Config) -> int:
    return 4 if cfg.train.compute_dtype in ("float32",) else 2


def _widths(cfg: Config) -> dict[str, float]:
    m = cfg.model
    qk, v = head_dims(m)
    H, N = m.num_heads, m.num_kv_heads
    mlp = ((m.n_shared_experts + m.num_experts_per_tok) * m.moe_intermediate_size
           if m.is_moe else m.mlp_dim)
    layers = m.num_layers + m.num_mtp_layers
    per_layer = (matmul_params(m) - m.hidden_size * m.vocab_size * (1 + m.num_mtp_layers)) \
        / layers
    return {"D": m.hidden_size, "qkv": H * qk + N * (qk + v), "o": H * v, "H": H,
            "mlp": mlp, "matmul": per_layer, "V": m.vocab_size, "L": layers}


def saved_per_token(cfg: Config, layout: Layout, impl: str) -> tuple[float, float]:
    """(elements one layer saves per token of its input for the backward under layout's
    recomputation policy, the elements of its whole forward: the backward's working set)."""
    w, t, S = _widths(cfg), layout.tensor, cfg.data.seq_len
    keys = S  # each query row sees the whole row's keys (context: gathered)
    core = w["H"] / t * (2 * keys if impl == "xla" else 2)  # scores + probs, or flash's lse
    resid = 4 * w["D"]  # block input, post-attention residual and the two norm outputs
    proj = (w["qkv"] + w["o"]) / t + 2 * w["D"]  # q, k, v, attention out; o and down outputs
    mlp = 4 * w["mlp"] / t  # gate, up, silu(gate), the product
    whole = resid + proj + core + mlp
    qkv, D, mlp_w = w["qkv"] / t, w["D"], w["mlp"] / t
    flash = impl != "xla"  # its context and lse are tagged; xla's S x S is not
    tagged = qkv + 2 * D + 3 * mlp_w + (w["o"] / t + w["H"] / t if flash else 0)
    saved = {"none": whole,
             # the block input (the layer scan's carry) + the tagged tensors (dsjax/remat.py)
             "attention_core": D + tagged,
             "dots": D + qkv + w["o"] / t + 2 * D + 2 * mlp_w + (0 if flash else w["H"] / t * keys),
             "dots_no_batch": D + qkv + 2 * D + 2 * mlp_w,
             "full": D}[layout.remat]
    if layout.remat_layers.startswith("every_"):
        n = int(layout.remat_layers.split("_")[1])
        saved = (saved + (n - 1) * whole) / n
    return saved, whole


def _gemm_s(m: float, k: float, n: float, a: int, prof: DeviceProfile, dtype: str) -> float:
    """One GEMM [m, k] x [k, n] at the roofline: compute- or memory-bound."""
    return max(2 * m * k * n / prof.flops(dtype), a * (m * k + k * n + m * n) / prof.hbm_bw)


def _collective_s(calls: float, sent: float, bw: float, prof: DeviceProfile) -> float:
    return calls * prof.collective_s + sent / bw


def estimate(cfg: Config, layout: Layout, prof: DeviceProfile, params: ParamTable,
             backend: str, comm: dict[str, tuple[float, float]] | None = None) -> Estimate:
    """The analytic memory and step time of `cfg` laid out as `layout` on `prof`'s devices.
    `comm`: {axis: (collective calls, bytes sent)} per step read from a compiled program, used
    instead of the analytic traffic where given."""
    m, w = cfg.model, _widths(cfg)
    d, t, p, c = layout.data, layout.tensor, layout.pipeline, layout.context
    a, dtype = _act_bytes(cfg), cfg.train.compute_dtype
    S, B = cfg.data.seq_len, cfg.data.global_batch
    rows = B // d
    micro = layout.micro_batch or rows
    accum = rows // micro
    M = layout.microbatches if p > 1 else 1
    R = chunks_per_stage(layout.schedule, layout.repeats) if p > 1 else 1
    T = micro // M * S / c  # tokens of one pipeline microbatch on one device
    impl = resolve_impl(m, backend, core_dtype(cfg), S)
    layers_here = w["L"] / p

    # Memory.
    local = params.local(layout)
    static = (STATE_COPIES + TEMP_COPIES + (accum > 1)) * 4 * local
    if layout.fsdp and p > 1:  # the pipeline's shard_map takes a stage's weights whole over
        static += 2 * 4 * local * d  # data: gathered at its boundary, and their gradient
    saved, whole = saved_per_token(cfg, layout, impl)
    if p == 1 or layout.schedule in ("gpipe", "circular"):
        held = micro * S / c  # every microbatch's activations until the backward
    else:
        held = min(M * R, p) * T  # 1f1b: at most `stages` microbatches in flight
    activations = a * (layers_here * saved * held + 2 * whole * T)
    chunk = min(m.loss_chunk or S, S) * micro // M / c
    logits = 3 * 4 * chunk * w["V"] / t
    mem = static + activations + logits

    # Compute: one microbatch through one stage's layers, then the schedule's ticks.
    D = w["D"]
    F = w["matmul"] / t / D  # a layer's GEMMs as one [T, D] x [D, F] equivalent
    recompute = {"none": 0.0, "dots": 0.0, "dots_no_batch": 0.0, "attention_core": 0.0,
                 "full": 1.0}[layout.remat]
    gemm = (3 + recompute) * _gemm_s(T, D, F, a, prof, dtype)
    core_flops = 4 * T * S * w["H"] / t * (w["qkv"] / w["H"] / 3) * (1 if impl == "xla" else .5)
    core = (3 + (recompute or layout.remat == "attention_core")) * max(
        core_flops / prof.flops(dtype), a * T * w["H"] / t * S * 2 / prof.hbm_bw
        if impl == "xla" else 0.0)
    elementwise = 3 * a * T * whole / prof.hbm_bw
    layer_s = gemm + core + elementwise + KERNELS_PER_LAYER * prof.kernel_s
    head_s = 3 * _gemm_s(T, D, w["V"] / t, a, prof, dtype)
    n_ticks = ticks(layout.schedule, p, M, layout.repeats) if p > 1 else 1
    # Simulated devices share the host's cores: a tick a stage skips (the hand-backward
    # schedules' idle ticks) frees them for the others, so only busy ticks cost.
    busy = R * M if prof.shared_cores and layout.schedule in HAND_BACKWARD_SCHEDULES \
        else n_ticks
    # A pipeline's tick loop reads and writes the activations it holds (its stash) every tick.
    carry = 2 * a * layers_here * saved * held / prof.hbm_bw if p > 1 else 0.0
    compute = accum * (busy * (layers_here / R * layer_s + carry) + M * head_s) \
        + prof.update_s * local
    bubble = bubble_fraction(layout.schedule, p, M, layout.repeats,
                             moe=m.n_routed_experts > 0) if p > 1 else 0.0

    # Communication per step, per axis: (collective calls, bytes one device sends).
    if comm is None:
        comm = analytic_comm(cfg, layout, local, T, a, accum, M, n_ticks)
    spans_hosts = {"data": layout.dcn_data > 1, "pipeline": layout.dcn_pipeline > 1}
    comm_s = {axis: _collective_s(calls, sent, prof.inter_bw if spans_hosts.get(axis)
                                  else prof.intra_bw, prof)
              for axis, (calls, sent) in comm.items()}
    hidden = prof.overlap * compute / 3 * 2  # the data-parallel reduction behind the backward
    exposed = sum(v for k, v in comm_s.items() if k != "data") + max(
        0.0, comm_s.get("data", 0.0) - hidden)
    step = compute + exposed
    model_flops = flops_per_token(m, S) * B * S
    return Estimate(mem, static, activations + logits, step, compute, exposed, comm_s,
                    {k: v[1] for k, v in comm.items()}, bubble, model_flops)


def analytic_comm(cfg: Config, layout: Layout, local: float, T: float, a: int, accum: int,
                  M: int, n_ticks: int) -> dict[str, tuple[float, float]]:
    """{axis: (collective calls, bytes one device sends)} of one step, ring model."""
    m, w = cfg.model, _widths(cfg)
    d, t, p, c = layout.data, layout.tensor, layout.pipeline, layout.context
    layers_here = w["L"] / p
    units = accum * M * layers_here  # layer passes one device runs per step
    out = {}
    if t > 1:  # two all-reduces forward (attention out, MLP out), two backward, per layer
        out["tensor"] = (4 * units, 4 * units * 2 * (t - 1) / t * T * w["D"] * a)
    if c > 1:  # keys and values gathered forward, their gradients reduce-scattered backward
        kv = T * c * (w["qkv"] - w["H"] * (w["qkv"] / w["H"] / 3)) / t * a
        out["context"] = (2 * units, 2 * units * (c - 1) / c * kv)
    if p > 1:  # activations forward and gradients backward, every tick
        out["pipeline"] = (2 * accum * n_ticks, 2 * accum * n_ticks * T * w["D"] * a)
    if d > 1:
        frac = (d - 1) / d
        if layout.fsdp:  # gather the weights forward and backward, reduce-scatter the grads
            full = local * d
            sent = accum * 3 * frac * full * 4
            calls = accum * 3 * layers_here
        else:  # all-reduce the gradients (every micro-step: the accumulation reduces each)
            sent, calls = accum * 2 * frac * local * 4, accum * layers_here
        if layout.expert_parallel:  # dispatch and combine, forward and backward
            moe_units = accum * M * (m.num_layers - m.first_k_dense_replace) / p
            sent += moe_units * 4 * frac * T * m.num_experts_per_tok * w["D"] * a
            calls += 4 * moe_units
        out["data"] = (calls, sent)
    return out
