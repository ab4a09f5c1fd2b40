"""Data-parallel bytes of the 1-bit Adam train steps, read from the compiled programs.

  python benchmarks/comm_bytes.py --config configs/cpu_tiny.py --config.optim.name=onebit_adam \
      --out benchmarks/results/comm_bytes_cpu_tiny.json
  python benchmarks/comm_bytes.py --config configs/h100_fp8.py:smoke \
      --out benchmarks/results/comm_bytes_h100_fp8_smoke.json

Compiles (abstract inputs, nothing runs) the warmup and the compressed train step of a config
whose optimizer is `onebit_adam` (`--config.SECTION.FIELD=VALUE` or `--override SECTION.FIELD=VALUE`
change the config). From each program's HLO it takes the collectives whose device groups span
the `data` mesh axis (the model's own tensor-parallel collectives stay out) and the bytes one device
sends in them, ring model (`dsjax.metrics.Collective.sent_bytes`). The warmup step all-reduces the
float32 gradients; the compressed step sends packed signs and one scale per bucket, so the ratio
should be about 1/32 (Tang et al. 2021, arXiv 2102.02888, §4).
Prints a table; writes {"config", "exact_bytes" (warmup), "compressed_bytes", "ratio",
"collectives_per_step" (compressed), "exact_collectives_per_step", "mesh",
"gradient_floats_per_device", "float32_allreduce_bytes"}.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
from dsjax.config import load  # noqa: E402  (no JAX import yet)
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
    parser.add_argument("--override", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--out", default=None, help="JSON output path")
    args, rest = parser.parse_known_args(argv)
    for arg in rest:  # launch.py's spelling: --config.optim.name=onebit_adam
        if not (arg.startswith("--config.") and "=" in arg):
            parser.error(f"unrecognized argument {arg}")
        args.override.append(arg[len("--config."):])
    try:
        args.overrides = report.parse_overrides(args.override)
    except ValueError as e:
        parser.error(f"--override {e}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load(args.config, args.overrides)
    if cfg.optim.name != "onebit_adam":
        sys.exit(f"comm_bytes: {args.config} trains with optim.name={cfg.optim.name!r}; add "
                 f"--config.optim.name=onebit_adam")
    ensure_cpu_devices(cfg.mesh.size)
    import jax  # pylint: disable=import-outside-toplevel
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    from dsjax import sharding  # pylint: disable=import-outside-toplevel
    from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

    trainer = build_trainer(cfg)
    state, batch = trainer.abstract_state(), trainer.abstract_batch()
    steps = {}
    with sharding.activate(trainer.mesh, trainer.rules):
        for name, fn in (("warmup", trainer.jitted(0)), ("compressed", trainer.jitted(1))):
            hlo = fn.lower(state, batch).compile().as_text()
            steps[name] = mx.axis_collectives(hlo, trainer.mesh, "data")
    sent = {name: sum(c.sent_bytes() for c in ops) for name, ops in steps.items()}
    # This device's gradient: the params' shards (none is split over `data`: no fsdp).
    grad_floats = sum(math.prod(p.sharding.shard_shape(p.shape))
                      for p in jax.tree.leaves(state.params))
    w = cfg.mesh.data
    f32_allreduce = 2 * (w - 1) / w * 4 * grad_floats
    result = {"config": args.config + "".join(f" {k}={v}" for k, v in args.overrides.items()),
              "exact_bytes": round(sent["warmup"]), "compressed_bytes": round(sent["compressed"]),
              "ratio": sent["compressed"] / sent["warmup"],
              "collectives_per_step": len(steps["compressed"]),
              "exact_collectives_per_step": len(steps["warmup"]),
              "mesh": sharding.describe(trainer.mesh), "gradient_floats_per_device": grad_floats,
              "float32_allreduce_bytes": round(f32_allreduce)}
    k = cfg.optim.refresh_every
    # With optim.refresh_every = K one step in K after the freeze is an exact (warmup) step.
    result["refresh_every"] = k
    result["mean_ratio_after_freeze"] = (
        result["ratio"] if not k else (1 + (k - 1) * result["ratio"]) / k)

    print(f"{result['config']}: mesh {result['mesh']}, {grad_floats:,} gradient floats per "
          f"device, float32 all-reduce of them {f32_allreduce:,.0f} B sent per device (ring)")
    print(f"{'train step':<12} {'collectives':>11} {'bytes sent/device':>18} {'vs warmup':>10}  "
          f"data-parallel collectives")
    for name in ("warmup", "compressed"):
        ops = steps[name]
        kinds = ", ".join(f"{sum(c.op == op for c in ops)} {op}"
                          for op in sorted({c.op for c in ops}))
        ratio = "1/%.1f" % (sent["warmup"] / sent[name])
        print(f"{name:<12} {len(ops):>11} {sent[name]:>18,.0f} {ratio:>10}  {kinds}")
    if k:
        print(f"refresh_every={k}: one exact step in {k} after the freeze, so the mean traffic "
              f"after it is 1/{1 / result['mean_ratio_after_freeze']:.1f} of the warmup step's")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
