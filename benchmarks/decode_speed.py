"""KV-cache generation against recomputing every prefix: tokens/s of each, side by side.

  python benchmarks/decode_speed.py --config configs/cpu_tiny.py --new_tokens 256 \
      --out benchmarks/results/decode_speed_cpu.json

One device, one prompt of `--prompt_len` random tokens, greedy, `--new_tokens` new tokens with
no stop token, the config's model at its init weights (speed does not depend on them). Two
workers, each in a process of its own (benchmarks/workers.py), alternate `--rounds` rounds:
"cached" is `dsjax.evaluate.Generator` (one compiled prefill + decode loop); "recompute" runs
the full model over a fixed window of prompt + new tokens for every new token and reads the
logits at the last filled position (a causal model ignores what follows), the way generation
worked before the cache. Both produce the same tokens (checked). Writes {"rows", "speedup",
"new_tokens", "prompt_len", "model", "load_before", "load_after", "cores", "others_cpu_share",
"contended"}.
"""

import argparse
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

ONE_DEVICE = {"mesh.data": 1, "mesh.tensor": 1, "mesh.pipeline": 1}


def _config(args):
    return load(args.config, {**report.parse_overrides(args.set or []), **ONE_DEVICE})


class _Served:
    """One side: builds the model and its generation, compiles it with one untimed run."""

    def __init__(self, args, side: str):
        cfg = _config(args)
        ensure_cpu_devices(1)
        import jax  # pylint: disable=import-outside-toplevel
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
        import numpy as np  # pylint: disable=import-outside-toplevel
        from dsjax.evaluate import Generator, Sampling  # pylint: disable=import-outside-toplevel
        from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

        trainer = build_trainer(cfg)
        params = trainer.init().params
        P, N = args.prompt_len, args.new_tokens
        prompt = np.random.default_rng(0).integers(0, 256, P).astype(np.int32).tolist()
        if side == "cached":
            generator = Generator(trainer.eval_model, trainer.mesh, trainer.rules,
                                  Sampling(temperature=0.0), N)
            self.run = lambda: generator.generate(params, [prompt])[0]
        else:
            model = trainer.eval_model
            step = jax.jit(lambda p, t, n: jnp.argmax(model.apply({"params": p}, t)[0, n - 1]))

            def recompute():
                window = np.zeros((1, P + N), np.int32)
                window[0, :P] = prompt
                for i in range(P, P + N):
                    window[0, i] = int(step(params, jnp.asarray(window), i))
                return window[0, P:].tolist()
            self.run = recompute
        t0 = time.perf_counter()
        self.tokens = self.run()  # compiles
        self.compile_s = time.perf_counter() - t0

    def hello(self) -> dict:
        return {"compile_s": self.compile_s, "tokens": self.tokens}

    def round(self) -> dict:
        t0 = time.perf_counter()
        tokens = self.run()
        return {"seconds": time.perf_counter() - t0, "same": tokens == self.tokens}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/cpu_tiny.py")
    parser.add_argument("--set", action="append", help="section.field=value; repeatable")
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: a side
    args = parser.parse_args(argv)
    if args.worker is not None:
        return workers.serve(_Served(args, args.worker))
    cfg = _config(args)  # a bad config fails here, before any worker
    passed = list(argv if argv is not None else sys.argv[1:])

    timing = report.timing_start()
    sides, runs, times = ("cached", "recompute"), {}, {"cached": [], "recompute": []}
    try:
        for side in sides:
            runs[side] = workers.Worker(__file__, [*passed, "--worker", side], side)
        for _ in range(args.rounds):
            for side in sides:
                answer = runs[side].call("round")
                assert answer["same"], f"{side}: a round's tokens differ from its first run's"
                times[side].append(answer["seconds"])
        same = runs["cached"].hello["tokens"] == runs["recompute"].hello["tokens"]
    finally:
        for run in runs.values():
            run.close()
    conditions = report.load_record(timing)
    if not same:
        raise SystemExit("decode_speed: the cached and recomputed greedy tokens differ")
    rows = [{"side": side, "seconds": statistics.median(times[side]), "rounds": times[side],
             "tokens_per_sec": args.new_tokens / statistics.median(times[side]),
             "compile_s": runs[side].hello["compile_s"]} for side in sides]
    speedup = rows[1]["seconds"] / rows[0]["seconds"]
    m = cfg.model
    result = {"rows": rows, "speedup": speedup, "new_tokens": args.new_tokens,
              "prompt_len": args.prompt_len, "config": args.config,
              "model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                        "attention": m.attention, "vocab_size": m.vocab_size},
              "method": "one device, greedy, each side in its own process, alternating rounds",
              **conditions}
    print(f"{'side':<10} {'s/generation':>13} {'tok/s':>9} {'compile s':>10}")
    for r in rows:
        print(f"{r['side']:<10} {r['seconds']:>13.3f} {r['tokens_per_sec']:>9.1f} "
              f"{r['compile_s']:>10.1f}")
    print(f"cached is {speedup:.1f}x faster for {args.new_tokens} new tokens after "
          f"{args.prompt_len}; {report.describe_load(conditions)}")
    report.warn_if_contended(conditions, "decode_speed")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
