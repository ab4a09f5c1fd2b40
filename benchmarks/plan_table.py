"""Does the planner rank reality? Its predicted step times against measured ones, and its
analytic memory against the compiled programs', for layouts spread over its whole ranking.

  python benchmarks/plan_table.py --config configs/cpu_tiny.py --devices 8 --measure 12 \
      --out benchmarks/results/plan_cpu_tiny.json

Plans `--config` for `--devices` simulated CPU devices (`--device cpu`: the profile measured now),
takes `--measure` layouts evenly spaced over the ranking of every layout predicted to fit (the
best, the worst and between), compiles each (its memory, and its collectives for the prediction),
then times them with benchmarks/step_time.py: each layout in a process of its own, alternating
rounds of `--steps` steps, on synthetic batches. Reports Spearman's rho between predicted and
measured step times, and each layout's analytic memory over its compiled memory.
`--config.SECTION.FIELD=VALUE` changes the config. Tiny: `--measure 2 --steps 1 --rounds 1`
with `--config.model.num_layers=2 --config.data.global_batch=8`.
Writes {"rows": [{"layout", "predicted_step_ms", "measured_step_ms", "model_mem_bytes",
"compiled_mem_bytes", "mem_error", "overrides"}], "spearman_rho", "mem_error_max",
"profile", "load_before", "load_after", "cores", "others_cpu_share", "contended"}.
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
import step_time  # noqa: E402  (benchmarks/step_time.py)
from dsjax.config import load  # noqa: E402  (no JAX import yet)
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--config", default="configs/cpu_tiny.py", help="configs/NAME.py[:ARG]")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--measure", type=int, default=10, help="layouts to time")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None, help="JSON output path")
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for arg in rest:
        if not (arg.startswith("--config.") and "=" in arg):
            parser.error(f"unrecognized argument {arg}")
        overrides.append(arg[len("--config."):])
    args.overrides = report.parse_overrides(overrides)
    if args.measure < 2:
        parser.error("--measure: at least 2 layouts (a rank correlation needs them)")
    return args


def spread(items: list, n: int) -> list:
    """`n` items evenly spaced over `items`, first and last included."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load(args.config, args.overrides)
    ensure_cpu_devices(args.devices)
    from dsjax.plan import planner, profiles  # pylint: disable=import-outside-toplevel

    prof = profiles.profile("cpu", args.devices)
    result = planner.plan(cfg, args.devices, prof, 1, 0, backend="cpu", compile_fn=None)
    chosen = spread(result.plans, args.measure)
    for p in chosen:  # compiled: its memory, and its collectives for the prediction
        planner.prove(p, prof, result.params, "cpu")
    specs = ["|".join([args.config] + [f"{k}={v}" for k, v in args.overrides.items()]
                      + [f"{k}={v}" for k, v in p.layout.overrides().items()]) for p in chosen]
    with tempfile.TemporaryDirectory() as tmp:
        timed = step_time.main([a for s in specs for a in ("--config", s)]
                               + ["--steps", str(args.steps), "--rounds", str(args.rounds),
                                  "--out", os.path.join(tmp, "step_time.json")])
    rows = []
    for p, spec, measured in zip(chosen, specs, timed["rows"]):
        rows.append({"layout": p.layout.describe(),
                     "predicted_step_ms": 1000 * p.estimate.step_s,
                     "measured_step_ms": measured["step_ms"],
                     "model_mem_bytes": int(p.model_mem_bytes),
                     "compiled_mem_bytes": int(p.compiled.mem_bytes),
                     "mem_error": p.model_mem_bytes / p.compiled.mem_bytes - 1,
                     "overrides": p.layout.overrides(), "spec": spec})
    rho = planner.spearman([r["predicted_step_ms"] for r in rows],
                           [r["measured_step_ms"] for r in rows])
    conditions = {k: timed[k] for k in ("load_before", "load_after", "cores",
                                        "others_cpu_share", "contended")}
    out = {"config": args.config, "overrides": args.overrides, "devices": args.devices,
           "profile": prof.__dict__, "fitting_layouts": len(result.plans),
           "rows": rows, "spearman_rho": rho,
           "mem_error_max": max(abs(r["mem_error"]) for r in rows),
           "method": "step_time.py: each layout in its own process, alternating rounds",
           **conditions}
    print(f"{'layout':<44} {'pred ms':>9} {'meas ms':>9} {'model MiB':>10} {'compiled':>9} "
          f"{'error':>7}")
    for r in rows:
        print(f"{r['layout']:<44} {r['predicted_step_ms']:>9.1f} {r['measured_step_ms']:>9.1f} "
              f"{r['model_mem_bytes'] / 2**20:>10.1f} {r['compiled_mem_bytes'] / 2**20:>9.1f} "
              f"{r['mem_error']:>+7.1%}")
    print(f"Spearman rho (predicted vs measured step time) {rho:.3f} over {len(rows)} layouts; "
          f"memory error at most {out['mem_error_max']:.1%}; {report.describe_load(conditions)}")
    report.warn_if_contended(conditions, "plan_table")
    report.write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
