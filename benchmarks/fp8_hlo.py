"""Which matmuls of a compiled train step run in fp8: counted in the program, not assumed.

  python benchmarks/fp8_hlo.py --config configs/h100_fp8.py:smoke --out benchmarks/results/fp8_hlo_smoke.json

Lowers one training step of the config (abstract inputs, nothing runs) and lists every
`dot_general` of the StableHLO with its operand dtypes. The expected count comes from the precision
policy: each fp8 projection is 3 GEMMs (forward e4m3 x e4m3; dgrad and wgrad e5m2 x e4m3) per
distinct layer body in the scanned stack. Recomputation duplicates forward dots in the backward,
so counts are taken with `remat.policy = none` (the precision policy is independent of it). On GPU
it also compiles the step and counts cuBLASLt fp8 GEMMs (`__cublas$lt$matmul$f8`) in the optimised
HLO, and fp8 operands that ended up in Triton GEMM fusions instead (should be none).
It lists the shape of every fp8 GEMM, and counts fp8 values converted up to feed an ordinary
GEMM, so that a silent upcast shows. Prints tables; writes {"config", "fp8_dots",
"expected_fp8_dots", "high_precision_dots", "expected_high_precision_dots", "fp8_gemm_shapes",
"upcast_gemm_inputs", "cublas_fp8_gemms" (null on CPU), "triton_fp8_fusions", "dots", and on
GPU "cublas_fp8_gemm_shapes" and "fp8_dots_left_in_hlo"}.
"""

import argparse
import collections
import dataclasses
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)
from dsjax.config import load  # noqa: E402  (no JAX import yet)
from dsjax.runtime.cpu_devices import ensure_cpu_devices  # noqa: E402

# The attention core's dots per layer body in the StableHLO, by implementation
# (dsjax/model/attention.py, every impl of ATTENTION_IMPLS but auto): xla differentiates QK^T and
# PV (forward, two gradients each); flash's backward recomputes QK^T before its dV, dP, dQ and
# dK; cudnn is a cuDNN custom call and pallas a Triton kernel, no dot_general (pallas only runs
# compiled on GPU, where fp8_hlo counts; interpreted on CPU it would show its kernel's dots).
ATTENTION_CORE_DOTS = {"xla": 6, "flash": 7, "cudnn": 0, "pallas": 0}
HEAD_DOTS = 3            # unchunked output head: forward, dgrad, wgrad
CHUNKED_HEAD_DOTS = 4    # model.loss_chunk > 0: the backward recomputes each chunk's logits
MATMULS = 7              # q, k, v, o, gate, up, down
_DOT = re.compile(r"(%[^\s,]+) = stablehlo\.dot_general (%[^\s,]+), (%[^\s,]+),.*:\s*"
                  r"\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)\s*->\s*tensor<([^>]*)>")
_CONVERT = re.compile(r"(%[^\s,]+) = stablehlo\.convert (%[^\s,]+) : \(tensor<([^>]*)>\) -> "
                      r"tensor<([^>]*)>")


def _fp8(tensor_type: str) -> bool:
    return "xf8" in tensor_type or tensor_type.startswith("f8")


def fp8_gemm_shapes(stablehlo: str) -> dict[str, int]:
    """{"lhs x rhs -> result" tensor types: count} of every dot_general with an fp8 operand."""
    return dict(collections.Counter(f"{m[4]} x {m[5]} -> {m[6]}" for m in _DOT.finditer(stablehlo)
                                    if _fp8(m[4]) or _fp8(m[5])))


def upcast_gemm_inputs(stablehlo: str) -> int:
    """Operands of ordinary (not fp8) dot_generals that are fp8 values converted up: a silent
    upcast, fp8 storage but a bf16/f32 GEMM. SSA names are per function, so each is read apart."""
    count = 0
    for body in stablehlo.split("func.func")[1:]:
        upcast = {m[1] for m in _CONVERT.finditer(body) if _fp8(m[3]) and not _fp8(m[4])}
        count += sum((m[2] in upcast) + (m[3] in upcast) for m in _DOT.finditer(body)
                     if not (_fp8(m[4]) or _fp8(m[5])))
    return count


def expected_counts(trainer) -> tuple[int, int]:
    """(fp8 dots, high-precision dots) the precision policy implies for one step's program."""
    model = trainer.model
    core = ATTENTION_CORE_DOTS[model.attention_impl(trainer.cfg.data.seq_len)]
    head = CHUNKED_HEAD_DOTS if trainer.cfg.model.loss_chunk else HEAD_DOTS
    fp8_dots = high = 0
    for _, _, key, pattern in model._segments():  # pylint: disable=protected-access
        n = len(pattern)  # distinct layer bodies in this segment's scan
        in_fp8 = len(key[0][0])  # the segment's fp8 projections
        fp8_dots += 3 * in_fp8 * n
        high += (core + 3 * (MATMULS - in_fp8)) * n
    return fp8_dots, high + head


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--preset", default=None, help="a model preset of step_time.py (1b, smoke)")
    args = parser.parse_args(argv)

    cfg = load(args.config)
    if args.preset:
        import step_time  # pylint: disable=import-outside-toplevel
        cfg = step_time._apply_preset(cfg, args.preset)  # pylint: disable=protected-access
    ensure_cpu_devices(cfg.mesh.size)
    import jax  # pylint: disable=import-outside-toplevel
    from dsjax import sharding  # pylint: disable=import-outside-toplevel
    from dsjax.metrics import gemms  # pylint: disable=import-outside-toplevel
    from dsjax.train import build_trainer  # pylint: disable=import-outside-toplevel

    cfg = dataclasses.replace(cfg, remat=dataclasses.replace(cfg.remat, policy="none",
                                                             layers="all"),
                              optim=dataclasses.replace(cfg.optim, name="adamw"))
    trainer = build_trainer(cfg)
    state, batch = trainer.abstract_state(), trainer.abstract_batch()
    with sharding.activate(trainer.mesh, trainer.rules):
        lowered = trainer.jitted(0).lower(state, batch)
    dots = gemms.dot_general_dtypes(lowered.as_text())
    is_fp8 = lambda d: any(t.startswith("f8") for t in d[:2])
    kinds = collections.Counter(" x ".join(d[:2]) + " -> " + d[2] for d in dots)
    expected_fp8, expected_high = expected_counts(trainer)
    result = {"config": args.config, "compute_dtype": cfg.train.compute_dtype,
              "fp8_recipe": cfg.fp8.recipe, "fp8_matmuls": cfg.fp8.matmuls,
              "fp8_dots": sum(map(is_fp8, dots)), "expected_fp8_dots": expected_fp8,
              "high_precision_dots": sum(not is_fp8(d) for d in dots),
              "expected_high_precision_dots": expected_high,
              "fp8_result_dtypes": sorted({d[2] for d in dots if is_fp8(d)}),
              "fp8_gemm_shapes": fp8_gemm_shapes(lowered.as_text()),
              "upcast_gemm_inputs": upcast_gemm_inputs(lowered.as_text()),
              "cublas_fp8_gemms": None, "triton_fp8_fusions": None,
              "backend": jax.devices()[0].platform, "dots": dict(kinds)}
    if jax.devices()[0].platform == "gpu":
        hlo = lowered.compile().as_text()
        result["cublas_fp8_gemms"] = gemms.fp8_gemm_calls(hlo)
        result["triton_fp8_fusions"] = len(re.findall(r"__triton_gemm[^\n]*f8e", hlo))
        # Output shapes of the cuBLASLt fp8 calls: set against fp8_gemm_shapes, a call wider
        # than any dot is two dots sharing an operand that XLA's dot merger joined.
        result["cublas_fp8_gemm_shapes"] = gemms.cublas_fp8_output_shapes(hlo)
        # fp8 dots XLA did not hand to cuBLASLt (e.g. a layout it could not rewrite)
        result["fp8_dots_left_in_hlo"] = [line.strip()[:240] for line in hlo.splitlines()
                                          if " dot(" in line and "f8e" in line]

    print(f"{args.config}: (optimizer counted as adamw) compute {cfg.train.compute_dtype}, recipe {cfg.fp8.recipe}, "
          f"matmuls {cfg.fp8.matmuls} (counts with remat none)")
    print(f"{'operands -> result':<40} {'dots':>5}")
    for kind, n in sorted(kinds.items()):
        print(f"{kind:<40} {n:>5}")
    print(f"{'fp8 GEMM (lhs x rhs -> result)':<72} {'dots':>5}")
    for shape, n in sorted(result["fp8_gemm_shapes"].items()):
        print(f"{shape:<72} {n:>5}")
    print(f"fp8 values converted up into ordinary GEMMs: {result['upcast_gemm_inputs']}")
    print(f"fp8 dots {result['fp8_dots']} (expected {expected_fp8}), high-precision dots "
          f"{result['high_precision_dots']} (expected {expected_high}), cuBLASLt fp8 GEMMs "
          f"{result['cublas_fp8_gemms']}, Triton fp8 fusions {result['triton_fp8_fusions']}")
    report.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
