"""Attention impl table: compiled temp memory, error against xla and CPU time of the core.

  python benchmarks/attention_table.py --out benchmarks/results/attention_table_cpu.json

For each impl this backend runs (xla, flash; cudnn on NVIDIA GPUs; pallas on GPUs, or
interpreted with --pallas), the attention core's forward + backward (dsjax.model.attention,
value_and_grad w.r.t. q, k, v) at DeepSeek-7B's attention (32 heads x 128, D 4096) and V2-Lite's
MLA (16 heads, nope 128 + rope 64, v 128; kv_lora 512 only shapes k/v before the core), B = 1,
at each --seq_lens: temp_bytes from the compiled program (never run). At --check_seq (random
inputs, packed documents, actually run, float32): max |diff| of the output and of the q/k/v
grads against xla, and milliseconds per forward + backward unless --no_time. Tiny:
`--heads 4 --head_dim 16 --mla_dims 4,16,8,16 --seq_lens 64,128 --check_seq 64`.
Prints a table; writes {"rows": [{"impl", "seq_len", "attention", "temp_bytes",
"max_abs_diff", "grad_max_abs_diff", "ms"}], "dims", "backend", load keys (report.py)}.
docs/attention.md holds the measured table and what it means for model.attention_impl=auto.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsjax.model import attention  # noqa: E402


def impls(backend: str, pallas: bool) -> list[str]:
    """xla first (the reference), then every impl this backend can run."""
    out = ["xla", "flash"]
    if backend == "cuda":
        out.append("cudnn")
    if backend in ("cuda", "rocm") or pallas:
        out.append("pallas")
    return out


def shapes(kind: str, args, seq: int) -> dict[str, tuple[int, ...]]:
    """The core's inputs: q, k, v (and MLA's q_pe, k_pe) for batch 1."""
    if kind == "mha":
        H, K = args.heads, args.head_dim
        return {"q": (1, seq, H, K), "k": (1, seq, H, K), "v": (1, seq, H, K)}
    H, A, P, U = args.mla_dims
    return {"q": (1, seq, H, A), "k": (1, seq, H, A), "v": (1, seq, H, U),
            "q_pe": (1, seq, H, P), "k_pe": (1, seq, P)}


def fwd_bwd(impl: str, scale: float, block: int, dtype):
    """(inputs, segment ids) -> (output, grads of sum(output * w) w.r.t. every input)."""
    def loss(inputs, seg, w):
        out = attention.attention_core(
            inputs["q"], inputs["k"], inputs["v"], seg, scale=scale, impl=impl, block_q=block,
            block_k=block, dtype=dtype, q_pe_BSHP=inputs.get("q_pe"),
            k_pe_BTP=inputs.get("k_pe"))
        return jnp.sum(out.astype(jnp.float32) * w), out
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def packed_segments(rng, seq: int) -> np.ndarray:
    """[1, S] ids of three packed documents (non-decreasing)."""
    cuts = np.sort(rng.choice(np.arange(1, seq), 2, replace=False))
    return (1 + (np.arange(seq)[None] >= cuts[:, None]).sum(0))[None].astype(np.int32)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--heads", type=int, default=32, help="mha: heads (kv heads equal)")
    parser.add_argument("--head_dim", type=int, default=128, help="mha: head dim")
    parser.add_argument("--mla_dims", default="16,128,64,128", help="mla: heads,nope,rope,v")
    parser.add_argument("--seq_lens", default="1024,2048,4096", help="compiled lengths")
    parser.add_argument("--check_seq", type=int, default=1024, help="length that is run")
    parser.add_argument("--block", type=int, default=512, help="flash block_q = block_k")
    parser.add_argument("--dtype", default="float32", help="core dtype of every row")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--no_time", action="store_true", help="compile and check, no timing")
    parser.add_argument("--pallas", action="store_true", help="pallas interpreted off GPU")
    args = parser.parse_args(argv)
    args.mla_dims = tuple(int(v) for v in args.mla_dims.split(","))
    seq_lens = [int(v) for v in args.seq_lens.split(",")]
    dtype = jnp.dtype(args.dtype)
    backend = attention.current_backend()
    rng = np.random.default_rng(0)

    rows, timing = [], report.timing_start()
    for kind in ("mha", "mla"):
        scale = (args.head_dim if kind == "mha" else sum(args.mla_dims[1:3])) ** -0.5
        reference = None
        for impl in impls(backend, args.pallas):
            fn = fwd_bwd(impl, scale, args.block, dtype)
            for seq in seq_lens:
                abstract = {k: jax.ShapeDtypeStruct(s, dtype)
                            for k, s in shapes(kind, args, seq).items()}
                seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)
                w = jax.ShapeDtypeStruct((1, seq, abstract["q"].shape[2],
                                          abstract["v"].shape[-1]), jnp.float32)
                compiled = fn.lower(abstract, seg, w).compile()
                row = {"impl": impl, "seq_len": seq, "attention": kind,
                       "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                       "max_abs_diff": None, "grad_max_abs_diff": None, "ms": None}
                if seq == args.check_seq:
                    if reference is None:  # every impl gets the same inputs
                        reference = ({k: jnp.asarray(rng.normal(size=a.shape), dtype)
                                      for k, a in abstract.items()},
                                     jnp.asarray(packed_segments(rng, seq)),
                                     jnp.asarray(rng.normal(size=w.shape), jnp.float32))
                    inputs, seg_v, w_v = reference
                    (_, out), grads = compiled(inputs, seg_v, w_v)
                    if impl == "xla":
                        want = (out, grads)
                    row["max_abs_diff"] = float(jnp.max(jnp.abs(out - want[0])))
                    row["grad_max_abs_diff"] = max(float(jnp.max(jnp.abs(g - r))) for g, r in
                                                   zip(jax.tree.leaves(grads),
                                                       jax.tree.leaves(want[1])))
                    if not args.no_time:
                        times = []
                        for _ in range(args.rounds):
                            start = time.perf_counter()
                            jax.block_until_ready(compiled(inputs, seg_v, w_v))
                            times.append(time.perf_counter() - start)
                        row["ms"] = 1000 * float(np.median(times))
                rows.append(row)
                print(f"{kind:4s} {impl:7s} S={seq:6d} temp {row['temp_bytes'] / 2**20:10.1f} MiB"
                      + (f"  |d out| {row['max_abs_diff']:.2e}  |d grad| "
                         f"{row['grad_max_abs_diff']:.2e}" if row["max_abs_diff"] is not None
                         else "")
                      + (f"  {row['ms']:.1f} ms" if row["ms"] is not None else ""))
    conditions = report.load_record(timing)
    result = {"rows": rows, "backend": backend, "dtype": dtype.name, "block": args.block,
              "dims": {"mha": [args.heads, args.head_dim], "mla": list(args.mla_dims)},
              "timed": not args.no_time, **conditions}
    print(f"attention_table ({backend}, {dtype.name}): {len(rows)} rows; "
          f"{report.describe_load(conditions)}")
    if not args.no_time:  # compiled sizes and errors do not depend on the load
        report.warn_if_contended(conditions, "attention_table")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
