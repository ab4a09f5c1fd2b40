"""Throughput, MFU and the run's metric writers (console, metrics.jsonl, TensorBoard, summary.json).

FLOPs convention (stated once, used everywhere): training FLOPs per token =
  6 * N_matmul                      (forward 2N + backward 4N over every matmul weight a token
                                     passes, incl. the output head; the embedding lookup is a
                                     gather, not a matmul; MoE: shared + top-k routed experts)
+ 6 * L * S * H * K                 (attention scores and context: 12 * L * S * H * K for full
                                     attention, halved because the mask is causal; MLA: K is the
                                     mean of the qk and v head dims)
MFU = achieved model FLOPs/s / (peak FLOPs/s per device * devices). On CPU there is no datasheet
peak: we measure a float32 matmul rate on this machine once and label MFU as relative to it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig

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


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token, causal attention."""
    if cfg.attention == "mla":  # scores over qk dims, context over v dims
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        qk = v = cfg.resolved_head_dim
    layers = cfg.num_layers + cfg.num_mtp_layers
    attention = 3 * layers * seq_len * cfg.num_heads * (qk + v)
    return 6 * matmul_params(cfg) + attention


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


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """Writes logged steps to the console, `metrics.jsonl` and TensorBoard (process 0 only).

    On a terminal the console gets a live progress bar (step, loss, tokens/s, MFU, ETA) under the
    scrolling log lines; piped to a file it gets the lines alone.
    """

    def __init__(self, workdir: str, total_steps: int, tensorboard: bool = True,
                 live: bool | None = None):
        self.enabled = jax.process_index() == 0
        self.total_steps = total_steps
        self.history: list[dict[str, Any]] = []
        self._jsonl = None
        self._tb = None
        self._live = None
        if not self.enabled:
            return
        if sys.stdout.isatty() if live is None else live:
            from rich.progress import BarColumn, Progress, TextColumn
            self._live = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                  TextColumn("{task.fields[stats]}"))
            self._task = self._live.add_task("train", total=total_steps, stats="compiling...")
            self._live.start()
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # writes event files without TensorFlow
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, record: dict[str, Any], eta_s: float | None = None) -> None:
        self.history.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
            self._tb.flush()
        line = (f"step {record['step']:>6}/{self.total_steps} | loss {record['loss']:.4f} | "
                f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_sec']:,.0f} tok/s | {record['step_ms']:.0f} ms/step | "
                f"MFU {100 * record['mfu']:.1f}%")
        if eta_s is not None:
            line += f" | ETA {format_duration(eta_s)}"
        if self._live is None:
            print(line, flush=True)
            return
        self._live.console.print(line)
        self._live.update(self._task, completed=record["step"], stats=(
            f"loss {record['loss']:.4f} | {record['tokens_per_sec']:,.0f} tok/s | "
            f"MFU {100 * record['mfu']:.1f}%" +
            (f" | ETA {format_duration(eta_s)}" if eta_s is not None else "")))

    def write_eval(self, step: int, values: dict[str, float]) -> None:
        if self.enabled and self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"eval/{key}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()


def median_of(history: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in history if key in r and r[key] is not None and math.isfinite(r[key])]
    return statistics.median(values) if values else None


def update_summary(workdir: str, values: dict[str, Any]) -> dict[str, Any]:
    """Merges `values` into `summary.json` (process 0 only); returns the merged summary."""
    path = os.path.join(workdir, "summary.json")
    summary = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    summary.update(values)
    if jax.process_index() == 0:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    return summary


def log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stdout, flush=True)


# ---------------------------------------------------------------------------------------------
# Collectives in compiled HLO: which devices talk, and how many bytes each one sends.

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>all-to-all|all-gather|all-reduce|reduce-scatter|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LIST_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# Newer XLA prints GSPMD's groups as mesh axes: replica_groups=mesh['axis_0'=4,'axis_2'=2]
# {'axis_0'}, device ids row-major over the axes unless `device_ids=([4,2]T(1,0))` (an iota
# reshaped and transposed) says otherwise; a group varies over the braced axes.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
                          r"(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?"
                          r"\s*\{(?P<over>[^}]*)\}")
_IOTA_IDS = re.compile(r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?$")


def _listed_groups(m: re.Match) -> str:
    """A mesh-axes replica group list rewritten as the explicit `{{0,2,...},...}` form that
    `metrics.hlo_collectives` reads; forms not understood (sub-axes) fail loudly."""
    sizes = {}
    for item in m["axes"].split(","):
        name, _, size = item.partition("=")
        sizes[name.strip().strip("'")] = int(size)
    over = [a.strip().strip("'") for a in m["over"].split(",") if a.strip()]
    if any(a not in sizes for a in over):
        raise ValueError(f"unsupported replica groups: {m[0]}")
    count = math.prod(sizes.values())
    ids = np.arange(count)
    if m["ids"]:
        iota = _IOTA_IDS.match(m["ids"].strip())
        if iota:
            ids = ids.reshape([int(d) for d in iota["dims"].split(",")])
            if iota["perm"]:
                ids = ids.transpose([int(p) for p in iota["perm"].split(",")])
        elif re.fullmatch(r"[\d,\s]+", m["ids"]):
            ids = np.array([int(d) for d in m["ids"].split(",")])
        else:
            raise ValueError(f"unsupported replica groups: {m[0]}")
    ids = ids.reshape(tuple(sizes.values()))
    names = list(sizes)
    rest = [names.index(a) for a in names if a not in over]
    ids = ids.transpose(rest + [names.index(a) for a in over])
    groups = ids.reshape(-1, math.prod(sizes[a] for a in over)).tolist()
    return "replica_groups={" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"



@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled HLO program. `groups` hold partition ids: positions in the
    jitted function's device order (the mesh's `devices.flat`); a collective-permute's groups
    are its (source, target) pairs."""
    op: str
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    def sent_bytes(self) -> float:
        """Bytes one device sends, ring model: all-reduce 2(W-1)/W of the buffer; all-gather
        (W-1)/W of its output; all-to-all (W-1)/W of its buffer (it keeps its own chunk);
        reduce-scatter (W-1)/W of its input (= W x output); collective-permute its buffer."""
        w = self.group_size
        frac = (w - 1) / w
        return {"all-reduce": 2 * frac * self.result_bytes,
                "all-gather": frac * self.result_bytes,
                "all-to-all": frac * self.result_bytes,
                "reduce-scatter": frac * w * self.result_bytes,
                "collective-permute": float(self.result_bytes)}[self.op]

    def spans(self, mesh_shape: tuple[int, ...], axis: int) -> bool:
        """Whether some group holds devices at different coordinates of mesh axis `axis`
        (e.g. the data-parallel collectives: axis = the index of "data")."""
        coords = [{int(np.unravel_index(d, mesh_shape)[axis]) for d in g} for g in self.groups]
        return any(len(c) > 1 for c in coords)


def hlo_collectives(hlo: str, num_devices: int) -> list[Collective]:
    """Every collective in compiled HLO text where collectives are synchronous (CPU; an async
    GPU `*-start` with a tuple result would be over-counted). An empty `replica_groups={}` means
    one group of all `num_devices`; a group that cannot be read fails loudly rather than being
    counted as free."""
    out = []
    for line in _MESH_GROUPS.sub(_listed_groups, hlo).splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        nbytes = sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
                     for t, dims in _ARRAY.findall(m["shape"]))
        rest = m["rest"]
        if "replica_groups={}" in rest:
            groups = (tuple(range(num_devices)),)
        elif listed := _LIST_GROUPS.search(rest):
            groups = tuple(tuple(int(d) for d in g.split(",") if d)
                           for g in re.findall(r"\{([\d,]*)\}", listed[1]))
        elif iota := _IOTA_GROUPS.search(rest):
            dims = [int(d) for d in iota[3].split(",")]
            ids = np.arange(math.prod(dims)).reshape(dims)
            if iota[4]:
                ids = ids.transpose([int(p) for p in iota[4].split(",")])
            groups = tuple(map(tuple, ids.reshape(int(iota[1]), int(iota[2])).tolist()))
        else:
            raise ValueError(f"unreadable replica groups: {line.strip()[:120]} ... "
                             f"{rest[rest.find('replica_groups'):][:160]}")
        if not groups or not groups[0]:
            raise ValueError(f"empty replica groups: {line.strip()[:200]}")
        out.append(Collective(m["op"], nbytes, groups))
    return out


def axis_collectives(hlo: str, mesh: Any, axis: str) -> list[Collective]:
    """The collectives of compiled `hlo` (jitted over `mesh`) that move data along `axis`."""
    shape = tuple(mesh.devices.shape)
    index = list(mesh.axis_names).index(axis)
    return [c for c in hlo_collectives(hlo, mesh.devices.size) if c.spans(shape, index)]


# ---------------------------------------------------------------------------------------------
# Readings for the side-by-side report (docs/observability.md): XLA's FLOPs to cross-check the
# formula above, memory, and GPU utilisation. Each says where its number comes from.


def cost_analysis_flops(cfg: Any, mesh: Any) -> float:
    """XLA's FLOPs for one forward + backward of the training loss of `cfg` (a `Config`) at its
    global batch, summed over `mesh`'s devices.

    The layer stack is unrolled, because `cost_analysis()` counts a scan body once whatever its
    trip count. What it counts is what the program does: every dot as 2*M*N*K, attention over
    the full S x S (the causal mask is a select, not skipped work), elementwise ops, and any
    recomputation `cfg.remat` asks for. A partitioned program is one device's, so it is scaled
    by the device count (work replicated across tensor shards counts once per device).
    """
    from dsjax.remat_plan import compile_grad  # compiles the model; metrics stays light

    cost = compile_grad(cfg, mesh, unroll=True).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) * mesh.devices.size


def memory_reading(device: Any, compiled: Any = None) -> dict[str, Any]:
    """{bytes_in_use, peak_bytes, source} for one device: its allocator's `memory_stats()` where
    it keeps them (GPU, TPU), else the compiled step's `memory_analysis()` per device (temp +
    arguments + outputs - aliased, i.e. donated; a prediction, so in use = peak), else Nones."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_in_use" in stats:
        return {"bytes_in_use": int(stats["bytes_in_use"]),
                "peak_bytes": int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])),
                "source": "device memory_stats"}
    analysis = compiled.memory_analysis() if compiled is not None else None
    if analysis is not None:
        total = (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes +
                 analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
        return {"bytes_in_use": int(total), "peak_bytes": int(total),
                "source": "compiled memory_analysis (temp + arguments + outputs - aliased)"}
    return {"bytes_in_use": None, "peak_bytes": None, "source": "unavailable"}


def device_utilisation(device: Any = None) -> float | None:
    """NVML's GPU utilisation of `device` (default: the first), as a fraction: the share of its
    last sample period (1/6 s to 1 s) in which any kernel ran. None, not zero, where there is no
    GPU or no `pynvml` (package nvidia-ml-py). Not MFU: one small kernel at a time reads 1.0."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return None
    try:
        import pynvml  # optional: nvidia-ml-py is not a dependency
    except ImportError:
        return None
    index = device.local_hardware_id if device.local_hardware_id is not None else device.id
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if all(v.isdigit() for v in visible) and index < len(visible):
        # NVML numbers every GPU of the machine; CUDA (and JAX) only the visible ones.
        index = int(visible[index])
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    except pynvml.NVMLError:
        return None
