"""Candidate layouts: every way to lay a config's model and global batch over N devices (mesh
axes, fsdp, expert parallelism, pipeline schedule, recomputation, micro-batch), each either a
validated `Config` or the reason it cannot run."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

from dsjax.config import Config, ConfigError
from dsjax.config.validate import validate

# Recomputation choices the planner weighs (dsjax/remat.py), least recomputation first.
REMATS = (("none", "all"), ("attention_core", "all"), ("dots", "all"), ("full", "all"))
# Pipeline schedules and the layer chunks per stage each is tried with.
SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("circular", 2))
# Below this row length the sequence is not split: attention is a small share of the work and
# data/tensor parallelism already cover the devices (docs/planner.md).
CONTEXT_MIN_SEQ = 8192


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    data: int
    tensor: int
    pipeline: int
    context: int = 1
    fsdp: bool = False
    expert_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    repeats: int = 1
    remat: str = "none"
    remat_layers: str = "all"
    micro_batch: int = 0  # rows per data replica per micro-step (0: the whole step's rows)
    hosts: int = 1
    dcn_pipeline: int = 1  # hosts the pipeline axis spans (data spans the rest)

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def dcn_data(self) -> int:
        """Hosts the data axis spans (0: one host, the config's default)."""
        return self.hosts // self.dcn_pipeline if self.hosts > 1 else 0

    def mesh(self) -> dict[str, int]:
        return {"data": self.data, "tensor": self.tensor, "pipeline": self.pipeline,
                "context": self.context}

    def overrides(self) -> dict[str, Any]:
        """This layout as `--config.SECTION.FIELD=VALUE` overrides (dotted key -> value)."""
        return {"mesh.data": self.data, "mesh.tensor": self.tensor,
               "mesh.pipeline": self.pipeline, "mesh.context": self.context,
               "mesh.fsdp": self.fsdp, "mesh.dcn_data": self.dcn_data,
               "mesh.dcn_pipeline": self.dcn_pipeline,
               "model.expert_parallel": self.expert_parallel,
               "pipeline.schedule": self.schedule, "pipeline.microbatches": self.microbatches,
               "pipeline.repeats": self.repeats, "remat.policy": self.remat,
               "remat.layers": self.remat_layers, "batch.micro_batch": self.micro_batch}

    def describe(self) -> str:
        parts = [f"d{self.data} t{self.tensor} p{self.pipeline}"]
        if self.context > 1:
            parts.append(f"c{self.context}")
        if self.fsdp:
            parts.append("fsdp")
        if self.expert_parallel:
            parts.append("ep")
        if self.pipeline > 1:
            parts.append(f"{self.schedule} m{self.microbatches}"
                         + (f" r{self.repeats}" if self.repeats > 1 else ""))
        parts.append(f"remat {self.remat}")
        if self.micro_batch:
            parts.append(f"mb{self.micro_batch}")
        return " ".join(parts)


def of_config(cfg: Config, hosts: int = 1) -> Layout:
    """The layout a config already has."""
    mesh, p = cfg.mesh, cfg.pipeline
    return Layout(mesh.data, mesh.tensor, mesh.pipeline, mesh.context, mesh.fsdp,
                  cfg.model.expert_parallel, p.schedule, p.microbatches, p.repeats,
                  cfg.remat.policy, cfg.remat.layers, cfg.batch.micro_batch, hosts,
                  mesh.dcn_pipeline)


def apply(cfg: Config, layout: Layout) -> Config:
    """`cfg` with `layout`'s fields (its `overrides()`), validated (ConfigError: why it cannot
    run)."""
    fields: dict[str, dict[str, Any]] = {}
    for dotted, value in layout.overrides().items():
        section, name = dotted.split(".")
        fields.setdefault(section, {})[name] = value
    out = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **f)
                                      for section, f in fields.items()})
    validate(out)
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(cfg: Config, devices: int, hosts: int) -> Iterator[tuple[tuple[int, ...], str]]:
    """(data, tensor, pipeline, context, hosts pipeline spans) for `devices`, with the
    topology's reason where a mesh cannot be used ('' where it can). Across hosts go `data`
    and, where data alone cannot cover them, `pipeline` (sharding.host_split)."""
    per_host = devices // hosts
    for tensor in divisors(devices):
        for context in divisors(devices // tensor):
            for pipeline in divisors(devices // (tensor * context)):
                data = devices // (tensor * context * pipeline)
                dcn_pipeline = hosts // math.gcd(data, hosts)
                why = ""
                if per_host % tensor:
                    why = (f"tensor {tensor} spans hosts ({per_host} devices per host): it "
                           f"all-reduces in every layer")
                elif per_host % (tensor * context):
                    why = f"tensor x context {tensor * context} spans hosts"
                elif context > 1 and cfg.data.seq_len < CONTEXT_MIN_SEQ:
                    why = (f"context {context}: rows of {cfg.data.seq_len} tokens are shorter "
                           f"than {CONTEXT_MIN_SEQ}")
                elif pipeline % dcn_pipeline:
                    why = (f"data x pipeline {data} x {pipeline} cannot span the {hosts} hosts "
                           f"evenly")
                yield (data, tensor, pipeline, context, dcn_pipeline), why


def candidates(cfg: Config, devices: int, hosts: int = 1
               ) -> Iterator[tuple[Layout, Config | None, str]]:
    """Every layout of `cfg` over `devices` devices on `hosts` hosts: (layout, its validated
    config or None, '' or why it is rejected)."""
    if devices % hosts:
        raise ConfigError(f"--hosts: {devices} devices do not split over {hosts} hosts")
    B = cfg.data.global_batch
    moe = cfg.model.n_routed_experts > 0
    for (data, tensor, pipeline, context, dcn_pipeline), why in _meshes(cfg, devices, hosts):
        if why or B % data:
            base = Layout(data, tensor, pipeline, context, hosts=hosts,
                          dcn_pipeline=dcn_pipeline)
            yield base, None, why or f"global batch {B} does not split over data {data}"
            continue
        rows = B // data
        schedules = SCHEDULES if pipeline > 1 else ((cfg.pipeline.schedule, 1),)
        for fsdp in ((False, True) if data > 1 else (False,)):
            for ep in ((False, True) if moe and data > 1 else (cfg.model.expert_parallel
                                                               and data > 1,)):
                for schedule, repeats in schedules:
                    for microbatches in ((pipeline, 2 * pipeline, 4 * pipeline)
                                         if pipeline > 1 else (1,)):
                        for micro in reversed(divisors(rows)):
                            if micro % microbatches:
                                continue
                            for remat, layers in REMATS:
                                layout = Layout(data, tensor, pipeline, context, fsdp, ep,
                                                schedule, microbatches, repeats, remat, layers,
                                                0 if micro == rows else micro, hosts,
                                                dcn_pipeline)
                                try:
                                    yield layout, apply(cfg, layout), ""
                                except ConfigError as e:
                                    yield layout, None, str(e)

