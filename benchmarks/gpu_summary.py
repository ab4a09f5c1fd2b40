"""The GPU MFU run's headline figures, from the rows already in `gpu_mfu.json`.

The model rows run DeepSeek-7B width at 2 and 6 layers; the difference is the cost of 4 layers,
so the step at full depth (30 layers) is extrapolated: fixed + 30 x per layer, in milliseconds per
token (so rows whose batch the GPU's memory set apart still compare), then scaled to the deeper
row's tokens. Every such figure says `extrapolated_to_layers`. MFU counts the model's FLOPs
against the bf16 datasheet peak in both precisions, so fp8's figure is a bf16-equivalent MFU (an
fp8 GEMM's own peak is twice bf16's), labelled so. fp8 against bf16 is given end to end and per
layer (the part fp8 speeds up), beside the measured fp8/bf16 GEMM ceiling ratio (the most fp8
could give). Whatever a row lacks leaves its figures null, never a guess.
"""

from __future__ import annotations

from typing import Any

from dsjax import metrics as mx
from dsjax.config import ModelConfig

FULL_DEPTH = 30  # DeepSeek-LLM-7B's layers
DTYPES = ("bfloat16", "fp8")


def _peak(kind: str | None) -> tuple[float | None, str]:
    for name, peak in mx.PEAK_BF16.items():
        if kind and name in kind:
            return peak, f"{name} bf16 datasheet"
    return None, f"no datasheet peak for {kind!r} (MFU null)"


def model_rows(record: dict[str, Any], dtype: str) -> list[dict[str, Any]]:
    """The finished model rows of `dtype`, shallowest first."""
    rows = [r for r in record.get("rows", {}).values()
            if r.get("piece") == "model" and r.get("dtype") == dtype and "step_ms" in r]
    return sorted(rows, key=lambda r: r["layers"])


def extrapolate(lo: dict[str, Any], hi: dict[str, Any], peak: float | None) -> dict[str, Any]:
    """Full-depth step time and MFU from two depths of one dtype (see the module docstring)."""
    tokens_lo, tokens_hi = lo["batch"] * lo["seq_len"], hi["batch"] * hi["seq_len"]
    per_tok_lo, per_tok_hi = lo["step_ms"] / tokens_lo, hi["step_ms"] / tokens_hi
    per_layer = (per_tok_hi - per_tok_lo) / (hi["layers"] - lo["layers"])
    fixed = per_tok_lo - lo["layers"] * per_layer
    full_per_tok = fixed + FULL_DEPTH * per_layer
    cfg = ModelConfig(**{**hi["model"], "num_layers": FULL_DEPTH})
    flops_per_token = mx.flops_per_token(cfg, hi["seq_len"])
    achieved = flops_per_token / (full_per_tok / 1000)
    return {"extrapolated_to_layers": FULL_DEPTH, "from_layers": [lo["layers"], hi["layers"]],
            "batch": hi["batch"], "seq_len": hi["seq_len"],
            "per_layer_ms": per_layer * tokens_hi, "fixed_ms": fixed * tokens_hi,
            "step_ms": full_per_tok * tokens_hi, "flops_per_sec": achieved,
            "mfu": achieved / peak if peak else None, "last_loss": hi["last_loss"],
            "joules_per_token_at_depth": hi.get("joules_per_token")}


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """{"full_depth": {dtype: ...}, the headline MFUs and ratios, device, versions, flags}."""
    rows = record.get("rows", {})
    pre = rows.get("preflight", {})
    ceil = rows.get("ceilings", {})
    kind = pre.get("device_kind")
    peak, peak_source = _peak(kind)
    full = {}
    for dtype in DTYPES:
        depth = model_rows(record, dtype)
        if len(depth) >= 2 and depth[0]["layers"] != depth[-1]["layers"]:
            full[dtype] = extrapolate(depth[0], depth[-1], peak)
    bf16, fp8 = full.get("bfloat16"), full.get("fp8")
    both = bf16 is not None and fp8 is not None
    ceiling_ratio = (ceil["fp8_gemm_flops"] / ceil["bf16_gemm_flops"]
                     if ceil.get("bf16_gemm_flops") and ceil.get("fp8_gemm_flops") else None)
    energy = [full[d]["joules_per_token_at_depth"] for d in DTYPES] if both else []
    return {
        "device_kind": kind, "jax": pre.get("jax"), "jaxlib": pre.get("jaxlib"),
        "cudnn_version": pre.get("cudnn_version"), "xla_flags": pre.get("xla_flags"),
        "settings": {"scan_layers": False, "remat": "none", "overlap_profile": None,
                     "command_buffers": "off", "triton_gemm": "off", "xla_remat_pass": "off"},
        "peak_flops_per_device": peak, "peak_source": peak_source,
        "extrapolated_to_layers": FULL_DEPTH, "full_depth": full,
        "mfu_bf16_full_depth": bf16["mfu"] if bf16 else None,
        # fp8's FLOPs at the bf16 peak: comparable with bf16's MFU, not with an fp8 peak
        "mfu_fp8_bf16_equivalent_full_depth": fp8["mfu"] if fp8 else None,
        "mfu_vs_measured_bf16_gemm": {d: f["flops_per_sec"] / ceil["bf16_gemm_flops"]
                                      for d, f in full.items()} if ceil.get("bf16_gemm_flops")
                                     else None,
        "fp8_speedup_end_to_end": bf16["step_ms"] / fp8["step_ms"] if both else None,
        "fp8_speedup_per_layer": (bf16["per_layer_ms"] / fp8["per_layer_ms"]
                                  if both and fp8["per_layer_ms"] > 0 else None),
        "fp8_over_bf16_gemm_ceiling": ceiling_ratio,
        "fp8_loss_gap": ((fp8["last_loss"] - bf16["last_loss"]) / bf16["last_loss"]
                         if both else None),
        "fp8_energy_ratio": energy[1] / energy[0] if energy and None not in energy else None,
    }


def table(summary: dict[str, Any]) -> str:
    """The printed table: one line per dtype at full depth, then the ratios."""
    lines = [f"{summary['device_kind']}, JAX {summary['jax']}, cuDNN {summary['cudnn_version']}"]
    for dtype, f in summary["full_depth"].items():
        mfu = "n/a" if f["mfu"] is None else f"{100 * f['mfu']:.1f}%"
        label = " (bf16-equivalent)" if dtype == "fp8" else ""
        lines.append(f"{dtype:<9} B {f['batch']} x {f['seq_len']}: per layer "
                     f"{f['per_layer_ms']:8.2f} ms, fixed {f['fixed_ms']:8.2f} ms, "
                     f"{FULL_DEPTH} layers (extrapolated) {f['step_ms']:9.1f} ms, MFU {mfu}{label}")
    lines.append(f"fp8/bf16: end to end {summary['fp8_speedup_end_to_end']}, per layer "
                 f"{summary['fp8_speedup_per_layer']}, GEMM ceiling "
                 f"{summary['fp8_over_bf16_gemm_ceiling']}, loss gap {summary['fp8_loss_gap']}")
    return "\n".join(lines)
