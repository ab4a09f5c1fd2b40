"""dsjax against Hugging Face `transformers` + PyTorch, and with `--maxtext` against MaxText:
one tiny DeepSeek-architecture model trained on CPU by each for the same steps, batch and
sequence length, in tokens/s.

  python benchmarks/peers.py --config configs/cpu_tiny.py --steps 30 --maxtext \
      --out benchmarks/results/peers_cpu.json
  python benchmarks/peers.py --config configs/cpu_tiny.py --steps 30 --out /tmp/peers.json

The model is the config's (DeepSeek-LLM is the Llama architecture: RMSNorm, RoPE, SwiGLU,
grouped-query attention, untied head), built on the PyTorch side as `LlamaForCausalLM` from the
config.json that `dsjax.convert` would write. Both train with AdamW at the same learning rate
schedule, betas, eps, weight decay (not on norms) and global-norm clipping, in float32, on the
same batches: rows of the standard library's source, each row one causal sequence (HF Llama has
no document ids, so dsjax is given none either). PyTorch runs eager (no torch.compile) with
`torch.set_num_threads(--threads)`, default all cores.

dsjax runs twice: on a one-device mesh (1, 1, 1), like for like with one PyTorch process using
every core, and on the config's own mesh of simulated CPU devices (cpu_tiny: 2 x 2 x 2 = 8, sharing
the same cores, so it pays for the collectives without gaining any hardware). Each trainer runs in
a process of its own (`--worker`, benchmarks/workers.py), so it has only its own devices and
threads: the one-device
step is 15% slower in a process that also simulates 8 devices. After warmup steps (compilation;
PyTorch's first steps allocate), the processes alternate rounds of `--round` steps, so machine
drift hits all of them; tokens/s is the median over rounds.
Prints a table; writes {"dsjax_tokens_per_sec" (one-device mesh), "dsjax_mesh_tokens_per_sec",
"transformers_tokens_per_sec", "ratio" (dsjax one-device / transformers), "ratio_mesh",
"maxtext_tokens_per_sec", "ratio_maxtext" (dsjax one-device / MaxText), "model",
"startup_s", "final_loss" and "loss_history" (every step's loss, warmup included) per trainer,
"load_before", "load_after", "cores", "contended" (benchmarks/report.py), ...}; a contended run
prints a warning after the table: PyTorch's threads lose more than XLA's when the cores are shared.
MaxText trains on its own synthetic tokens in its own venv and JAX (benchmarks/maxtext_peer.py):
its speed compares, its loss does not. docs/performance.md has the measured numbers.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import maxtext_peer  # noqa: E402  (benchmarks/maxtext_peer.py)
import report  # noqa: E402  (benchmarks/report.py)
import workers  # noqa: E402  (benchmarks/workers.py)
from compare import DEFAULT_DATA_DIR, host_batches  # noqa: E402  pylint: disable=C0413
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402
from step_time import _load  # noqa: E402  pylint: disable=wrong-import-position

WORKERS = ("dsjax_one", "dsjax_mesh", "transformers")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--config", default="configs/cpu_tiny.py",
                        help="configs/NAME.py[:ARG][|section.field=value...]")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per trainer")
    parser.add_argument("--round", type=int, default=5, help="steps per alternating round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="PyTorch intra-op threads (default: every core)")
    parser.add_argument("--data", choices=("stdlib", "synthetic"), default="stdlib")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--maxtext", action="store_true",
                        help=f"also MaxText {maxtext_peer.MAXTEXT_VERSION} (installed on first "
                             f"use into --maxtext-venv; needs Python 3.12)")
    parser.add_argument("--maxtext-venv", default=maxtext_peer.DEFAULT_VENV)
    parser.add_argument("--maxtext-python", default=None,
                        help="Python 3.12 to create the MaxText venv with (default: found)")
    parser.add_argument("--worker", choices=WORKERS, default=None,
                        help=argparse.SUPPRESS)  # internal: one trainer, driven over stdin
    args = parser.parse_args(argv)
    if min(args.steps, args.round, args.warmup) < 1:
        parser.error("--steps, --round and --warmup must be >= 1")
    return args


class DsjaxRunner:
    """dsjax's train step on a given mesh."""

    def __init__(self, name, cfg, host):
        import jax  # pylint: disable=import-outside-toplevel
        from dsjax import sharding  # pylint: disable=import-outside-toplevel
        from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

        self.name, self.cfg = name, cfg
        t0 = time.perf_counter()
        devices = jax.devices()[:cfg.mesh.size]
        self.trainer = build_trainer(cfg, sharding.make_mesh(cfg, devices))
        self.state = self.trainer.init()
        self.batches = [self.trainer.device_batch(b) for b in host]
        self.done, self.rounds, self.losses = 0, [], []
        self.run(1)
        self.startup_s = time.perf_counter() - t0  # build, init, compile, first step

    def run(self, n: int) -> float:
        import jax  # pylint: disable=import-outside-toplevel

        pending = []
        t0 = time.perf_counter()
        for _ in range(n):
            self.state, m = self.trainer.step(self.state, self.batches[self.done %
                                                                        len(self.batches)])
            pending.append(m["loss"])
            self.done += 1
        jax.block_until_ready(pending[-1])
        dt = time.perf_counter() - t0
        self.losses += [float(loss) for loss in pending]  # read after the clock stops
        return dt


class TorchRunner:
    """`LlamaForCausalLM` + `torch.optim.AdamW`, the optimizer dsjax's `adamw` config describes."""

    def __init__(self, cfg, host, threads: int):
        import numpy as np  # pylint: disable=import-outside-toplevel
        import torch  # pylint: disable=import-outside-toplevel
        import transformers  # pylint: disable=import-outside-toplevel
        from dsjax.convert import hf_config  # pylint: disable=import-outside-toplevel
        from dsjax.optim.factory import make_schedule  # pylint: disable=import-outside-toplevel

        t0 = time.perf_counter()
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.train.seed)
        self.name, self.torch = "transformers", torch
        hf = hf_config(cfg.model, "float32")
        hf["initializer_range"] = cfg.model.init_std
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf)).float()
        self.model.train()
        o = cfg.optim
        params = list(self.model.named_parameters())
        groups = [{"params": [p for n, p in params if "norm" not in n],
                   "weight_decay": o.weight_decay},
                  {"params": [p for n, p in params if "norm" in n], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
        # dsjax's own schedule, so both take the same step sizes.
        schedule = make_schedule(o, cfg.train.steps)
        lrs = [float(schedule(i)) for i in range(cfg.train.steps + 1)]
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda i: lrs[min(i, len(lrs) - 1)] / o.lr)
        self.clip = o.clip_norm
        self.batches = [(torch.from_numpy(np.asarray(b["inputs"], np.int64)),
                         torch.from_numpy(np.asarray(b["targets"], np.int64))) for b in host]
        self.done, self.rounds, self.losses = 0, [], []
        self.run(1)
        self.startup_s = time.perf_counter() - t0  # build, first step

    def run(self, n: int) -> float:
        torch = self.torch
        pending = []
        t0 = time.perf_counter()
        for _ in range(n):
            inputs, targets = self.batches[self.done % len(self.batches)]
            logits = self.model(input_ids=inputs, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     targets.reshape(-1))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.opt.step()
            self.sched.step()
            pending.append(loss.detach())
            self.done += 1
        dt = time.perf_counter() - t0
        self.losses += [float(loss) for loss in pending]
        return dt


def prepared(args: argparse.Namespace):
    """(config for `total` steps, its one-device variant, total steps)."""
    cfg = _load(args.config)
    if cfg.optim.name != "adamw" or cfg.train.compute_dtype != "float32":
        sys.exit(f"peers: {args.config} trains with {cfg.optim.name} in "
                 f"{cfg.train.compute_dtype}; the comparison is AdamW in float32")
    total = args.warmup + args.steps
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=total))
    one = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=1, tensor=1,
                                                            pipeline=1, fsdp=False))
    return cfg, one, total


class _Served:
    """What a `--worker` process serves (benchmarks/workers.py): one trainer, round by round."""

    def __init__(self, runner, info: dict):
        self.runner, self.info = runner, info

    def hello(self) -> dict:
        r = self.runner
        return {"name": r.name, "startup_s": r.startup_s, "losses": r.losses, **self.info}

    def round(self, n: int) -> dict:
        seconds = self.runner.run(n)
        return {"seconds": seconds, "losses": self.runner.losses[-n:]}


def worker_main(args: argparse.Namespace) -> None:
    """One trainer in this process (with only the devices it needs): builds it, runs its first
    step, then serves rounds of steps."""
    cfg, one, total = prepared(args)
    devices = cfg.mesh.size
    ensure_cpu_devices(devices if args.worker == "dsjax_mesh" else 1)
    host = host_batches(cfg.data.seq_len, cfg.data.global_batch, min(total, 32), args.data,
                        args.data_dir, min(cfg.model.vocab_size, 256), cfg.train.seed,
                        packed=False)
    if args.worker == "transformers":
        runner = TorchRunner(cfg, host, args.threads)
        info = {"torch": runner.torch.__version__,
                "transformers": __import__("transformers").__version__}
    else:
        import jax  # pylint: disable=import-outside-toplevel
        mesh = args.worker == "dsjax_mesh"
        runner = DsjaxRunner(f"dsjax {sharding_shape(cfg)}" if mesh else "dsjax (1,1,1)",
                             cfg if mesh else one, host)
        info = {"jax": jax.__version__, "params": runner.trainer.param_count}
    workers.serve(_Served(runner, info))


class WorkerRunner:
    """A `--worker` process of this script, driven round by round like an in-process runner."""

    def __init__(self, kind: str, argv: list[str]):
        self.worker = workers.Worker(__file__, [*argv, "--worker", kind], kind)
        ready = dict(self.worker.hello)
        self.name, self.startup_s = ready.pop("name"), ready.pop("startup_s")
        self.losses = ready.pop("losses")
        self.info = ready
        self.done, self.rounds = len(self.losses), []

    def run(self, n: int) -> float:
        reply = self.worker.call("round", n=n)
        self.losses += reply["losses"]
        self.done += n
        return reply["seconds"]

    def close(self) -> None:
        self.worker.close()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    cfg, _, total = prepared(args)
    mesh_devices = cfg.mesh.size
    B, S = cfg.data.global_batch, cfg.data.seq_len
    passed = list(argv if argv is not None else sys.argv[1:])
    timing = report.timing_start()
    by_kind = {}  # WORKERS kind (or "maxtext") -> its runner, in start order
    try:
        for kind in WORKERS:
            if kind != "dsjax_mesh" or mesh_devices > 1:
                by_kind[kind] = WorkerRunner(kind, passed)
        if args.maxtext:
            by_kind["maxtext"] = maxtext_peer.MaxTextRunner(cfg, total, args.maxtext_venv,
                                                            args.maxtext_python)
        runners = list(by_kind.values())
        for r in runners:  # each has run its first step
            if args.warmup > 1:
                r.run(args.warmup - 1)
        while any(r.done < total for r in runners):
            for r in runners:
                n = min(args.round, total - r.done)
                if n > 0:
                    r.rounds.append(r.run(n) / n)
    finally:
        for r in by_kind.values():
            r.close()
    dsjax_one, torch_r = by_kind["dsjax_one"], by_kind["transformers"]
    dsjax_mesh, maxtext = by_kind.get("dsjax_mesh"), by_kind.get("maxtext")
    conditions = report.load_record(timing)

    tokens = B * S
    rate = {r.name: tokens / statistics.median(r.rounds) for r in runners}
    m = cfg.model
    result = {
        "dsjax_tokens_per_sec": rate[dsjax_one.name],
        "dsjax_mesh_tokens_per_sec": rate[dsjax_mesh.name] if dsjax_mesh else None,
        "transformers_tokens_per_sec": rate[torch_r.name],
        "ratio": rate[dsjax_one.name] / rate[torch_r.name],
        "ratio_mesh": rate[dsjax_mesh.name] / rate[torch_r.name] if dsjax_mesh else None,
        "maxtext_tokens_per_sec": rate[maxtext.name] if maxtext else None,
        "ratio_maxtext": rate[dsjax_one.name] / rate[maxtext.name] if maxtext else None,
        "model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads,
                  "head_dim": m.resolved_head_dim, "mlp_dim": m.mlp_dim,
                  "vocab_size": m.vocab_size, "params": dsjax_one.info["params"]},
        "config": args.config, "steps": args.steps, "warmup_steps": args.warmup,
        "round_steps": args.round, "global_batch": B, "seq_len": S, "data": args.data,
        "mesh": dict(zip(("data", "tensor", "pipeline"), sharding_shape(cfg))),
        "torch_threads": args.threads, "cpu_count": os.cpu_count(),
        # Other work on the machine slows PyTorch's OpenMP threads more than XLA's pool.
        **conditions,
        "versions": {"jax": dsjax_one.info["jax"], "torch": torch_r.info["torch"],
                     "transformers": torch_r.info["transformers"],
                     **({"maxtext": maxtext_peer.MAXTEXT_VERSION,
                         "maxtext_jax": maxtext.jax_version} if maxtext else {})},
        "method": "alternating rounds, each trainer in its own process (MaxText's paused "
                  "between its rounds); median tokens/s over rounds",
        "startup_s": {r.name: r.startup_s for r in runners},
        "final_loss": {r.name: r.losses[-1] for r in runners},
        "loss_history": {r.name: r.losses for r in runners},
        "rounds_ms": {r.name: [1000 * s for s in r.rounds] for r in runners},
    }
    print(f"{'trainer':<22}{'tokens/s':>12}{'ms/step':>10}{'x transformers':>16}"
          f"{'startup s':>11}{'final loss':>12}")
    for r in runners:
        print(f"{r.name:<22}{rate[r.name]:>12,.0f}{1000 * tokens / rate[r.name]:>10.1f}"
              f"{rate[r.name] / rate[torch_r.name]:>16.2f}{r.startup_s:>11.1f}"
              f"{r.losses[-1]:>12.3f}")
    if maxtext:
        print(f"dsjax (1,1,1) runs at {result['ratio_maxtext']:.2f}x MaxText's tokens/s "
              f"(MaxText on jax {maxtext.jax_version}, synthetic tokens: its loss is not "
              f"comparable)")
    print(f"{m.num_layers} layers x {m.hidden_size} wide, {result['model']['params']:,} params; "
          f"batch {B} x {S} tokens; {args.steps} timed steps in rounds of {args.round}; "
          f"torch threads {args.threads} of {os.cpu_count()} cores; "
          f"{report.describe_load(conditions)}")
    report.warn_if_contended(conditions, "peers")
    report.write_json(args.out, result)
    return result


def sharding_shape(cfg) -> tuple[int, int, int]:
    return cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipeline


if __name__ == "__main__":
    main()
