"""A candidate proved by compiling it: its train step compiled by XLA:CPU for the target device
count (simulated devices, abstract arrays, nothing allocated), and what the program says:
per-device memory (`memory_analysis`), and the collectives along each mesh axis (calls and
bytes per step, loops by their trip counts)."""

from __future__ import annotations

import dataclasses
import time

import jax

from dsjax import sharding
from dsjax.batching import Shape
from dsjax.config import Config
from dsjax.metrics.hlo import looped_axis_traffic
from dsjax.metrics.memory import predicted_bytes
from dsjax.model.attention import resolve_impl
from dsjax.plan.estimate import core_dtype
from dsjax.train import build_trainer


@dataclasses.dataclass(frozen=True)
class Compiled:
    mem_bytes: int  # arguments + outputs - donated + temp, per device
    temp_bytes: int
    argument_bytes: int
    comm: dict[str, tuple[float, float]]  # axis -> (collective calls, bytes sent) per step
    compile_s: float


def cannot_compile_here(cfg: Config) -> str:
    """Why XLA:CPU cannot compile `cfg`'s step ('' where it can): it aborts the process on a
    half-precision gpipe or circular step (AllReducePromotion: "Invalid binary instruction opcode
    copy", seen with bfloat16; 1f1b compiles)."""
    if (jax.devices()[0].platform == "cpu" and cfg.mesh.pipeline > 1
            and cfg.pipeline.schedule in ("gpipe", "circular")
            and cfg.train.compute_dtype != "float32"):
        return (f"XLA:CPU aborts compiling a {cfg.train.compute_dtype} {cfg.pipeline.schedule} "
                f"step (AllReducePromotion)")
    return ""


def compile_layout(cfg: Config, backend: str) -> Compiled:
    """Compiles `cfg`'s first train step (its layout applied) on the first `cfg.mesh.size` of
    this process's devices, which must be that many. `backend` is the target's: an attention
    kernel that cannot lower here (cuDNN, Pallas) compiles as the blockwise `flash`, which keeps
    no S x S either."""
    t0 = time.perf_counter()
    impl = resolve_impl(cfg.model, backend, core_dtype(cfg), cfg.data.seq_len)
    if impl in ("cudnn", "pallas") and jax.devices()[0].platform == "cpu":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                 attention_impl="flash"))
    devices = jax.devices()[:cfg.mesh.size]
    trainer = build_trainer(cfg, sharding.make_mesh(cfg, devices))
    B, data = cfg.data.global_batch, cfg.mesh.data
    micro = cfg.batch.micro_batch or B // data
    program = trainer.programs.get(0, Shape(B, B // (micro * data), data))
    analysis = program.memory_analysis()
    hlo = program.as_text()
    comm = {}
    for axis in sharding.MESH_AXES:
        calls, sent = looped_axis_traffic(hlo, trainer.mesh, axis)
        if calls:
            comm[axis] = (calls, sent)
    trainer.programs.close()
    return Compiled(predicted_bytes(program), int(analysis.temp_size_in_bytes),
                    int(analysis.argument_size_in_bytes), comm, time.perf_counter() - t0)

