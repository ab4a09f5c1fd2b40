"""`python -m dsjax.plan --config CONFIG --devices N --device h100|h200|a100|cpu [--hosts H]
[--top K] [--out PLAN.json] [--config.SECTION.FIELD=VALUE ...]`: ranked, compiled parallelism
plans of a config (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from dsjax.config import ConfigError, load
from dsjax.config.load import parse_value
from dsjax.runtime.cpu_devices import ensure_cpu_devices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dsjax.plan",
                                     description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
    parser.add_argument("--devices", type=int, required=True, help="devices to plan for")
    parser.add_argument("--device", default="h100", help="h100 | h200 | a100 | cpu")
    parser.add_argument("--hosts", type=int, default=0,
                        help="hosts the devices are on (0: devices / 8, at least 1)")
    parser.add_argument("--top", type=int, default=4, help="plans to prove by compiling")
    parser.add_argument("--memory_gb", type=float, default=0.0,
                        help="per-device memory to fit (0: the profile's)")
    parser.add_argument("--out", default=None, help="write {'plans': [...]} here")
    args, rest = parser.parse_known_args(argv)
    overrides = {}
    for arg in rest:  # launch.py's spelling
        if not (arg.startswith("--config.") and "=" in arg):
            parser.error(f"unrecognized argument {arg}")
        key, value = arg[len("--config."):].split("=", 1)
        overrides[key] = parse_value(value)
    args.overrides = overrides
    if args.devices < 1:
        parser.error(f"--devices: must be >= 1, got {args.devices}")
    if args.hosts < 0:
        parser.error(f"--hosts: must be >= 0, got {args.hosts}")
    return args


def table(result: Any, rows: int = 12) -> str:
    """The ranked plans, then why the others were rejected."""
    prof = result.profile
    lines = [f"{'#':>2} {'layout':<46} {'mem GiB':>8} {'model':>7} {'step ms':>9} {'MFU':>6} "
             f"{'bubble':>6} {'comm ms':>8} {'compiled':>8}"]
    for i, p in enumerate(result.plans[:rows]):
        r = p.record(prof)
        lines.append(f"{i + 1:>2} {r['describe']:<46} {r['predicted_mem_bytes'] / 2**30:>8.2f} "
                     f"{r['model_mem_bytes'] / 2**30:>7.2f} {r['predicted_step_ms']:>9.1f} "
                     f"{100 * r['predicted_mfu']:>5.1f}% {r['bubble']:>6.2f} "
                     f"{r['exposed_comm_ms']:>8.1f} {'yes' if r['compiled'] else 'no':>8}")
    if len(result.plans) > rows:
        lines.append(f"   ... {len(result.plans) - rows} more fitting layouts (--out lists all)")
    lines.append(f"rejected {len(result.rejected)} of {result.considered} layouts:")
    for why, count, example, _ in result.reasons():
        lines.append(f"  {count:>5} x {why}  (e.g. {example.describe()})")
    return "\n".join(lines)


def overrides_line(plan: Any) -> str:
    return " ".join(f"--config.{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in plan.layout.overrides().items())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        cfg = load(args.config, args.overrides)
        ensure_cpu_devices(args.devices)  # before JAX starts: compile for N simulated devices
        import jax  # pylint: disable=import-outside-toplevel
        from dsjax.plan import planner, profiles  # pylint: disable=import-outside-toplevel
        if jax.device_count() < args.devices:
            raise ConfigError(f"--devices: this process has {jax.device_count()} devices and "
                              f"cannot compile for {args.devices} (XLA_FLAGS sets "
                              f"--xla_force_host_platform_device_count)")
        prof = profiles.profile(args.device, args.devices, args.memory_gb)
        hosts = args.hosts or profiles.default_hosts(args.devices, args.device)
        load_before, t0 = list(os.getloadavg()), time.perf_counter()
        result = planner.plan(cfg, args.devices, prof, hosts, args.top,
                              backend="cpu" if args.device == "cpu" else "cuda")
    except ConfigError as e:
        print(f"dsjax.plan: error: {e}", file=sys.stderr)
        sys.exit(2)
    seconds = time.perf_counter() - t0
    print(f"{args.config}: {args.devices} x {prof.name} ({prof.source}) on {hosts} host(s), "
          f"global batch {cfg.data.global_batch} x {cfg.data.seq_len}, "
          f"{cfg.train.compute_dtype}; budget {result.budget_bytes / 2**30:.1f} GiB per device")
    print(table(result))
    best = result.plans[0]
    proof = ("proved by compiling" if best.compiled else
             "NOT proved: no compiled plan fit, this one fits by the analytic model only")
    print(f"best: {best.layout.describe()} ({proof}); run it with:\n  python launch.py "
          f"--config {args.config} {overrides_line(best)}")
    print(f"planned in {seconds:.0f} s (load average {load_before[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    out = {"config": args.config, "overrides": args.overrides, "devices": args.devices,
           "device": prof.name, "profile": prof.__dict__, "hosts": hosts,
           "budget_bytes": result.budget_bytes, "considered": result.considered,
           "plan_seconds": seconds, "load_before": load_before,
           "load_after": list(os.getloadavg()), "cores": os.cpu_count(),
           "plans": [p.record(prof) for p in result.plans],
           "rejected": [{"reason": why, "count": n, "example": ex.describe(), "first": first}
                        for why, n, ex, first in result.reasons()]}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return out
