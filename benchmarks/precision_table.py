"""fp8.select=auto against all-fp8 and bf16: held-out loss per seed, the share of projection
FLOPs auto ran in fp8, and what its probes and recompilations cost.

    python benchmarks/precision_table.py --config configs/cpu_tiny.py --steps 150 \
        --seeds 0,1 --out benchmarks/results/precision_cpu_tiny.json

Each variant and seed is its own `launch.py` run (its own process, one after another, the load
average recorded before each): `auto` (train.compute_dtype=fp8, fp8.select=auto), `fp8`
(fp8.select=policy: every projection in fp8) and `bf16` (train.compute_dtype=bfloat16). Prints a
table last and writes JSON: per run its held-out loss, fp8_flops_fraction, the precision
seconds (probe, recompilation) against the run's training seconds; per variant the mean and
spread of the held-out loss. docs/precision.md reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "auto": {"train.compute_dtype": "fp8", "fp8.select": "auto"},
    "fp8": {"train.compute_dtype": "fp8", "fp8.select": "policy"},
    "bf16": {"train.compute_dtype": "bfloat16", "fp8.select": "policy"},
}


def run_one(config: str, workdir: str, flags: dict[str, str], timeout: int,
            reuse: bool = False) -> dict:
    """One launch.py run; its summary with the wall time and the load average before it.
    `reuse`: a finished run of the same config and flags in `workdir` (its bench.json) is read,
    not run again."""
    record = os.path.join(workdir, "bench.json")
    if reuse and os.path.exists(record):
        with open(record, encoding="utf-8") as f:
            made = json.load(f)
        if made["config"] != config or made["flags"] != flags:
            raise SystemExit(f"--reuse: {workdir} was run with other flags: {made}")
        wall, load = made["wall_seconds"], made["load_before"]
    else:
        if os.path.exists(workdir):
            raise SystemExit(f"{workdir} exists: pass --reuse, or another --workdir")
        cmd = [sys.executable, os.path.join(ROOT, "launch.py"), f"--config={config}",
               f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in flags.items()]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              check=False)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(record, "w", encoding="utf-8") as f:
            json.dump({"config": config, "flags": flags, "wall_seconds": wall,
                       "load_before": load}, f)
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    steps = summary["steps"]
    train_s = steps * (summary["median_step_ms"] or 0.0) / 1000
    spent = summary.get("precision_seconds", {})
    return {"eval_loss": summary["eval_loss"], "final_train_loss": summary["final_train_loss"],
            "fp8_flops_fraction": summary.get("fp8_flops_fraction"),
            "precision_layers": summary.get("precision_layers"),
            "precision_changes": len(summary.get("precision_changes", [])),
            "precision_probes": summary.get("precision_probes"),
            "precision_seconds": spent, "train_seconds": train_s,
            "precision_overhead": ((spent.get("probe", 0.0) + spent.get("compile", 0.0))
                                   / train_s if spent and train_s else None),
            "wall_seconds": wall, "load_before": load}


def spread(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    return {"mean": mean, "min": min(values), "max": max(values),
            "spread": max(values) - min(values)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/cpu_tiny.py", help="configs/NAME.py[:ARG]")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--reuse", action="store_true",
                        help="read runs already finished in --workdir with the same flags")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)

    common = {"train.steps": str(args.steps)}
    common.update(kv.split("=", 1) for kv in args.set)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    base = args.workdir or tempfile.mkdtemp(prefix="precision-table-")
    runs: dict[str, dict[int, dict]] = {v: {} for v in variants}
    for seed in seeds:  # alternating: every variant of one seed, then the next seed
        for name in variants:
            flags = {**common, **VARIANTS[name], "train.seed": str(seed)}
            runs[name][seed] = run_one(args.config, os.path.join(base, f"{name}-{seed}"),
                                       flags, args.timeout, args.reuse)
            print(f"{name} seed {seed}: held-out {runs[name][seed]['eval_loss']:.4f}",
                  flush=True)
    result = {"config": args.config, "steps": args.steps, "seeds": seeds, "overrides": common,
              "runs": runs,
              "eval_loss": {v: spread([r["eval_loss"] for r in runs[v].values()])
                            for v in variants}}
    if "auto" in runs and "bf16" in runs:
        result["auto_vs_bf16"] = (result["eval_loss"]["auto"]["mean"]
                                  / result["eval_loss"]["bf16"]["mean"] - 1)
    if "auto" in runs and "fp8" in runs:
        result["auto_minus_fp8"] = (result["eval_loss"]["auto"]["mean"]
                                    - result["eval_loss"]["fp8"]["mean"])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(f"\n{args.config}, {args.steps} steps, seeds {args.seeds}")
    print(f"{'variant':8} {'held-out mean':>14} {'spread':>8} {'fp8 FLOPs':>10} "
          f"{'probes':>7} {'overhead':>9}")
    for v in variants:
        rs = list(runs[v].values())
        frac = [r["fp8_flops_fraction"] for r in rs if r["fp8_flops_fraction"] is not None]
        over = [r["precision_overhead"] for r in rs if r["precision_overhead"] is not None]
        print(f"{v:8} {result['eval_loss'][v]['mean']:>14.4f} "
              f"{result['eval_loss'][v]['spread']:>8.4f} "
              f"{(sum(frac) / len(frac)) if frac else float('nan'):>10.2f} "
              f"{rs[0]['precision_probes'] or 0:>7} "
              f"{(100 * max(over)) if over else float('nan'):>8.2f}%")
    return result


if __name__ == "__main__":
    main()
