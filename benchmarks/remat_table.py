"""Recomputation trade-off table: temp memory and FLOPs of every policy, compiled, never run.

  python benchmarks/remat_table.py --config configs/deepseek_7b.py --out benchmarks/results/remat_deepseek_7b.json

Compiles forward+backward of the loss on abstract inputs at the config's full width (one device,
`--micro_batch` rows of `data.seq_len` tokens) for a few layers, and extrapolates per layer to the
config's depth (see dsjax/remat_plan.py for why: `cost_analysis` counts a scan body once).
`--set SECTION.FIELD=VALUE` (repeatable) changes the config, e.g. `--set model.hidden_size=256`.
`--baseline SECTION.FIELD=VALUE` (repeatable) compiles every row a second time with those
changes on top, e.g. the unfused attention and unchunked loss against today's defaults:

  python benchmarks/remat_table.py --config configs/deepseek_7b.py --rows none/all,attention_core/all --baseline model.attention_impl=xla --baseline model.loss_chunk=0 --out benchmarks/results/remat_deepseek_7b_vs_unfused.json

Prints a table; writes {"config", "rows": [{"policy", "layers", "temp_bytes", "flops",
"mem_ratio", "flops_ratio", ...}]} with ratios relative to `none`; with --baseline also
"baseline" (its changes) and per row "baseline_temp_bytes", "baseline_flops" and
"temp_vs_baseline".
"""

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices(1)

import jax  # noqa: E402

from dsjax import config as config_lib  # noqa: E402
from dsjax import remat_plan, sharding  # noqa: E402

ROWS = (("none", "all"), ("full", "all"), ("dots", "all"), ("dots_no_batch", "all"),
        ("attention_core", "all"), ("names:mlp_hidden,attn_out,mlp_out", "all"),
        ("offload:mlp_hidden,attn_context", "all"), ("full", "every_2"),
        ("attention_core", "every_2"), ("dots", "every_2"))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--micro_batch", type=int, default=1, help="rows per device")
    parser.add_argument("--seq_len", type=int, default=0, help="override data.seq_len")
    parser.add_argument("--dtype", default="", help="override train.compute_dtype")
    parser.add_argument("--rows", default="", help="only these policy/layers rows, e.g. "
                        "none/all,attention_core/all")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="config override, e.g. --set model.hidden_size=256 (repeatable)")
    parser.add_argument("--baseline", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="compile every row again with this override on top and report "
                             "both (repeatable), e.g. --baseline model.attention_impl=xla")
    args = parser.parse_args(argv)

    try:
        overrides = report.parse_overrides(args.set)
    except ValueError as e:
        parser.error(f"--set {e}")
    try:
        baseline = report.parse_overrides(args.baseline)
    except ValueError as e:
        parser.error(f"--baseline {e}")
    one = _one_device(args)
    cfg = config_lib.load(args.config, {**overrides, **one})
    base_cfg = (config_lib.load(args.config, {**overrides, **baseline, **one})
                if baseline else None)
    name = " ".join([args.config] + [f"--set {item}" for item in args.set])
    mesh = sharding.make_mesh(cfg, jax.devices()[:1])

    wanted = ROWS
    if args.rows:
        wanted = tuple(tuple(r.split("/")) for r in args.rows.split(","))
        if wanted[0] != ("none", "all"):
            wanted = (("none", "all"),) + wanted  # ratios are relative to none
    rows, start = [], report.timing_start()  # compile_s is a timing: record the load
    for policy, layers in wanted:
        t0 = time.perf_counter()
        cost = remat_plan.measure(cfg, mesh, policy, layers)
        rows.append(dataclasses.asdict(cost) | {"compile_s": time.perf_counter() - t0})
        if base_cfg is not None:
            against = remat_plan.measure(base_cfg, mesh, policy, layers)
            rows[-1] |= {"baseline_temp_bytes": against.temp_bytes,
                         "baseline_flops": against.flops,
                         "temp_vs_baseline": cost.temp_bytes / against.temp_bytes}
    base = rows[0]
    for r in rows:
        r["mem_ratio"] = r["temp_bytes"] / base["temp_bytes"]
        r["flops_ratio"] = r["flops"] / base["flops"]
        r["activation_bytes_saved_per_layer"] = (base["per_layer_temp_bytes"]
                                                 - r["per_layer_temp_bytes"])
    result = {"config": name, "seq_len": cfg.data.seq_len, "micro_batch": args.micro_batch,
              "compute_dtype": cfg.train.compute_dtype, "num_layers": cfg.model.num_layers,
              "backend": jax.devices()[0].platform,
              "note": "offload:* is a no-op on CPU (no pinned host memory space): it reads as "
                      "names:* there. On GPU, cost_analysis() does not count GEMMs that XLA hands "
                      "to cuBLAS (custom calls), so GPU FLOPs columns are not meaningful: read "
                      "FLOPs from a CPU compile, memory from either. cost_analysis() also counts "
                      "a loop body once: with flash attention (its block loops) or a loss of "
                      "several chunks the FLOPs columns undercount; compare FLOPs with "
                      "model.attention_impl=xla and model.loss_chunk=0.",
              "rows": rows, "load": report.load_record(start)}
    if base_cfg is not None:
        result["baseline"] = args.baseline

    print(f"{name}: seq {cfg.data.seq_len}, micro-batch {args.micro_batch}, "
          f"{cfg.train.compute_dtype}, {cfg.model.num_layers} layers, "
          f"{jax.devices()[0].platform} compile")
    header = (f"{'policy':<36} {'layers':<8} {'temp GiB':>9} {'mem':>6} {'TFLOPs':>9} "
              f"{'flops':>6} {'saved/layer MiB':>16}"
              + (f" {'baseline GiB':>13} {'vs base':>8}" if base_cfg is not None else ""))
    if base_cfg is not None:
        print("baseline: " + " ".join(args.baseline))
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['policy']:<36} {r['layers']:<8} {r['temp_bytes'] / 2**30:>9.2f} "
              f"{r['mem_ratio']:>6.3f} {r['flops'] / 1e12:>9.2f} {r['flops_ratio']:>6.3f} "
              f"{r['activation_bytes_saved_per_layer'] / 2**20:>16.1f}"
              + (f" {r['baseline_temp_bytes'] / 2**30:>13.2f} {r['temp_vs_baseline']:>8.3f}"
                 if base_cfg is not None else ""))
    report.write_json(args.out, result)
    return result


def _one_device(args) -> dict:
    """The overrides that put a config on one device with `--micro_batch` rows of `--seq_len`
    (or the config's) tokens; applied before the config is validated, so a width that only
    divides one device (e.g. 4 heads of a tensor-8 config) loads."""
    one = {"mesh.data": 1, "mesh.tensor": 1, "mesh.pipeline": 1, "mesh.fsdp": False,
           "data.global_batch": args.micro_batch}
    if args.seq_len:
        one["data.seq_len"] = args.seq_len
    if args.dtype:
        one["train.compute_dtype"] = args.dtype
    return one


if __name__ == "__main__":
    main()
