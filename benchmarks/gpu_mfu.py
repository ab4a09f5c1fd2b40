"""The pieces of the GPU MFU benchmark: `bash benchmarks/gpu_mfu.sh` runs each in its own process,
as `gpu_mfu.py PIECE --record OUT/gpu_mfu.json --row NAME [--preset smoke]`; each writes a stub
row before it compiles and its result row when it finishes (benchmarks/gpu_record.py).

`model` (`--layers L --dtype bfloat16|fp8`): DeepSeek-7B width (configs/deepseek_7b.py, one
device), unrolled layers (model.scan_layers=False, as MaxText's GPU recipe), no recomputation,
S 4096. The batch is the largest of 4, 2, 1 rows whose compiled step the project's own memory
prediction (memory_analysis, `Programs.predict`) fits in this device's memory; the compiled step
is the one that then runs. Warmup steps, then the median of the timed ones, the loss at the
first and last step, compile seconds, the process's peak device memory and joules per token.
`attention`: xla against cudnn (CPU: flash), forward + backward ms at B x S x heads x head_dim,
causal, with one document a row and packed (two a row), and each one's largest difference from
xla. `ceilings`: measured bf16 and fp8 GEMM FLOP/s at N^3 and the bandwidth of a large copy.
`fp8_census`: benchmarks/fp8_hlo.py's count of fp8 GEMMs in a compiled train step.
`summary`: the headline figures from the rows (benchmarks/gpu_summary.py); prints the table.
`--preset smoke` makes every piece tiny, for the CPU dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_record  # noqa: E402  (benchmarks/gpu_record.py)
from step_time import _load  # noqa: E402  pylint: disable=wrong-import-position

BATCHES = (4, 2, 1)  # rows per step to try, largest first: MaxText's Llama2-7B recipe runs 4
SIZES = {  # preset -> shapes of each piece
    "gpu": dict(gemm_n=8192, copy_mib=4096, attn=(2, 4096, 32, 128), seq_len=4096,
                warmup=2, timed=5, model={},
                fp8_census=["--config", "configs/h100_fp8.py", "--preset", "1b"]),
    "smoke": dict(gemm_n=256, copy_mib=16, attn=(1, 128, 4, 32), seq_len=128, warmup=1,
                  timed=2, model=dict(hidden_size=128, num_heads=4, num_kv_heads=4, mlp_dim=256,
                                      vocab_size=512),
                  fp8_census=["--config", "configs/h100_fp8.py:smoke"]),
}


def _median_ms(fn, *args, reps: int = 5) -> float:
    import jax  # pylint: disable=import-outside-toplevel
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def ceilings(size: dict) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    n = size["gemm_n"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    bf16 = jax.jit(lambda a, b: a @ b)
    f8 = jnp.float8_e4m3fn
    fp8 = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16))
    a8, b8 = a.astype(f8), b.astype(f8)
    flops = 2 * n ** 3
    x = jnp.zeros((size["copy_mib"] * 2**20 // 4,), jnp.float32)
    copy_ms = _median_ms(jax.jit(lambda x: x + 1), x)
    bf16_flops = flops / (_median_ms(bf16, a, b) / 1000)
    fp8_flops = flops / (_median_ms(fp8, a8, b8) / 1000)
    return {"gemm_n": n, "bf16_gemm_flops": bf16_flops, "fp8_gemm_flops": fp8_flops,
            "fp8_over_bf16_gemm": fp8_flops / bf16_flops,
            "copy_bytes_per_sec": 2 * x.nbytes / (copy_ms / 1000)}  # read + write


def attention(size: dict) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from dsjax.model.attention import attention_core, current_backend  # pylint: disable=C0415
    B, S, H, K = size["attn"]
    gpu = current_backend() == "cuda"
    impls = ["xla", "cudnn"] if gpu else ["xla", "flash"]
    dtype = jnp.bfloat16 if gpu else jnp.float32
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dy = (jax.random.normal(kk, (B, S, H, K), dtype) for kk in keys)
    rows, ref = [], {}
    for packed in (False, True):
        seg = jnp.ones((B, S), jnp.int32) if not packed else \
            jnp.where(jnp.arange(S) < S // 2, 1, 2)[None].repeat(B, 0).astype(jnp.int32)
        for impl in impls:
            def loss(q, k, v, impl=impl):
                out = attention_core(q, k, v, seg, scale=K ** -0.5, impl=impl, block_q=512,
                                     block_k=512, dtype=dtype)
                return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
            try:
                ms = _median_ms(step, q, k, v)
                (_, out), grads = step(q, k, v)
            except Exception as e:  # pylint: disable=broad-except  (an impl this GPU lacks)
                rows.append({"impl": impl, "packed": packed, "error": str(e)[:300]})
                continue
            ref.setdefault(packed, (out, grads))
            r_out, r_grads = ref[packed]
            diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                       for a, b in zip((out, *grads), (r_out, *r_grads)))
            rows.append({"impl": impl, "packed": packed, "ms": ms, "max_abs_diff_vs_xla": diff})
    return {"shape": [B, S, H, K], "dtype": jnp.dtype(dtype).name, "rows": rows,
            "errors": sum("error" in r for r in rows)}


def fit_batch(trainer: Any, device: Any) -> dict:
    """The largest of BATCHES whose compiled step the memory prediction fits on `device`; each
    tried batch with its predicted bytes (the chosen step is compiled and cached for the run)."""
    from dsjax import batching  # pylint: disable=import-outside-toplevel
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    capacity, source = mx.fit_capacity(device, 0.0, 1)
    tried = []
    for rows in BATCHES:
        need = trainer.programs.predict(batching.Shape(rows, 1, 1), 0)
        tried.append({"batch": rows, "predicted_bytes": need})
        if need <= capacity:
            return {"batch": rows, "capacity_bytes": capacity, "capacity_source": source,
                    "tried": tried}
    raise RuntimeError(f"even batch 1 needs {tried[-1]['predicted_bytes']} bytes, the device "
                       f"has {capacity} ({source})")


def model(size: dict, layers: int, dtype: str, config: str) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    from dsjax import sharding  # pylint: disable=import-outside-toplevel
    from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel
    cfg = _load(config)
    steps = size["warmup"] + size["timed"]
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, num_layers=layers, scan_layers=False,
                                       **size["model"]),
        mesh=dataclasses.replace(cfg.mesh, data=1, tensor=1, pipeline=1, fsdp=False),
        data=dataclasses.replace(cfg.data, seq_len=size["seq_len"], global_batch=BATCHES[0]),
        train=dataclasses.replace(cfg.train, compute_dtype=dtype, steps=steps),
        remat=dataclasses.replace(cfg.remat, policy="none", layers="all"),
        optim=dataclasses.replace(cfg.optim, name="adamw"))
    device = jax.devices()[0]
    trainer = build_trainer(cfg, sharding.make_mesh(cfg, [device]))
    t0 = time.perf_counter()
    fit = fit_batch(trainer, device)
    compile_s = time.perf_counter() - t0
    B, S = fit["batch"], cfg.data.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, S + 1))
    batch = trainer.device_batch({
        "inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
        "segment_ids": np.ones((B, S), np.int32),
        "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy(),
        "weights": np.ones((B, S), np.float32)})
    state, losses, times = trainer.init(), [], []
    energy_start = None
    for i in range(steps):
        if i == size["warmup"]:
            energy_start = mx.energy_joules([device])  # NVML; None off GPU
        t = time.perf_counter()
        state, m = trainer.step(state, batch)
        losses.append(float(m["loss"]))  # waits: each step is timed whole
        times.append(time.perf_counter() - t)
    energy_end = mx.energy_joules([device])
    stats = device.memory_stats() or {}
    step_s = statistics.median(times[size["warmup"]:])
    flops = mx.flops_per_token(cfg.model, S) * S * B
    peak, peak_source = mx.peak_flops_per_device()
    joules = (None if energy_start is None or energy_end is None
              else (energy_end - energy_start) / (size["timed"] * S * B))
    return {"piece": "model", "layers": layers, "dtype": dtype, "batch": B, "seq_len": S,
            "batch_fit": fit, "scan_layers": False, "remat": "none",
            "attention_impl": trainer.model.attention_impl(S), "step_ms": 1000 * step_s,
            "flops_per_step": flops, "compile_s": compile_s, "peak_source": peak_source,
            # fp8's FLOPs at the bf16 peak: a bf16-equivalent MFU (fp8's own peak is 2x)
            ("mfu" if dtype != "fp8" else "mfu_bf16_equivalent"): flops / step_s / peak,
            "first_loss": losses[0], "last_loss": losses[-1], "joules_per_token": joules,
            "peak_bytes": stats.get("peak_bytes_in_use"), "model": dataclasses.asdict(cfg.model)}


def fp8_census(size: dict) -> dict:
    import fp8_hlo  # pylint: disable=import-outside-toplevel  (sets CPU devices before JAX)
    return fp8_hlo.main(size["fp8_census"])


def summary(record_path: str) -> dict:
    import gpu_summary  # pylint: disable=import-outside-toplevel  (imports dsjax, then JAX)
    result = gpu_summary.summarize(gpu_record.read(record_path))
    print(gpu_summary.table(result))
    gpu_record.update(record_path, **result)  # top level: the headline figures
    return {"fields": sorted(result)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("piece", choices=("model", "attention", "ceilings", "fp8_census",
                                          "summary"))
    parser.add_argument("--record", required=True, help="gpu_mfu.json: every row goes in it")
    parser.add_argument("--row", help="the row's name in the record (default: the piece)")
    parser.add_argument("--preset", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "fp8", "float32"), default="bfloat16")
    parser.add_argument("--config", default="configs/deepseek_7b.py")
    args = parser.parse_args(argv)
    name, size = args.row or args.piece, SIZES[args.preset]
    gpu_record.stub(args.record, name, vars(args))
    t0 = time.perf_counter()
    if args.piece == "model":
        result = model(size, args.layers, args.dtype, args.config)
    elif args.piece == "attention":
        result = attention(size)
    elif args.piece == "ceilings":
        result = ceilings(size)
    elif args.piece == "fp8_census":
        result = fp8_census(size)
    else:
        result = summary(args.record)
    import jax  # pylint: disable=import-outside-toplevel  (started by the piece)
    result = {**result, "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
    gpu_record.put_row(args.record, name, {"piece": args.piece, **result, "status": "finished",
                                           "seconds": time.perf_counter() - t0})
    brief = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
    print(f"{name}: {json.dumps(brief, default=str)[:600]}")
    return result


if __name__ == "__main__":
    main()
