"""The pieces of the GPU MFU benchmark: `bash benchmarks/gpu_mfu.sh` runs each in its own
process, as `gpu_mfu.py PIECE [--preset smoke] --out FILE` with PIECE one of ceilings,
attention, model (`--layers L --dtype bfloat16|fp8 --remat POLICY`) and combine (`FOLDER`).

`ceilings`: measured bf16 and fp8 GEMM FLOP/s at N^3 and the memory bandwidth of a large copy.
`attention`: every attention impl the backend runs, forward + backward ms at B x S x heads x
head_dim, causal and packed (two documents a row), and each one's largest difference from xla.
`model`: DeepSeek-7B width (configs/deepseek_7b.py, one device) with `--layers` layers at S 4096:
warmup steps, then the median of the timed ones, the loss at the first and last step, compile
seconds, the process's peak device memory (the process runs this one configuration), and the
joules per token of the timed steps (NVML's energy counter; null off GPU).
`combine`: the rows of a folder -> per-layer ms and fixed ms from the two depths, the
extrapolated full-depth (30-layer) MFU against the datasheet peak and the measured bf16 ceiling,
fp8's speed-up, loss gap and energy per token against bf16 (at the deeper measured depth);
writes {"device", "jax", "rows", "mfu_bf16_full_depth", "mfu_fp8_full_depth", "fp8_speedup",
"fp8_loss_gap", "fp8_energy_ratio", ...}. `--preset smoke` makes every
piece tiny, for the CPU dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
from step_time import _load  # noqa: E402  pylint: disable=wrong-import-position

FULL_DEPTH = 30  # DeepSeek-LLM-7B's layers
SIZES = {  # preset -> shapes of each piece
    "gpu": dict(gemm_n=8192, copy_mib=4096, attn=(2, 4096, 32, 128), seq_len=4096,
                warmup=3, timed=8, model={}),
    "smoke": dict(gemm_n=256, copy_mib=16, attn=(1, 128, 4, 32), seq_len=128, warmup=1,
                  timed=2, model=dict(hidden_size=128, num_heads=4, num_kv_heads=4, mlp_dim=256,
                                      vocab_size=512)),
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
    return {"gemm_n": n, "bf16_gemm_flops": flops / (_median_ms(bf16, a, b) / 1000),
            "fp8_gemm_flops": flops / (_median_ms(fp8, a8, b8) / 1000),
            "copy_bytes_per_sec": 2 * x.nbytes / (copy_ms / 1000)}  # read + write


def attention(size: dict) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from dsjax.model.attention import attention_core, current_backend  # pylint: disable=C0415
    B, S, H, K = size["attn"]
    gpu = current_backend() in ("cuda", "rocm")
    impls = ["xla", "flash"] + (["cudnn", "pallas"] if gpu else [])
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
    return {"shape": [B, S, H, K], "dtype": jnp.dtype(dtype).name, "rows": rows}


def model(size: dict, layers: int, dtype: str, remat: str, config: str) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    from dsjax import sharding  # pylint: disable=import-outside-toplevel
    from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel
    cfg = _load(config)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, num_layers=layers, **size["model"]),
        mesh=dataclasses.replace(cfg.mesh, data=1, tensor=1, pipeline=1, fsdp=False),
        data=dataclasses.replace(cfg.data, seq_len=size["seq_len"], global_batch=1),
        train=dataclasses.replace(cfg.train, compute_dtype=dtype,
                                  steps=size["warmup"] + size["timed"]),
        remat=dataclasses.replace(cfg.remat, policy=remat, layers="all"),
        optim=dataclasses.replace(cfg.optim, name="adamw"))
    trainer = build_trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
    S = cfg.data.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (1, S + 1))
    batch = trainer.device_batch({
        "inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
        "segment_ids": np.ones((1, S), np.int32), "positions": np.arange(S, dtype=np.int32)[None],
        "weights": np.ones((1, S), np.float32)})
    state, losses, times = trainer.init(), [], []
    device = jax.devices()[0]
    t0 = time.perf_counter()
    for i in range(size["warmup"] + size["timed"]):
        if i == size["warmup"]:
            energy_start = mx.energy_joules([device])  # NVML; None off GPU
        t = time.perf_counter()
        state, m = trainer.step(state, batch)
        losses.append(float(m["loss"]))  # waits: each step is timed whole
        times.append(time.perf_counter() - t)
        if i == 0:
            compile_s = time.perf_counter() - t0
    energy_end = mx.energy_joules([device])
    stats = device.memory_stats() or {}
    step_s = statistics.median(times[size["warmup"]:])
    joules = (None if energy_start is None or energy_end is None
              else (energy_end - energy_start) / (size["timed"] * S))
    return {"layers": layers, "dtype": dtype, "remat": remat, "seq_len": S,
            "attention_impl": trainer.model.attention_impl(S), "step_ms": 1000 * step_s,
            "flops_per_step": mx.flops_per_token(cfg.model, S) * S, "compile_s": compile_s,
            "first_loss": losses[0], "last_loss": losses[-1], "joules_per_token": joules,
            "peak_bytes": stats.get("peak_bytes_in_use"), "model": dataclasses.asdict(cfg.model)}


def combine(folder: str) -> dict:
    """Full-depth figures from the rows in `folder` (see the module docstring)."""
    import jax  # pylint: disable=import-outside-toplevel
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    from dsjax.config import ModelConfig  # pylint: disable=import-outside-toplevel
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "model_*.json"))):
        with open(path, encoding="utf-8") as f:
            rows.append(json.load(f))
    ceil = {}
    if os.path.exists(os.path.join(folder, "ceilings.json")):
        with open(os.path.join(folder, "ceilings.json"), encoding="utf-8") as f:
            ceil = json.load(f)
    peak, peak_source = mx.peak_flops_per_device()
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows,
           "ceilings": ceil, "peak_flops_per_device": peak, "peak_source": peak_source}
    full = {}
    for dtype in ("bfloat16", "fp8"):
        depth = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: r["layers"])
        if len(depth) < 2:
            continue
        lo, hi = depth[0], depth[-1]
        per_layer = (hi["step_ms"] - lo["step_ms"]) / (hi["layers"] - lo["layers"])
        fixed = lo["step_ms"] - lo["layers"] * per_layer
        step_ms = fixed + FULL_DEPTH * per_layer
        cfg = ModelConfig(**{**hi["model"], "num_layers": FULL_DEPTH})
        flops = mx.flops_per_token(cfg, hi["seq_len"]) * hi["seq_len"]
        full[dtype] = {"per_layer_ms": per_layer, "fixed_ms": fixed, "step_ms": step_ms,
                       "mfu": flops / (step_ms / 1000) / peak,
                       "mfu_vs_measured_bf16": (flops / (step_ms / 1000) / ceil["bf16_gemm_flops"]
                                                if ceil else None),
                       "last_loss": hi["last_loss"],
                       "joules_per_token_at_depth": hi.get("joules_per_token")}
    out["full_depth"] = full
    out["mfu_bf16_full_depth"] = full.get("bfloat16", {}).get("mfu")
    out["mfu_fp8_full_depth"] = full.get("fp8", {}).get("mfu")
    both = "bfloat16" in full and "fp8" in full
    out["fp8_speedup"] = full["bfloat16"]["step_ms"] / full["fp8"]["step_ms"] if both else None
    out["fp8_loss_gap"] = ((full["fp8"]["last_loss"] - full["bfloat16"]["last_loss"])
                           / full["bfloat16"]["last_loss"] if both else None)
    energy = [full[d]["joules_per_token_at_depth"] for d in ("bfloat16", "fp8")] if both else []
    out["fp8_energy_ratio"] = energy[1] / energy[0] if energy and None not in energy else None
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("piece", choices=("ceilings", "attention", "model", "combine"))
    parser.add_argument("folder", nargs="?", help="combine: the folder of the rows")
    parser.add_argument("--preset", choices=sorted(SIZES), default="gpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "fp8", "float32"), default="bfloat16")
    parser.add_argument("--remat", default="none", help="remat.policy of the model rows")
    parser.add_argument("--config", default="configs/deepseek_7b.py")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    size = SIZES[args.preset]
    if args.piece == "ceilings":
        result = ceilings(size)
    elif args.piece == "attention":
        result = attention(size)
    elif args.piece == "model":
        result = model(size, args.layers, args.dtype, args.remat, args.config)
    else:
        if not args.folder:
            parser.error("combine needs the folder of the rows")
        result = combine(args.folder)
        for dtype, f in result["full_depth"].items():
            print(f"{dtype:<9} per layer {f['per_layer_ms']:8.2f} ms, fixed {f['fixed_ms']:8.2f} "
                  f"ms, {FULL_DEPTH} layers {f['step_ms']:9.1f} ms, MFU {100 * f['mfu']:.1f}%")
        print(f"fp8 speed-up {result['fp8_speedup']}, fp8 loss gap {result['fp8_loss_gap']}")
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "model")})[:2000])
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
