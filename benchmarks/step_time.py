"""Side-by-side step time, tokens/s, MFU and memory of several configs, measured alternately.

  python benchmarks/step_time.py --config configs/h100_bf16.py --config configs/h100_fp8.py \
      --preset 1b --out benchmarks/results/step_time_1b.json

Builds every config's trainer, each in a process of its own (benchmarks/workers.py: its own
devices, XLA flag profile and memory), then alternates rounds of `--steps` timed steps between
them (so machine drift hits all of them), on synthetic packed batches. `--preset 1b` swaps in a ~1.2B
DeepSeek-architecture model on one device (the GPU suite's size); `--preset smoke` a tiny one for
CPU. Reports medians per config and ratios to the first config; writes {"rows": [...],
"ratios": {...}, "load_before", "load_after", "cores", "others_cpu_share", "contended"}
(benchmarks/report.py: the load average at the start and after the timed rounds, and the share
of the cores other processes used; a warning when the timing was contended).
Memory: the device's peak bytes in use where it reports them (that config's process alone; on
a GPU the processes share the device, allocating on demand, so all must fit at once), else the
compiled step's memory_analysis (labelled).
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
import workers  # noqa: E402  (benchmarks/workers.py)
from dsjax.config import load  # noqa: E402
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402

PRESETS = {
    # ~1.23B parameters: 16 x 2048 wide, 16 heads of 128, SwiGLU 5504, DeepSeek's vocab.
    "1b": dict(model=dict(num_layers=16, hidden_size=2048, num_heads=16, num_kv_heads=16,
                          mlp_dim=5504, vocab_size=102400),
               seq_len=2048, global_batch=2, mesh=(1, 1, 1)),  # no-remat control fits 141 GB
    "smoke": dict(model=dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4,
                             mlp_dim=256, vocab_size=512),
                  seq_len=64, global_batch=8, mesh=(1, 1, 1)),
}


def _apply_preset(cfg, preset):
    if not preset:
        return cfg
    p = PRESETS[preset]
    data, tensor, pipeline = p["mesh"]
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, **p["model"]),
        mesh=dataclasses.replace(cfg.mesh, data=data, tensor=tensor, pipeline=pipeline,
                                 fsdp=False),
        data=dataclasses.replace(cfg.data, seq_len=p["seq_len"], global_batch=p["global_batch"]))


def _load(spec: str):
    """`configs/NAME.py[:ARG][|section.field=value|...]`: a config plus overrides."""
    path, *pairs = spec.split("|")
    return load(path, report.parse_overrides(pairs))


class _Served:
    """What a `--worker` process serves (benchmarks/workers.py): one config's trainer, with only
    its own devices, XLA flag profile and memory."""

    def __init__(self, spec: str, preset: str | None):
        cfg = _apply_preset(_load(spec), preset)
        from dsjax.runtime import xla_flags  # pylint: disable=import-outside-toplevel
        xla_flags.apply(cfg.mesh.xla_profile)  # before JAX starts, as launch.py does
        ensure_cpu_devices(cfg.mesh.size)
        import jax  # pylint: disable=import-outside-toplevel
        import numpy as np  # pylint: disable=import-outside-toplevel
        from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

        self.spec, self.cfg = spec, cfg
        self.trainer = trainer = build_trainer(cfg)
        rng = np.random.default_rng(0)
        B, S = cfg.data.global_batch, cfg.data.seq_len
        tokens = rng.integers(0, min(cfg.model.vocab_size, 50000), (B, S + 1)).astype(np.int32)
        host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "segment_ids": np.ones((B, S), np.int32),
                "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy(),
                "weights": np.ones((B, S), np.float32)}
        self.batch = trainer.device_batch(host)
        self.state = trainer.init()
        t0 = time.perf_counter()
        self.state, m = trainer.step(self.state, self.batch)
        jax.block_until_ready(m)
        self.compile_s = time.perf_counter() - t0
        self.loss = float(m["loss"])

    def hello(self) -> dict:
        return {"compile_s": self.compile_s}

    def round(self, steps: int) -> dict:
        import jax  # pylint: disable=import-outside-toplevel

        t0 = time.perf_counter()
        for _ in range(steps):
            self.state, m = self.trainer.step(self.state, self.batch)
        jax.block_until_ready(m)
        seconds = (time.perf_counter() - t0) / steps
        self.loss = float(m["loss"])
        return {"seconds": seconds}

    def finish(self, times: list[float]) -> dict:
        """The row of this config, from the per-step seconds of its rounds."""
        import jax  # pylint: disable=import-outside-toplevel
        from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
        from dsjax import sharding  # pylint: disable=import-outside-toplevel

        cfg, trainer = self.cfg, self.trainer
        peak, peak_source = mx.peak_flops_per_device(cfg.metrics.peak_flops_per_device)
        devices = list(trainer.mesh.devices.flat)
        step_s = statistics.median(times)
        tokens = cfg.data.global_batch * cfg.data.seq_len
        flops = mx.flops_per_token(cfg.model, cfg.data.seq_len) * tokens
        stats = devices[0].memory_stats() or {}
        mem, mem_source = stats.get("peak_bytes_in_use"), "device memory_stats peak (this config)"
        if mem is None:
            with sharding.activate(trainer.mesh, trainer.rules):
                ma = trainer.jitted(0).lower(self.state, self.batch).compile().memory_analysis()
            mem = ma.temp_size_in_bytes + ma.argument_size_in_bytes
            mem_source = "compiled memory_analysis (temp + arguments, per device)"
        return {"config": self.spec, "pid": os.getpid(), "compute_dtype": cfg.train.compute_dtype,
                "remat": cfg.remat.policy, "step_ms": 1000 * step_s,
                "tokens_per_sec": tokens / step_s,
                "samples_per_sec": cfg.data.global_batch / step_s,
                "mfu": flops / step_s / (peak * len(devices)),
                "mem_bytes": mem, "mem_source": mem_source,
                "compile_s": self.compile_s, "final_loss": self.loss,
                "peak_flops_per_device": peak, "peak_source": peak_source,
                "device": jax.devices()[0].device_kind}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", required=True,
                        help="configs/NAME.py[:ARG][|section.field=value...]; repeat to compare")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", type=int, default=None,
                        help=argparse.SUPPRESS)  # internal: serve the N-th --config
    args = parser.parse_args(argv)
    if args.worker is not None:
        return workers.serve(_Served(args.config[args.worker], args.preset))
    for spec in args.config:
        _apply_preset(_load(spec), args.preset)  # a bad config fails here, before any worker
    passed = list(argv if argv is not None else sys.argv[1:])

    timing = report.timing_start()
    runs, times = [], {}
    try:
        for i, spec in enumerate(args.config):  # each builds and compiles its step
            runs.append(workers.Worker(__file__, [*passed, "--worker", str(i)], spec))
            times[i] = []
        for _ in range(args.rounds):
            for i, run in enumerate(runs):
                times[i].append(run.call("round", steps=args.steps)["seconds"])
        rows = [run.call("finish", times=times[i]) for i, run in enumerate(runs)]
    finally:
        for run in runs:
            run.close()
    conditions = report.load_record(timing)  # after the workers exit: their CPU time counts

    base = rows[0]
    ratios = {r["config"]: {"step_ms": r["step_ms"] / base["step_ms"],
                            "tokens_per_sec": r["tokens_per_sec"] / base["tokens_per_sec"]}
              for r in rows}
    peak, peak_source = base["peak_flops_per_device"], base["peak_source"]
    result = {"preset": args.preset, "peak_flops_per_device": peak, "peak_source": peak_source,
              "device": base["device"], "rows": rows, "ratios": ratios,
              "method": "each config in its own process, alternating rounds", **conditions}
    print(f"{'config':<32} {'dtype':<9} {'ms/step':>9} {'tok/s':>10} {'MFU':>6} "
          f"{'mem GiB':>8} {'x base':>7}")
    for r in rows:
        mem = f"{r['mem_bytes'] / 2**30:8.2f}" if r["mem_bytes"] else f"{'n/a':>8}"
        print(f"{r['config']:<32} {r['compute_dtype']:<9} {r['step_ms']:>9.1f} "
              f"{r['tokens_per_sec']:>10,.0f} {100 * r['mfu']:>5.1f}% {mem} "
              f"{ratios[r['config']]['tokens_per_sec']:>7.3f}")
    print(f"MFU against {peak:.3g} FLOP/s per device ({peak_source}); "
          f"{report.describe_load(conditions)}")
    report.warn_if_contended(conditions, "step_time")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
