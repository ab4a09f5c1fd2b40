"""The planner: enumerate a config's layouts over N devices, prune them with the analytic model,
compile the best K to prove their memory and read their communication, and rank what fits by
predicted step time (docs/planner.md)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import statistics
from typing import Any, Callable

from dsjax.config import Config, ConfigError
from dsjax.model.decoder import abstract_params
from dsjax.plan.compiled import Compiled, cannot_compile_here, compile_layout
from dsjax.plan.estimate import Estimate, ParamTable, estimate
from dsjax.plan.layouts import Layout, candidates
from dsjax.plan.profiles import DeviceProfile


@dataclasses.dataclass
class Plan:
    layout: Layout
    cfg: Config
    estimate: Estimate  # with the compiled program's communication where compiled
    model_mem_bytes: float  # the analytic model's memory, compiled or not
    compiled: Compiled | None = None

    @property
    def mem_bytes(self) -> float:
        return self.compiled.mem_bytes if self.compiled else self.estimate.mem_bytes

    def record(self, prof: DeviceProfile) -> dict[str, Any]:
        """The JSON form of this plan (`--out`, summary.json)."""
        lay, est, cfg = self.layout, self.estimate, self.cfg
        rows = cfg.data.global_batch // lay.data
        micro = lay.micro_batch or rows
        return {
            "describe": lay.describe(), "layout": dataclasses.asdict(lay), "mesh": lay.mesh(), "fsdp": lay.fsdp,
            "expert_parallel": lay.expert_parallel, "hosts": lay.hosts,
            "schedule": {"name": lay.schedule, "microbatches": lay.microbatches,
                         "repeats": lay.repeats} if lay.pipeline > 1 else None,
            "remat": {"policy": lay.remat, "layers": lay.remat_layers},
            "micro_batch": micro, "accum_steps": rows // micro,
            "predicted_mem_bytes": int(self.mem_bytes),
            "model_mem_bytes": int(self.model_mem_bytes),
            "predicted_step_ms": 1000 * est.step_s,
            "predicted_mfu": est.mfu(prof, lay.devices, cfg.train.compute_dtype),
            "bubble": est.bubble, "exposed_comm_ms": 1000 * est.exposed_comm_s,
            "comm_bytes": {k: int(v) for k, v in est.comm_bytes.items()},
            "compiled": self.compiled is not None,
            "compile_s": self.compiled.compile_s if self.compiled else None,
            "overrides": lay.overrides()}


@dataclasses.dataclass
class Result:
    plans: list[Plan]  # fitting, best first: the compiled ones, then the analytic rest
    rejected: list[tuple[Layout, str]]
    profile: DeviceProfile
    budget_bytes: float
    considered: int
    params: ParamTable

    def reasons(self) -> list[tuple[str, int, Layout, str]]:
        """(reason with its numbers masked, how many layouts it rejected, the first of them, its
        own reason), most common first: one rule is one line."""
        groups: dict[str, list[tuple[Layout, str]]] = collections.defaultdict(list)
        for layout, why in self.rejected:
            groups[_shape_of(why)].append((layout, why))
        return sorted(((masked, len(v), v[0][0], v[0][1]) for masked, v in groups.items()),
                      key=lambda r: -r[1])


def _shape_of(why: str) -> str:
    """A reason with its numbers masked, so that one rule is one line of the table."""
    return re.sub(r"\d+(?:\.\d+)?", "N", why)


def plan(cfg: Config, devices: int, prof: DeviceProfile, hosts: int = 1, top: int = 4,
         backend: str = "cuda", log: Callable[[str], None] = print,
         compile_fn: Callable[[Config, str], Compiled] | None = compile_layout) -> Result:
    """Ranked plans of `cfg` over `devices` devices of `prof` on `hosts` hosts. The `top` best by
    the analytic model are compiled (this process needs `devices` devices; `compile_fn=None`
    compiles nothing); a compiled program over budget is rejected and the next one tried."""
    if top < 0:
        raise ConfigError(f"--top: must be >= 0, got {top}")
    params = ParamTable(abstract_params(cfg.model))
    budget = cfg.batch.mem_fraction * prof.hbm_bytes
    ranked: list[Plan] = []
    rejected: list[tuple[Layout, str]] = []
    considered = 0
    for layout, lcfg, why in candidates(cfg, devices, hosts):
        considered += 1
        if why:
            rejected.append((layout, why))
            continue
        problem = cannot_compile_here(lcfg) if backend == "cpu" else ""
        if problem:  # the target is this CPU: it cannot run here either
            rejected.append((layout, problem))
            continue
        est = estimate(lcfg, layout, prof, params, backend)
        if est.mem_bytes > budget:
            rejected.append((layout, f"memory: predicted {est.mem_bytes / 2**30:.2f} GiB > "
                                     f"budget {budget / 2**30:.2f} GiB"))
            continue
        ranked.append(Plan(layout, lcfg, est, est.mem_bytes))
    ranked.sort(key=lambda p: (p.estimate.step_s, p.estimate.mem_bytes))
    log(f"plan: {considered} layouts, {len(ranked)} predicted to fit "
        f"{budget / 2**30:.1f} GiB per device; compiling the best {min(top, len(ranked))}")
    proved: list[Plan] = []
    tried: set[int] = set()
    ratios: list[float] = []  # compiled / analytic memory of the plans compiled so far
    while compile_fn is not None and len(proved) < top and len(tried) < 3 * top:
        # The analytic model's error on this config, as measured so far, re-prunes the rest: the
        # next plan compiled is the best one still predicted to fit once scaled by it (if none
        # is, the best one left).
        scale = max(1.0, statistics.median(ratios)) if ratios else 1.0
        left = [i for i in range(len(ranked)) if i not in tried]
        if not left:
            break
        i = next((i for i in left if ranked[i].model_mem_bytes * scale <= budget), left[0])
        tried.add(i)
        candidate = ranked[i]
        problem = cannot_compile_here(candidate.cfg)
        if problem:
            log(f"  not compiled {candidate.layout.describe()}: {problem}")
            continue
        done = prove(candidate, prof, params, backend, compile_fn).compiled
        ratios.append(done.mem_bytes / candidate.model_mem_bytes)
        log(f"  compiled {candidate.layout.describe()}: {done.mem_bytes / 2**30:.3f} GiB "
            f"(model {candidate.model_mem_bytes / 2**30:.3f}), "
            f"{1000 * candidate.estimate.step_s:.1f} ms predicted, {done.compile_s:.1f} s")
        if done.mem_bytes > budget:
            rejected.append((candidate.layout,
                             f"memory: compiled {done.mem_bytes / 2**30:.2f} GiB > budget "
                             f"{budget / 2**30:.2f} GiB"))
        else:
            proved.append(candidate)
    proved.sort(key=lambda p: p.estimate.step_s)
    rest = [p for p in ranked if p.compiled is None]
    if not proved and not rest:
        raise ConfigError(f"plan: no layout of {cfg.name} fits {devices} devices of "
                          f"{prof.name} ({budget / 2**30:.1f} GiB each): "
                          + "; ".join(f"{why} ({n} layouts like this)" for _, n, _, why in
                                      Result([], rejected, prof, budget, considered,
                                             params).reasons()[:4]))
    return Result(proved + rest, rejected, prof, budget, considered, params)


def prove(candidate: Plan, prof: DeviceProfile, params: ParamTable, backend: str,
          compile_fn: Callable[[Config, str], Compiled] = compile_layout) -> Plan:
    """`candidate` compiled: its memory from the program, its step time re-predicted with the
    program's collectives."""
    candidate.compiled = compile_fn(candidate.cfg, backend)
    candidate.estimate = estimate(candidate.cfg, candidate.layout, prof, params, backend,
                                  comm=candidate.compiled.comm)
    return candidate


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
