"""MoE layer cost table: compiled temp memory and FLOPs of each `model.moe_impl`, never run.

  python benchmarks/moe_table.py --out benchmarks/results/moe_table_v2_lite.json

One routed MoE layer (`dsjax.model.moe.MoE`, no shared experts: the routed part is what the
implementations change) at DeepSeek-V2-Lite's width by default (D 2048, expert width 1408, 64
experts, top-6, softmax router), `--tokens` tokens on one device, float32 unless `--dtype`,
compiled on abstract inputs:
- `temp_bytes`: temp memory of forward + backward (the loss sum(y * c), gradients of the
  input and every weight), from the compiled program's `memory_analysis`;
- `fwd_flops`, `step_flops`: FLOPs of the forward, and of forward + backward, from
  `cost_analysis` of the lowered program (XLA's HLO cost analysis before optimisation; compiling
  the unrolled loop takes minutes). The padded implementation's tile loop is lowered fully
  unrolled (`MoE.unroll`) so that every tile of its static bound is counted (`cost_analysis`
  counts a loop body once; at run time the tiles past the last row are skipped); the others
  have no loop.
- `fwd_vs_routed`: fwd_flops / (tokens * k * 3 * 2 * D * F), the routed work; `temp_vs_capacity`:
  temp_bytes / that of `capacity` (the [E, tokens, D] dropless buffers).
Tiny: `--tokens 64 --hidden 32 --expert_dim 16 --experts 8 --k 2`.
Prints a table; writes {"rows": [{"impl", "tile", "temp_bytes", "fwd_flops", "step_flops",
"fwd_vs_routed", "temp_vs_capacity", "compile_s"}], "dims", "backend", load keys (report.py)}.
docs/moe.md holds the measured table.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices(1)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsjax.model import moe_grouped  # noqa: E402
from dsjax.model.moe import MoE  # noqa: E402


def layer(args, impl: str, unroll: bool) -> MoE:
    return MoE(num_experts=args.experts, experts_per_token=args.k, expert_dim=args.expert_dim,
               n_shared=0, n_group=1, topk_group=1, routed_scaling_factor=1.0,
               scoring="softmax", norm_topk_prob=False, capacity_factor=0.0,
               expert_parallel=False, init_std=0.02, impl=impl, tile=args.tile,
               exchange="static", unroll=unroll, dtype=jnp.dtype(args.dtype))


def lowered(args, impl: str, unroll: bool, backward: bool):
    moe = layer(args, impl, unroll)
    x = jax.ShapeDtypeStruct((1, args.tokens, args.hidden), jnp.dtype(args.dtype))
    params = jax.eval_shape(lambda x: nn.unbox(moe.init(jax.random.key(0), x)["params"]), x)

    def loss(params, x):
        y, _ = moe.apply({"params": params}, x)
        return jnp.sum(y.astype(jnp.float32) * 1e-3)

    fn = jax.grad(loss, argnums=(0, 1)) if backward else loss
    return jax.jit(fn).lower(params, x)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens on the device")
    parser.add_argument("--hidden", type=int, default=2048, help="model width D")
    parser.add_argument("--expert_dim", type=int, default=1408, help="expert width F")
    parser.add_argument("--experts", type=int, default=64, help="routed experts E")
    parser.add_argument("--k", type=int, default=6, help="experts per token")
    parser.add_argument("--tile", type=int, default=0, help="padded rows per tile; 0 = the "
                        "backend's default (dsjax/model/moe_grouped.py)")
    parser.add_argument("--dtype", default="float32", help="compute dtype (XLA:CPU runs bf16 "
                        "dots in float32 and keeps float32 copies of their operands, which "
                        "measures the CPU's conversion, not the layout)")
    parser.add_argument("--impls", default="capacity,ragged,padded")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)

    routed = args.tokens * args.k * 3 * 2 * args.hidden * args.expert_dim
    rows, start = [], report.timing_start()  # compile_s is a timing: record the load
    for impl in args.impls.split(","):
        t0 = time.perf_counter()
        program = lowered(args, impl, unroll=False, backward=True)
        mem = program.compile().memory_analysis()
        unrolled = impl == "padded"  # every tile of the static bound in straight-line code
        fwd = lowered(args, impl, unroll=unrolled, backward=False).cost_analysis()
        step = (lowered(args, impl, unroll=True, backward=True) if unrolled
                else program).cost_analysis()
        rows.append({"impl": impl,
                     "tile": moe_grouped.resolve_tile(args.tile) if impl == "padded" else None,
                     "temp_bytes": int(mem.temp_size_in_bytes),
                     "fwd_flops": float(fwd["flops"]), "step_flops": float(step["flops"]),
                     "compile_s": round(time.perf_counter() - t0, 1)})
    base = next((r["temp_bytes"] for r in rows if r["impl"] == "capacity"), None)
    for r in rows:
        r["fwd_vs_routed"] = round(r["fwd_flops"] / routed, 3)
        r["temp_vs_capacity"] = round(r["temp_bytes"] / base, 4) if base else None
    result = {"rows": rows, "backend": jax.default_backend(), "routed_fwd_flops": routed,
              "dims": {k: getattr(args, k) for k in ("tokens", "hidden", "expert_dim",
                                                     "experts", "k", "dtype")},
              **report.load_record(start)}
    print(f"MoE layer, {args.tokens} tokens, D {args.hidden}, F {args.expert_dim}, "
          f"E {args.experts}, k {args.k}, {args.dtype}, {jax.default_backend()}; "
          f"{report.describe_load(result)}")
    print(f"{'impl':>9} {'tile':>5} {'temp GB':>9} {'vs capacity':>12} {'fwd GFLOP':>10} "
          f"{'vs routed':>10} {'step GFLOP':>11}")
    for r in rows:
        print(f"{r['impl']:>9} {r['tile'] or '':>5} {r['temp_bytes'] / 1e9:9.3f} "
              f"{r['temp_vs_capacity'] or 0:12.3f} {r['fwd_flops'] / 1e9:10.1f} "
              f"{r['fwd_vs_routed']:10.3f} {r['step_flops'] / 1e9:11.1f}")
    report.warn_if_contended(result, "moe_table (compile_s)")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
