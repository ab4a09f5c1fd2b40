"""dsjax against Hugging Face `transformers` + PyTorch: one tiny DeepSeek-architecture model
trained on CPU by each for the same steps, batch and sequence length, in tokens/s.

  python benchmarks/peers.py --config configs/cpu_tiny.py --steps 30 \
      --out benchmarks/results/peers_cpu.json

The model is the config's (DeepSeek-LLM is the Llama architecture: RMSNorm, RoPE, SwiGLU,
grouped-query attention, untied head), built on the PyTorch side as `LlamaForCausalLM` from the
config.json that `dsjax.convert` would write. Both train with AdamW at the same learning rate
schedule, betas, eps, weight decay (not on norms) and global-norm clipping, in float32, on the
same batches: rows of the standard library's source, each row one causal sequence (HF Llama has
no document ids, so dsjax is given none either). PyTorch runs eager (no torch.compile) with
`torch.set_num_threads(--threads)`, default all cores.

dsjax runs twice: on a one-device mesh (1, 1, 1), like for like with one PyTorch process using
every core, and on the config's own mesh of simulated CPU devices (cpu_tiny: 2 x 2 x 2 = 8, sharing
the same cores, so it pays for the collectives without gaining any hardware). After warmup steps
(compilation; PyTorch's first steps allocate), the three alternate rounds of `--round` steps,
so machine drift hits all of them; tokens/s is the median over rounds.
Prints a table; writes {"dsjax_tokens_per_sec" (one-device mesh), "dsjax_mesh_tokens_per_sec",
"transformers_tokens_per_sec", "ratio" (dsjax one-device / transformers), "ratio_mesh",
"model", "final_loss" and "loss_history" (every step's loss, warmup included) per trainer,
"load_before", "load_after", "cores", "contended" (benchmarks/report.py), ...}; a contended run
prints a warning after the table: PyTorch's threads lose more than XLA's when the cores are shared.
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
from compare import DEFAULT_DATA_DIR, host_batches  # noqa: E402  pylint: disable=C0413
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402
from step_time import _load  # noqa: E402  pylint: disable=wrong-import-position


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
        devices = jax.devices()[:cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline]
        self.trainer = build_trainer(cfg, sharding.make_mesh(cfg, devices))
        self.state = self.trainer.init()
        self.batches = [self.trainer.device_batch(b) for b in host]
        self.done, self.rounds, self.losses = 0, [], []

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


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = _load(args.config)
    if cfg.optim.name != "adamw" or cfg.train.compute_dtype != "float32":
        sys.exit(f"peers: {args.config} trains with {cfg.optim.name} in "
                 f"{cfg.train.compute_dtype}; the comparison is AdamW in float32")
    total = args.warmup + args.steps
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=total))
    one = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=1, tensor=1,
                                                            pipeline=1, fsdp=False))
    mesh_devices = cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline
    ensure_cpu_devices(mesh_devices)
    import jax  # pylint: disable=import-outside-toplevel

    B, S = cfg.data.global_batch, cfg.data.seq_len
    timing = report.timing_start()
    host = host_batches(S, B, min(total, 32), args.data, args.data_dir,
                        min(cfg.model.vocab_size, 256), cfg.train.seed, packed=False)
    runners = [DsjaxRunner("dsjax (1,1,1)", one, host)]
    if mesh_devices > 1 and jax.device_count() >= mesh_devices:
        runners.append(DsjaxRunner(f"dsjax {tuple(sharding_shape(cfg))}", cfg, host))
    runners.append(TorchRunner(cfg, host, args.threads))
    for r in runners:
        r.run(args.warmup)
    while any(r.done < total for r in runners):
        for r in runners:
            n = min(args.round, total - r.done)
            if n > 0:
                r.rounds.append(r.run(n) / n)
    conditions = report.load_record(timing)

    tokens = B * S
    rate = {r.name: tokens / statistics.median(r.rounds) for r in runners}
    dsjax_one, torch_r = runners[0], runners[-1]
    dsjax_mesh = runners[1] if len(runners) == 3 else None
    m = cfg.model
    result = {
        "dsjax_tokens_per_sec": rate[dsjax_one.name],
        "dsjax_mesh_tokens_per_sec": rate[dsjax_mesh.name] if dsjax_mesh else None,
        "transformers_tokens_per_sec": rate[torch_r.name],
        "ratio": rate[dsjax_one.name] / rate[torch_r.name],
        "ratio_mesh": rate[dsjax_mesh.name] / rate[torch_r.name] if dsjax_mesh else None,
        "model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads,
                  "head_dim": m.resolved_head_dim, "mlp_dim": m.mlp_dim,
                  "vocab_size": m.vocab_size, "params": dsjax_one.trainer.param_count},
        "config": args.config, "steps": args.steps, "warmup_steps": args.warmup,
        "round_steps": args.round, "global_batch": B, "seq_len": S, "data": args.data,
        "mesh": dict(zip(("data", "tensor", "pipeline"), sharding_shape(cfg))),
        "torch_threads": args.threads, "cpu_count": os.cpu_count(),
        # Other work on the machine slows PyTorch's OpenMP threads more than XLA's pool.
        **conditions,
        "versions": {"jax": jax.__version__, "torch": torch_r.torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "method": "alternating rounds in one process; median tokens/s over rounds",
        "final_loss": {r.name: r.losses[-1] for r in runners},
        "loss_history": {r.name: r.losses for r in runners},
        "rounds_ms": {r.name: [1000 * s for s in r.rounds] for r in runners},
    }
    print(f"{'trainer':<22}{'tokens/s':>12}{'ms/step':>10}{'x transformers':>16}"
          f"{'final loss':>12}")
    for r in runners:
        print(f"{r.name:<22}{rate[r.name]:>12,.0f}{1000 * tokens / rate[r.name]:>10.1f}"
              f"{rate[r.name] / rate[torch_r.name]:>16.2f}{r.losses[-1]:>12.3f}")
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
