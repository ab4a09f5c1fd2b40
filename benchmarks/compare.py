"""The side-by-side report: a baseline and a candidate config trained alternately, compared.

  python benchmarks/compare.py --baseline configs/h100_bf16.py --candidate configs/h100_fp8.py \
      --steps 200 --out benchmarks/results/compare_h100
  python benchmarks/compare.py --steps 60 --out benchmarks/results/compare     (CPU: the :smoke
      variants, configs/h100_bf16.py:smoke vs configs/h100_fp8.py:smoke)

A config is `configs/NAME.py[:ARG][|section.field=value|...]` (benchmarks/step_time.py's syntax),
e.g. "configs/h100_fp8.py:smoke|optim.name=adamw". Both configs train on the same batches (rows of
the Python standard library's source, byte tokens; `--data synthetic` for random tokens) from the
same seed. Each config trains in a process of its own (benchmarks/workers.py), with its own
devices, XLA flag profile (mesh.xla_profile) and memory: its peak memory is its own. After
untimed warmup steps (every program compiled, including 1-bit Adam's compressed step), the two
alternate rounds of `--round` steps until each has `--steps` timed steps, so machine drift hits
both. Figures are medians over rounds; then each config's current step is compiled for its
memory reading and one more step is traced for its communication share. On a GPU both
processes hold the device at once (memory is allocated on demand), so both must fit.

Prints the recipe's table (samples/s, ms/step, MFU and GPU utilisation, energy per sample and
cost per million tokens, memory, communication share; each with the candidate's change in %).
Writes into --out: compare.json ({"baseline": {...}, "candidate": {...}, "change_pct": {...},
"diverged": the candidate's final loss more than 5% above the baseline's, when its speed changes
print as "diverged"} with samples_per_sec, step_ms, mfu, mem_bytes, comm_fraction,
joules_per_sample, joules_per_token (NVML, GPU only: null on CPU) and cost_per_mtok (with
metrics.cost_per_gpu_hour set) as in metrics.jsonl; "load_before", "load_after", "cores",
"others_cpu_share", "contended": the machine's conditions around the run, benchmarks/report.py),
loss_vs_step.png, loss_vs_time.png, throughput.png, and profile/{baseline,candidate}/ (the
traces; TensorBoard or Perfetto). A contended run prints a warning after the table.
docs/observability.md says what each figure means and where it is weak.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
import workers  # noqa: E402  (benchmarks/workers.py)
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402  (no JAX import yet)
from step_time import _load  # noqa: E402  pylint: disable=wrong-import-position

FIGURES = ("samples_per_sec", "step_ms", "mfu", "mem_bytes", "comm_fraction",
           "joules_per_sample", "cost_per_mtok")
SPEED = ("samples_per_sec", "step_ms", "tokens_per_sec", "mfu", "joules_per_sample",
         "cost_per_mtok")  # no change % once diverged
DEFAULT_DATA_DIR = os.path.join(ROOT, "runs", "bench_data", "stdlib")


def host_batches(seq_len: int, batch: int, count: int, source: str = "stdlib",
                 data_dir: str = DEFAULT_DATA_DIR, vocab: int = 256, seed: int = 0,
                 packed: bool = True) -> list[dict]:
    """`count` host batches shaped like the data pipeline's. `stdlib`: shuffled rows of the
    standard library's source (a 4 MB sample, cached in `data_dir`); `synthetic`: random tokens
    below `vocab`. `packed=False` makes every row one causal sequence (no document boundaries)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    if source == "stdlib":
        from dsjax.data import SampleStream, build_stdlib_corpus  # pylint: disable=C0415
        train_dir, _ = build_stdlib_corpus(data_dir, max_bytes=4_000_000)
        stream = SampleStream(train_dir, seq_len, seed, prefetch=0)
        batches = [stream.take(batch) for _ in range(count)]
    elif source == "synthetic":
        rng = np.random.default_rng(seed)
        batches = []
        for _ in range(count):
            tokens = rng.integers(0, vocab, (batch, seq_len + 1)).astype(np.int32)
            batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    else:
        raise ValueError(f"--data: expected stdlib or synthetic, got {source!r}")
    for b in batches:
        if source == "synthetic" or not packed:
            b["segment_ids"] = np.ones((batch, seq_len), np.int32)
            b["positions"] = np.broadcast_to(np.arange(seq_len, dtype=np.int32),
                                             (batch, seq_len)).copy()
            b["weights"] = np.ones((batch, seq_len), np.float32)
    return batches


def warmup_steps(cfg) -> int:
    """Untimed steps after which every program `cfg` trains with has been compiled: the first
    step, and with 1-bit Adam the first compressed one (after optim.freeze_step steps)."""
    return 1 + (cfg.optim.freeze_step if cfg.optim.name == "onebit_adam" else 0)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--baseline", default="configs/h100_bf16.py:smoke",
                        help="configs/NAME.py[:ARG][|section.field=value...]")
    parser.add_argument("--candidate", default="configs/h100_fp8.py:smoke")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per config")
    parser.add_argument("--round", type=int, default=5, help="steps per alternating round")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first (default: until every program is compiled)")
    parser.add_argument("--data", choices=("stdlib", "synthetic"), default="stdlib")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default=None, help="directory for compare.json and the plots")
    parser.add_argument("--worker", choices=("baseline", "candidate"), default=None,
                        help=argparse.SUPPRESS)  # internal: one side, driven over stdin
    args = parser.parse_args(argv)
    if args.steps < 1 or args.round < 1:
        parser.error("--steps and --round must be >= 1")
    return args


class Side:
    """One config under test: its trainer, state, batches and what was measured."""

    def __init__(self, label, spec, cfg, trainer, batches):
        self.label, self.spec, self.cfg, self.trainer = label, spec, cfg, trainer
        self.batches = batches
        self.state = trainer.init()
        self.steps_done = 0
        self.losses: list[tuple[int, float, float | None]] = []  # (step, loss, timed wall s)
        self.rounds: list[float] = []  # seconds per step of each timed round
        self.utilisation: list[float | None] = []  # NVML after each round (None: absent)
        self.joules: float | None = 0.0  # NVML energy of the timed rounds (None: absent)
        self.warmup_s = 0.0  # compilation + warmup steps

    def run(self, n: int, timed: bool) -> float:
        import jax  # pylint: disable=import-outside-toplevel
        from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel

        devices = list(self.trainer.mesh.devices.flat)
        energy_before = mx.energy_joules(devices) if timed else None
        pending = []
        t0 = time.perf_counter()
        for _ in range(n):
            batch = self.batches[self.steps_done % len(self.batches)]
            self.state, m = self.trainer.step(self.state, batch)
            self.steps_done += 1
            pending.append((self.steps_done, m["loss"]))
        jax.block_until_ready(pending[-1][1])
        dt = time.perf_counter() - t0
        start = self.timed_seconds()
        for i, (step, loss) in enumerate(pending):
            wall = start + dt * (i + 1) / n if timed else None
            self.losses.append((step, float(loss), wall))
        if timed:
            self.rounds.append(dt / n)
            self.utilisation.append(mx.device_utilisation(devices[0]))
            energy_after = mx.energy_joules(devices)
            if energy_before is None or energy_after is None or self.joules is None:
                self.joules = None
            else:
                self.joules += energy_after - energy_before
        return dt

    def timed_seconds(self) -> float:
        walls = [w for _, _, w in self.losses if w is not None]
        return walls[-1] if walls else 0.0


def measure(side: Side, peak: float, out_dir: str | None) -> dict:
    """The five figures (and their context) of one side, after its timed rounds."""
    import jax  # pylint: disable=import-outside-toplevel
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel
    from dsjax import sharding  # pylint: disable=import-outside-toplevel
    from dsjax.metrics import trace  # pylint: disable=import-outside-toplevel

    cfg, trainer = side.cfg, side.trainer
    step_s = statistics.median(side.rounds)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    devices = trainer.mesh.devices.size
    batch = side.batches[side.steps_done % len(side.batches)]
    compiled = trainer.program_for(side.state, batch)  # compiled already: no new compilation
    memory = mx.memory_reading(trainer.mesh.devices.flat[0], compiled)
    logdir = os.path.join(out_dir or os.path.join(ROOT, "runs", "compare"), "profile",
                          side.label)
    (side.state, _), run_dir = trace.trace_step(trainer.step, side.state, batch,
                                                    logdir=logdir, hlo_text=compiled.as_text())
    side.steps_done += 1  # the traced step trained too; it is not in the loss curve
    comm = trace.comm_share(run_dir)
    util = [u for u in side.utilisation if u is not None]
    timed_steps = len(side.losses) - sum(w is None for _, _, w in side.losses)
    per_sample = (None if side.joules is None or not timed_steps
                  else side.joules / (timed_steps * cfg.data.global_batch))
    cost = cfg.metrics.cost_per_gpu_hour
    return {
        "config": side.spec, "pid": os.getpid(), "compute_dtype": cfg.train.compute_dtype,
        "optim": cfg.optim.name, "remat": cfg.remat.policy,
        "mesh": sharding.describe(trainer.mesh), "param_count": trainer.param_count,
        "samples_per_sec": cfg.data.global_batch / step_s, "step_ms": 1000 * step_s,
        "tokens_per_sec": tokens / step_s,
        "mfu": mx.flops_per_token(cfg.model, cfg.data.seq_len) * tokens / step_s /
        (peak * devices),
        "mem_bytes": memory["peak_bytes"], "mem_source": memory["source"],
        "comm_fraction": comm["comm_fraction"],
        "exposed_comm_fraction": comm["exposed_comm_fraction"],
        "rendezvous_wait_fraction": comm["rendezvous_wait_fraction"],
        "comm_kinds_us": comm["kinds"], "traced_device_time_us": comm["device_time_us"],
        "collective_bytes": mx.collective_bytes(compiled.as_text(), devices)
        if jax.devices()[0].platform == "cpu" else None,  # async GPU HLO would over-count
        "device_utilisation": statistics.median(util) if util else None,
        "joules_per_sample": per_sample,
        "joules_per_token": None if per_sample is None else per_sample / cfg.data.seq_len,
        "cost_per_mtok": mx.cost_per_million_tokens(cost, devices, tokens / step_s)
        if cost > 0 else None,
        "profile": os.path.relpath(run_dir, out_dir) if out_dir else run_dir,
        "warmup_s": side.warmup_s, "rounds_step_ms": [1000 * s for s in side.rounds],
        "final_loss": side.losses[-1][1],
        "history": [{"step": s, "loss": l, "wall_s": w} for s, l, w in side.losses],
    }


def change_pct(base, cand) -> float | None:
    if base is None or cand is None or not base or not math.isfinite(base):
        return None
    return 100.0 * (cand - base) / base


def table(result: dict) -> str:
    b, c = result["baseline"], result["candidate"]

    def row(name, key, fmt):
        vb, vc, d = b.get(key), c.get(key), change_pct(b.get(key), c.get(key))
        cell = lambda v: f"{'n/a':>14}" if v is None else f"{fmt(v):>14}"
        change = '' if d is None else f'{d:+9.1f}%'
        if result.get("diverged") and key in SPEED:
            change = "diverged"
        return f"{name:<26}{cell(vb)}{cell(vc)}{change:>11}"

    gib = lambda v: f"{v / 2**20:,.1f} MiB"
    lines = [f"{'':<26}{'baseline':>14}{'candidate':>14}{'change':>11}",
             row("samples/s", "samples_per_sec", lambda v: f"{v:,.1f}"),
             row("ms/step", "step_ms", lambda v: f"{v:,.1f}"),
             row("tokens/s", "tokens_per_sec", lambda v: f"{v:,.0f}"),
             row("MFU", "mfu", lambda v: f"{100 * v:.2f}%"),
             row("GPU utilisation (NVML)", "device_utilisation", lambda v: f"{100 * v:.0f}%"),
             row("energy / sample (NVML)", "joules_per_sample", lambda v: f"{v:,.2f} J"),
             row("cost / M tokens", "cost_per_mtok", lambda v: f"{v:,.3f}"),
             row("memory / device", "mem_bytes", gib),
             row("communication share", "comm_fraction", lambda v: f"{100 * v:.1f}%"),
             row("  exposed (not overlapped)", "exposed_comm_fraction",
                 lambda v: f"{100 * v:.1f}%"),
             row("final loss", "final_loss", lambda v: f"{v:.3f}")]
    lines += [f"baseline:  {b['config']} ({b['compute_dtype']}, {b['optim']}, mesh {b['mesh']})",
              f"candidate: {c['config']} ({c['compute_dtype']}, {c['optim']}, mesh {c['mesh']})",
              f"MFU against {result['peak_flops_per_device']:.3g} FLOP/s per device "
              f"({result['peak_source']}); memory: {b['mem_source']}; communication share from "
              f"one traced step; medians of {len(b['rounds_step_ms'])} alternating rounds of "
              f"{result['round_steps']} steps; {report.describe_load(result)}"]
    if result.get("diverged"):
        lines.append(f"DIVERGED: the candidate's final loss {c['final_loss']:.4g} is more than "
                     f"{100 * report.DIVERGED_LOSS_GAP:.0f}% above the baseline's "
                     f"{b['final_loss']:.4g}; its speed is not a result")
    return "\n".join(lines)


def plot(result: dict, out_dir: str) -> list[str]:
    """loss vs step, loss vs timed wall time, samples/s per round: one PNG each."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    sides = [("baseline", "tab:blue"), ("candidate", "tab:orange")]
    paths = []

    def save(fig, ax, name, xlabel, ylabel, title):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, color in sides:
        h = result[key]["history"]
        ax.plot([r["step"] for r in h], [r["loss"] for r in h], color=color,
                label=f"{key}: {result[key]['config']}")
    save(fig, ax, "loss_vs_step.png", "step", "training loss (nats/token)", "Loss vs step")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, color in sides:
        h = [r for r in result[key]["history"] if r["wall_s"] is not None]
        ax.plot([r["wall_s"] for r in h], [r["loss"] for r in h], color=color, marker=".",
                label=f"{key}: {result[key]['config']}")
    save(fig, ax, "loss_vs_time.png", "timed training seconds (after warmup)",
         "training loss (nats/token)", "Loss vs wall time")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, color in sides:
        side = result[key]
        batch = side["samples_per_sec"] * side["step_ms"] / 1000  # global batch
        rates = [batch / (ms / 1000) for ms in side["rounds_step_ms"]]
        ax.plot(range(1, len(rates) + 1), rates, color=color, marker="o",
                label=f"{key}: median {side['samples_per_sec']:,.1f} samples/s")
    ax.xaxis.get_major_locator().set_params(integer=True)
    save(fig, ax, "throughput.png", "round", "samples/s", "Throughput per alternating round")
    return paths


LABELS = ("baseline", "candidate")


class _Served:
    """What a `--worker` process serves (benchmarks/workers.py): one side, with only its own
    devices, XLA flag profile and memory."""

    def __init__(self, args: argparse.Namespace):
        spec = args.baseline if args.worker == "baseline" else args.candidate
        cfg = _load(spec)
        # The schedule spans the whole run (warmup + timed + the traced step).
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, steps=args.warmup + args.steps + 1))
        from dsjax.runtime import xla_flags  # pylint: disable=import-outside-toplevel
        xla_flags.apply(cfg.mesh.xla_profile)  # before JAX starts, as launch.py does
        ensure_cpu_devices(cfg.mesh.size)
        from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

        trainer = build_trainer(cfg)
        count = min(args.warmup + args.steps, 64)  # cycled; distinct enough for a loss curve
        host = host_batches(cfg.data.seq_len, cfg.data.global_batch, count, args.data,
                            args.data_dir, min(cfg.model.vocab_size, 256), cfg.train.seed)
        self.side = Side(args.worker, spec, cfg, trainer, [trainer.device_batch(b) for b in host])
        self.side.warmup_s = self.side.run(args.warmup, timed=False)

    def hello(self) -> dict:
        return {"warmup_s": self.side.warmup_s}

    def round(self, n: int) -> dict:
        return {"seconds": self.side.run(n, timed=True)}

    def finish(self, out: str | None) -> dict:
        import jax  # pylint: disable=import-outside-toplevel
        from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel

        peak, source = mx.peak_flops_per_device(self.side.cfg.metrics.peak_flops_per_device)
        return {"side": measure(self.side, peak, out), "peak": peak, "peak_source": source,
                "device": jax.devices()[0].device_kind}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        return workers.serve(_Served(args))
    cfgs = [_load(args.baseline), _load(args.candidate)]
    warmup = args.warmup if args.warmup is not None else max(map(warmup_steps, cfgs))
    passed = [*(argv if argv is not None else sys.argv[1:]), "--warmup", str(warmup)]

    timing = report.timing_start()
    sides, done, finished = {}, dict.fromkeys(LABELS, 0), {}
    try:
        for label in LABELS:  # each builds, compiles and runs its warmup steps
            sides[label] = workers.Worker(__file__, [*passed, "--worker", label], label)
        while any(done[label] < args.steps for label in LABELS):
            for label in LABELS:
                n = min(args.round, args.steps - done[label])
                if n > 0:
                    sides[label].call("round", n=n)
                    done[label] += n
        for label in LABELS:
            finished[label] = sides[label].call("finish", out=args.out)
    finally:
        for worker in sides.values():
            worker.close()
    conditions = report.load_record(timing)  # after the workers exit: their CPU time counts

    base = finished["baseline"]
    result = {label: finished[label]["side"] for label in LABELS}
    result["change_pct"] = {k: change_pct(result["baseline"][k], result["candidate"][k])
                            for k in FIGURES}
    result["diverged"] = report.diverged(result["baseline"]["final_loss"],
                                         result["candidate"]["final_loss"])
    result.update({"steps": args.steps, "round_steps": args.round, "warmup_steps": warmup,
                   "data": args.data, "device": base["device"],
                   "peak_flops_per_device": base["peak"], "peak_source": base["peak_source"],
                   "method": "each config in its own process, alternating rounds",
                   **conditions})
    print(table(result))
    report.warn_if_contended(conditions, "compare")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        try:
            result["plots"] = [os.path.basename(p) for p in plot(result, args.out)]
        except ImportError:  # a GPU image without matplotlib still gets its numbers
            print("compare: matplotlib is not installed; no plots")
        with open(os.path.join(args.out, "compare.json"), "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
