"""Pipeline schedules side by side: temp memory per device, collective-permutes and bubble,
compiled, never run.

  python benchmarks/pipeline_table.py --config configs/cpu_tiny.py --out benchmarks/results/pipeline_cpu_tiny.json

For the config's mesh (mesh.pipeline > 1; `--pipeline` overrides, taking devices from
mesh.data) compiles the loss and gradient of the training step (`dsjax.model.loss.loss_fn` under
`jax.value_and_grad`, with the step's shardings: what the schedule changes; the optimizer update
adds the same to every row) for every schedule and microbatch count, and reads
`memory_analysis().temp_size_in_bytes` and the collective-permute instructions of the compiled
HLO (static count: one in a loop body counts once), and the FLOPs of the same program compiled
with its scans unrolled. Static FLOPs count idle ticks as work, so the table also gives the
FLOPs one more microbatch adds (GFLOP/mb, from a second unrolled compile at M + S microbatches
of the same size); for the 1F1B schedules, less the head, which their static count has on every
stage's every tick but which runs once per microbatch on the last stage (run/mb); and that over
gpipe's at the same microbatch count and remat policy: a schedule that recomputes shows above 1
(docs/pipeline.md, "Measurements"). `--rows_per_microbatch N`
fixes the microbatch size (global batch = M * N) to show how memory grows with M; by default
the global batch stays the config's. Bubble is the schedule's analytic idle share
(dsjax/pipeline/). The interleaved schedules' chunks per stage (`--repeats`) default to the
config's `pipeline.repeats` when above 1, else the smallest R >= 2 that splits the layers
evenly. A row whose config does not validate (layers that do not split into stages x repeats, a
microbatch count the batch does not divide) is kept with the reason instead of figures.
Prints a table; writes {"config": str, "rows": [{"schedule", "microbatches", "repeats",
"temp_bytes", "collective_permutes", "bubble", "flops", "flops_per_microbatch", "head_flops",
"executed_flops_per_microbatch", "flops_vs_gpipe", ...} or {"schedule", "microbatches",
"repeats", "global_batch", "skipped": reason}]}.
"""

import argparse
import dataclasses
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
from dsjax import config as config_lib  # noqa: E402
from dsjax.config.sections import (HAND_BACKWARD_SCHEDULES, INTERLEAVED_SCHEDULES,  # noqa
                                   PIPELINE_SCHEDULES, chunks_per_stage)
from dsjax.errors import ConfigError  # noqa: E402
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402

# The opcode, sync or async start (whose result type is a tuple), never its -done.
_PERMUTE = re.compile(r"\scollective-permute(-start)?\(")


def _with(cfg, schedule, microbatches, repeats, global_batch):
    return dataclasses.replace(
        cfg, pipeline=dataclasses.replace(cfg.pipeline, schedule=schedule,
                                          microbatches=microbatches, repeats=repeats),
        data=dataclasses.replace(cfg.data, global_batch=global_batch))


def interleaved_repeats(cfg, schedule: str, microbatches: int,
                        rows_per_microbatch: int = 0) -> int:
    """The config's pipeline.repeats when above 1, else the smallest R >= 2 for which the
    interleaved `schedule` validates (its chunks split the layers); 2 when none does (that row
    then says why)."""
    if cfg.pipeline.repeats > 1:
        return cfg.pipeline.repeats
    batch = rows_per_microbatch * microbatches or cfg.data.global_batch
    for repeats in range(2, cfg.model.num_layers + 1):
        try:
            config_lib.validate(_with(cfg, schedule, microbatches, repeats, batch))
            return repeats
        except ConfigError:
            continue
    return 2


def head_flops(cfg, pipe) -> float:
    """Per-device FLOPs of the output head's (and MTP modules') loss and gradient on one
    microbatch, compiled under the step's mesh and shardings: work the static count of a
    hand-backward schedule puts on every stage's every tick, and which runs once per microbatch,
    on the last stage."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
    from dsjax import sharding, train  # pylint: disable=g-import-not-at-top
    from dsjax.metrics.flops import compiled_flops  # pylint: disable=g-import-not-at-top
    from dsjax.pipeline import stages  # pylint: disable=g-import-not-at-top

    rows = cfg.data.global_batch // cfg.pipeline.microbatches
    trainer = train.build_trainer(dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, global_batch=rows)))
    top = {k: v for k, v in trainer.abstract_state().params.items() if k != pipe.stack}
    y = jax.ShapeDtypeStruct((rows, cfg.data.seq_len, cfg.model.hidden_size), pipe.model.dtype,
                             sharding=NamedSharding(trainer.mesh, PartitionSpec("data")))

    def head(top, y, mb):  # the terms of `one_f_one_b`'s head, summed
        mtp = stages.mtp_terms(pipe, top, y, mb)
        return (stages.head_nll(pipe.model, top, y, mb["targets"], mb["weights"])
                + sum(jnp.sum(mtp[k]) for k in ("nll", "balance") if k in mtp))

    fn = jax.jit(jax.grad(head, argnums=(0, 1)))
    with sharding.activate(trainer.mesh, trainer.rules):
        return compiled_flops(fn.lower(top, y, trainer.abstract_batch()).compile())


def measure(cfg, schedule: str, microbatches: int, repeats: int = 1,
            rows_per_microbatch: int = 0, flops: bool = True) -> dict:
    """One row: compile loss + gradient of `cfg` under `schedule` on all devices; a config that
    does not validate gives a row with the reason ("skipped") instead. `flops=False`: memory
    and transfers only (the FLOPs take three more compiles)."""
    import jax  # pylint: disable=g-import-not-at-top
    from dsjax import pipeline, sharding, train  # pylint: disable=g-import-not-at-top
    from dsjax.metrics.flops import compiled_flops  # pylint: disable=g-import-not-at-top
    from dsjax.model.loss import loss_fn  # pylint: disable=g-import-not-at-top

    batch = rows_per_microbatch * microbatches or cfg.data.global_batch
    repeats = chunks_per_stage(schedule, repeats)
    cfg = _with(cfg, schedule, microbatches, repeats, batch)
    try:
        config_lib.validate(cfg)
    except ConfigError as e:
        return {"schedule": schedule, "microbatches": microbatches, "repeats": repeats,
                "global_batch": batch, "skipped": str(e)}
    trainer = train.build_trainer(cfg)
    state = trainer.abstract_state()
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, state.objective, b)[0]))

    def unrolled_flops(trainer) -> float:
        """FLOPs of the program compiled with every scan unrolled (the ticks and the layer
        stack): `cost_analysis` counts a loop body once."""
        state = trainer.abstract_state()
        unrolled = dataclasses.replace(state.objective,
                                       model=state.objective.model.clone(scan_unroll=True))
        fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, unrolled, b)[0]))
        with sharding.activate(trainer.mesh, trainer.rules):
            return compiled_flops(fn.lower(state.params, trainer.abstract_batch()).compile())

    with sharding.activate(trainer.mesh, trainer.rules):
        t0 = time.perf_counter()
        compiled = grad_fn.lower(state.params, trainer.abstract_batch()).compile()
        compile_s = time.perf_counter() - t0  # the program the step runs, not the unrolled one
    hlo = compiled.as_text()
    row = {"schedule": schedule, "microbatches": microbatches, "repeats": repeats,
           "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
           "collective_permutes": len(_PERMUTE.findall(hlo)),
           "bubble": pipeline.bubble_fraction(schedule, cfg.mesh.pipeline, microbatches,
                                              repeats, moe=cfg.model.n_routed_experts > 0),
           "global_batch": batch,
           "ticks": pipeline.ticks(schedule, cfg.mesh.pipeline, microbatches, repeats),
           "compile_s": compile_s}
    if not flops:
        return row
    flops = unrolled_flops(trainer)
    # S more microbatches of the same size (the smallest step that splits): what a microbatch
    # adds, without the idle ticks and the per-step work that static FLOPs also count.
    S = cfg.mesh.pipeline
    more = _with(cfg, schedule, microbatches + S, repeats, batch // microbatches * (
        microbatches + S))
    per_microbatch = (unrolled_flops(train.build_trainer(more)) - flops) / S
    # The static count has the head on each of a microbatch's R ticks on every stage; it runs
    # once, on the last stage: 1/S per device.
    head = (head_flops(cfg, state.objective) if schedule in HAND_BACKWARD_SCHEDULES else 0.0)
    executed = per_microbatch - (repeats - 1 / S) * head
    return {**row, "flops": flops, "flops_per_microbatch": per_microbatch, "head_flops": head,
            "executed_flops_per_microbatch": executed}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--schedules", default=",".join(PIPELINE_SCHEDULES))
    parser.add_argument("--microbatches", default="", help="comma-separated counts (default: "
                        "the config's pipeline.microbatches)")
    parser.add_argument("--repeats", type=int, default=0, help="circular, interleaved_1f1b: "
                        "chunks per stage "
                        "(default: pipeline.repeats if > 1, else the smallest >= 2 that splits "
                        "the layers)")
    parser.add_argument("--pipeline", type=int, default=0, help="override mesh.pipeline "
                        "(mesh.data shrinks to keep the device count)")
    parser.add_argument("--rows_per_microbatch", type=int, default=0,
                        help="fix the microbatch size instead of the global batch")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config override, e.g. --set optim.name=adamw (repeatable)")
    args = parser.parse_args(argv)

    try:
        overrides = report.parse_overrides(args.set)
    except ValueError as e:
        parser.error(f"--set {e}")
    cfg = config_lib.load(args.config, overrides)
    if args.pipeline:
        devices = cfg.mesh.size
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
            cfg.mesh, pipeline=args.pipeline,
            data=devices // (cfg.mesh.tensor * args.pipeline)))
    if cfg.mesh.pipeline < 2:
        parser.error(f"{args.config} has mesh.pipeline = {cfg.mesh.pipeline}; pass --pipeline")
    ensure_cpu_devices(cfg.mesh.size)
    counts = [int(m) for m in args.microbatches.split(",") if m] or [cfg.pipeline.microbatches]

    rows = []
    for schedule in args.schedules.split(","):
        for m in counts:
            r = 1 if schedule not in INTERLEAVED_SCHEDULES else (
                args.repeats or interleaved_repeats(cfg, schedule, m, args.rows_per_microbatch))
            rows.append(measure(cfg, schedule, m, r, args.rows_per_microbatch))
    for row in rows:  # a microbatch's FLOPs over gpipe's at the same count and remat policy
        base = [r for r in rows if r["schedule"] == "gpipe" and "flops" in r
                and r["microbatches"] == row["microbatches"]]
        if "flops" in row:
            row["flops_vs_gpipe"] = (row["executed_flops_per_microbatch"]
                                     / base[0]["executed_flops_per_microbatch"] if base else None)
    import jax  # pylint: disable=g-import-not-at-top
    mesh = {"data": cfg.mesh.data, "tensor": cfg.mesh.tensor, "pipeline": cfg.mesh.pipeline}
    name = " ".join([args.config] + [f"--set {item}" for item in args.set])
    result = {"config": name, "mesh": mesh, "num_layers": cfg.model.num_layers,
              "seq_len": cfg.data.seq_len, "compute_dtype": cfg.train.compute_dtype,
              "remat": f"{cfg.remat.policy}/{cfg.remat.layers}",
              "backend": jax.devices()[0].platform, "rows": rows}

    print(f"{name}: mesh {mesh}, {cfg.model.num_layers} layers, seq {cfg.data.seq_len}, "
          f"{cfg.train.compute_dtype}, remat {result['remat']}, loss+grad compiled on "
          f"{result['backend']}")
    header = (f"{'schedule':<16} {'micro':>5} {'repeats':>7} {'batch':>5} {'ticks':>5} "
              f"{'temp MiB':>9} {'permutes':>8} {'bubble':>7} {'GFLOP':>8} {'GFLOP/mb':>8} "
              f"{'run/mb':>8} {'vs gpipe':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        head = (f"{r['schedule']:<16} {r['microbatches']:>5} {r['repeats']:>7} "
                f"{r['global_batch']:>5}")
        if "skipped" in r:
            print(f"{head} skipped: {r['skipped']}")
        else:
            ratio = "-" if r["flops_vs_gpipe"] is None else f"{r['flops_vs_gpipe']:.3f}"
            print(f"{head} {r['ticks']:>5} {r['temp_bytes'] / 2**20:>9.2f} "
                  f"{r['collective_permutes']:>8} {r['bubble']:>7.3f} {r['flops'] / 1e9:>8.3f} "
                  f"{r['flops_per_microbatch'] / 1e9:>8.3f} "
                  f"{r['executed_flops_per_microbatch'] / 1e9:>8.3f} {ratio:>8}")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
