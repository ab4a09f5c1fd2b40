"""Context parallelism table: per-device attention memory, traffic and causal balance at
mesh.context = 1, 2, 4, 8 for one row of fixed length; compiled on abstract inputs, never run.

  python benchmarks/context_table.py --out benchmarks/results/context_table_7b_32k.json
  python benchmarks/context_table.py --config configs/deepseek_7b.py:long --model \
      --out benchmarks/results/context_long_7b.json

The attention core of one layer of `--config` (its heads, kv heads and head dims; default
DeepSeek-7B: 32 x 128, MHA) over one row of `--seq` tokens (default 32,768), float32 unless
`--dtype`, forward + backward (the gradients of q, k and v), on C simulated devices with the row
split over `context` (C = 1: the whole-row flash on one device), zigzag layout, both
`model.context_impl`s. Per row of the table:
- `temp_bytes`: the compiled program's per-device temp memory (`memory_analysis`);
  `temp_vs_cp1`: over C = 1's, beside `one_over_c` = 1/C; `total_bytes` (`total_vs_cp1`):
  arguments + outputs + temp (q, k, v and their gradients are arguments and outputs here; in a
  model they are activations);
- `context_bytes`: bytes one device sends along `context` per call (ring model, each collective
  times the known trip counts of the loops around it, `dsjax.metrics.hlo.looped_axis_bytes`;
  the forward and the backward);
- `blocks_zigzag` / `blocks_contiguous`: flash block pairs each device runs (its causal work,
  `dsjax.model.context.block_pairs`), and `imbalance_*` = max / min - 1.
With `--model`, also the config's whole train step on its own mesh: per-device memory predicted
by the compiled program (arguments + outputs - donated + temp, `metrics.predicted_bytes`) against
`--hbm_gb` (80), and the bytes one device sends along `context` in one call of the compiled step
(loops by their known trip counts: the layer scan's, the accumulation's).
`--config.SECTION.FIELD=VALUE` changes the config.
Tiny: `--config configs/cpu_tiny.py --seq 256 --contexts 1,2`.
Prints a table; writes {"rows": [{"context", "impl", "temp_bytes", "temp_vs_cp1", "one_over_c",
"total_bytes", "total_vs_cp1", "context_bytes", "blocks_zigzag", "blocks_contiguous",
"imbalance_zigzag", "imbalance_contiguous"}], "config", "seq", "dtype", "heads", "backend"}
and with `--model` a "model" entry. docs/context.md holds the measured table.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
from dsjax.config import load  # noqa: E402  (no JAX import yet)
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--config", default="configs/deepseek_7b.py", help="configs/NAME.py[:ARG]")
    parser.add_argument("--seq", type=int, default=32768, help="tokens in the row")
    parser.add_argument("--contexts", default="1,2,4,8", help="mesh.context sizes")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block", type=int, default=512, help="flash block_q = block_k")
    parser.add_argument("--model", action="store_true",
                        help="also compile the config's whole train step on its mesh")
    parser.add_argument("--hbm_gb", type=float, default=80.0, help="per-device memory to fit")
    parser.add_argument("--out", default=None, help="JSON output path")
    args, rest = parser.parse_known_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    overrides = []
    for arg in rest:  # launch.py's spelling: --config.mesh.context=4
        if not (arg.startswith("--config.") and "=" in arg):
            parser.error(f"unrecognized argument {arg}")
        overrides.append(arg[len("--config."):])
    try:
        args.overrides = report.parse_overrides(overrides)
    except ValueError as e:
        parser.error(str(e))
    return args


def attention_rows(cfg, args):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=C0415
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    from dsjax import sharding  # pylint: disable=import-outside-toplevel
    from dsjax.model.attention import head_dims  # pylint: disable=import-outside-toplevel
    from dsjax.model.context import block_pairs, context_attention  # pylint: disable=C0415
    from dsjax.model.context_layout import Layout  # pylint: disable=import-outside-toplevel
    from dsjax.model.flash import flash_attention  # pylint: disable=import-outside-toplevel

    m = cfg.model
    H, N = m.num_heads, m.num_kv_heads
    K, U = head_dims(m)
    S, block, dtype = args.seq, args.block, jnp.dtype(args.dtype)
    scale = K ** -0.5

    def compiled(C, impl):
        mesh = Mesh(np.array(jax.devices()[:C]).reshape(1, 1, 1, C), sharding.MESH_AXES)
        split = NamedSharding(mesh, P(None, sharding.CONTEXT))
        arrays = [jax.ShapeDtypeStruct((1, S, n, d), dtype, sharding=split)
                  for n, d in ((H, K), (N, K), (N, U))]
        seg = jax.ShapeDtypeStruct((1, S), jnp.int32, sharding=split)

        def attend(q, k, v, seg_ids):
            if C == 1:
                return flash_attention(q, k, v, seg_ids, scale=scale, block_q=block,
                                       block_k=block)
            return context_attention(q, k, v, seg_ids, scale=scale, block_q=block,
                                     block_k=block, impl=impl, layout=Layout(C, "zigzag"))

        grad = jax.grad(lambda q, k, v, s: jnp.sum(attend(q, k, v, s).astype(jnp.float32)),
                        (0, 1, 2))
        with jax.set_mesh(mesh):
            program = jax.jit(grad).lower(*arrays, seg).compile()
        sent = mx.looped_axis_bytes(program.as_text(), mesh, sharding.CONTEXT)
        a = program.memory_analysis()
        total = a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes
        return a.temp_size_in_bytes, total, sent

    rows, base, base_total = [], None, None
    for C in args.contexts:
        for impl in (["flash"] if C == 1 else ["all_gather", "ring"]):
            temp, total, sent = compiled(C, impl)
            if C == 1:
                base, base_total = temp, total
            work = {kind: block_pairs(Layout(C, kind), S, block, block,
                                      "all_gather" if C == 1 else impl)
                    for kind in ("zigzag", "contiguous")}
            rows.append({"context": C, "impl": impl, "temp_bytes": int(temp),
                         "temp_vs_cp1": temp / base if base else None, "one_over_c": 1 / C,
                         "total_bytes": int(total),
                         "total_vs_cp1": total / base_total if base_total else None,
                         "context_bytes": int(sent),
                         **{f"blocks_{k}": v for k, v in work.items()},
                         **{f"imbalance_{k}": max(v) / min(v) - 1 for k, v in work.items()}})
    return rows


def model_memory(cfg, args):
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    from dsjax import sharding  # pylint: disable=import-outside-toplevel
    from dsjax.batching import Shape  # pylint: disable=import-outside-toplevel
    from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

    trainer = build_trainer(cfg)
    B, data = cfg.data.global_batch, cfg.mesh.data
    micro = cfg.batch.micro_batch or B // data  # the run's micro-step (accumulation)
    shape = Shape(B, B // (micro * data), data)
    program = trainer.programs.get(0, shape)
    a = program.memory_analysis()
    need = mx.predicted_bytes(program)
    sent = mx.looped_axis_bytes(program.as_text(), trainer.mesh, sharding.CONTEXT)
    return {"mesh": sharding.describe(trainer.mesh), "seq_len": cfg.data.seq_len,
            "global_batch": B, "micro_batch": micro, "remat": cfg.remat.policy,
            "context_impl": cfg.model.context_impl, "predicted_bytes": int(need),
            "argument_bytes": int(a.argument_size_in_bytes),
            "temp_bytes": int(a.temp_size_in_bytes), "hbm_bytes": int(args.hbm_gb * 2 ** 30),
            "fits": need <= args.hbm_gb * 2 ** 30, "context_bytes_per_step": int(sent),
            "source": "memory_analysis of the train step compiled by XLA:CPU for this mesh "
                      "(simulated devices, abstract arrays)"}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = load(args.config, args.overrides)
    ensure_cpu_devices(max(args.contexts + ([cfg.mesh.size] if args.model else [])))
    import jax  # pylint: disable=import-outside-toplevel
    from dsjax.model.attention import head_dims  # pylint: disable=import-outside-toplevel
    rows = attention_rows(cfg, args)
    result = {"config": args.config + "".join(f" {k}={v}" for k, v in args.overrides.items()),
              "seq": args.seq, "dtype": args.dtype, "block": args.block,
              "heads": [cfg.model.num_heads, cfg.model.num_kv_heads, *head_dims(cfg.model)],
              "backend": jax.default_backend(), "rows": rows}
    print(f"{args.config}: attention of one row of {args.seq:,} tokens, heads (H, N, K, U) "
          f"{tuple(result['heads'])}, {args.dtype}, fwd + bwd, per device")
    print(f"{'C':>2} {'impl':<10} {'temp MB':>10} {'vs C=1':>7} {'total MB':>9} {'vs C=1':>7} "
          f"{'1/C':>6} {'sent MB':>9} {'imbalance zigzag':>17} {'contiguous':>11}")
    for r in rows:
        print(f"{r['context']:>2} {r['impl']:<10} {r['temp_bytes'] / 2**20:>10.1f} "
              f"{r['temp_vs_cp1']:>7.3f} {r['total_bytes'] / 2**20:>9.1f} "
              f"{r['total_vs_cp1']:>7.3f} {r['one_over_c']:>6.3f} "
              f"{r['context_bytes'] / 2**20:>9.1f} {r['imbalance_zigzag']:>16.1%} "
              f"{r['imbalance_contiguous']:>11.1%}")
    if args.model:
        result["model"] = model = model_memory(cfg, args)
        print(f"whole train step, mesh {model['mesh']}, seq {model['seq_len']:,}, batch "
              f"{model['global_batch']}, remat {model['remat']}: "
              f"{model['predicted_bytes'] / 2**30:.1f} GiB per device predicted "
              f"({'fits' if model['fits'] else 'does NOT fit'} {args.hbm_gb:g} GB); "
              f"{model['context_bytes_per_step'] / 2**30:,.1f} GiB sent along context per step")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
