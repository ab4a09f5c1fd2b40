"""`launch.py --config.plan=auto`: plan the run for the devices it has (or reuse the plan cached
in WORKDIR/plan.json for the same config and device set), say what changed when a run resumes on
other devices, and put the plan beside what the run measured in summary.json."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax

from dsjax.config import Config
from dsjax.metrics import update_summary
from dsjax.plan import layouts, planner, profiles

CACHE = "plan.json"
# Compiled candidates behind an automatic plan: the winner and a runner-up.
AUTO_TOP = 2


def fingerprint(cfg: Config, devices: int, device: str, hosts: int) -> dict[str, Any]:
    """What a plan depends on: the model, the rows a step trains on, the precision and the
    optimizer (not the fields a plan sets, nor the step count or the paths), and the devices."""
    fields = cfg.to_dict()
    for dotted in layouts.of_config(cfg).overrides():
        section, key = dotted.split(".")
        fields[section].pop(key, None)
    kept = {name: fields[name] for name in ("model", "vision", "fp8", "mesh", "pipeline",
                                            "remat", "batch")}
    kept.update({"data": {k: fields["data"][k] for k in ("seq_len", "global_batch")},
                 "train": {"compute_dtype": fields["train"]["compute_dtype"]},
                 "optim": {"name": fields["optim"]["name"]}})
    return {"config": kept, "devices": devices, "device": device, "hosts": hosts}


def _describe(record: dict[str, Any]) -> str:
    return f"{record['describe']} (micro-batch {record['micro_batch']}, " \
           f"{record['accum_steps']} accumulation step(s))"


def planned_config(cfg: Config, workdir: str, log: Callable[[str], None]
                   ) -> tuple[Config, dict[str, Any]]:
    """(`cfg` with the plan's layout, the plan's record) for this process's devices. A cached
    plan for the same config and devices is reused; a different device count (a resume after
    losing or gaining hosts) plans again, and the log says what changed. The global batch and
    the data order are the config's either way: only the layout moves."""
    devices = jax.devices()
    kind = profiles.for_device_kind(devices[0].device_kind)
    hosts = profiles.default_hosts(len(devices), kind)
    key = fingerprint(cfg, len(devices), kind, hosts)
    path = os.path.join(workdir, CACHE)
    cached = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
    if cached and cached.get("key") == key:
        record = cached["plan"]
        log(f"plan: reusing {path} ({len(devices)} x {kind}): {_describe(record)}")
    else:
        prof = profiles.profile(kind, len(devices))
        result = planner.plan(cfg, len(devices), prof, hosts, AUTO_TOP,
                              backend="cpu" if kind == "cpu" else "cuda", log=log)
        best = next((p for p in result.plans if p.compiled), result.plans[0])
        record = best.record(prof)
        log(f"plan: {len(devices)} x {kind}: {_describe(record)}, predicted "
            f"{record['predicted_step_ms']:.1f} ms/step, "
            f"{record['predicted_mem_bytes'] / 2**30:.3f} GiB per device"
            + ("" if record["compiled"] else " (analytic only: no compiled plan fit; the run's "
                                              "own memory check decides)"))
        if cached:
            log(f"plan: re-planned: {what_changed(cached, key, record)}; global batch "
                f"{cfg.data.global_batch} and the data order are kept (the checkpoint is "
                f"restored onto the new mesh)")
        if jax.process_index() == 0:
            os.makedirs(workdir, exist_ok=True)
            history = (cached or {}).get("history", []) + ([cached["plan"]] if cached else [])
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"key": key, "plan": record, "history": history}, f, indent=2)
            os.replace(tmp, path)
    return layouts.apply(cfg, layouts.Layout(**record["layout"])), record


def what_changed(cached: dict[str, Any], key: dict[str, Any], record: dict[str, Any]) -> str:
    """'devices 8 -> 4; mesh {...} -> {...}; ...' between a cached plan and the new one."""
    old_key, old = cached.get("key", {}), cached.get("plan", {})
    parts = [f"{name} {old_key.get(name)} -> {key[name]}" for name in ("devices", "device", "hosts")
             if old_key.get(name) != key[name]]
    if old_key.get("config") != key["config"]:
        parts.append("the config changed")
    for name in ("mesh", "fsdp", "schedule", "remat", "micro_batch", "accum_steps"):
        if old.get(name) != record[name]:
            parts.append(f"{name} {old.get(name)} -> {record[name]}")
    return "; ".join(parts) or "nothing"


def record_outcome(workdir: str, record: dict[str, Any]) -> dict[str, Any]:
    """summary.json's `plan` and `plan_measured`: the plan with its prediction, beside the
    run's median step time and per-device memory (as the run's summary recorded them)."""
    summary = update_summary(workdir, {})
    ms, mem = summary.get("median_step_ms"), summary.get("mem_bytes")
    measured = {"step_ms": ms, "mem_bytes": mem, "mem_source": summary.get("mem_source"),
                "step_ms_vs_predicted": ms / record["predicted_step_ms"] if ms else None,
                "mem_vs_predicted": mem / record["predicted_mem_bytes"] if mem else None}
    return update_summary(workdir, {"plan": record, "plan_measured": measured})
