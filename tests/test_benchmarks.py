"""Every benchmark command the docs give, run as a user would (`python benchmarks/X.py ...` in a
subprocess) at a tiny size: exit 0, the table, the JSON keys its docstring promises, and for the
two that train, that training happened. The numbers themselves belong to benchmarks/results/."""

import ast
import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import ROOT, TINY_MODEL, child_env, tiny

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compare  # noqa: E402  pylint: disable=wrong-import-position
import pipeline_table  # noqa: E402  pylint: disable=wrong-import-position
import report  # noqa: E402  pylint: disable=wrong-import-position

LOAD_KEYS = {"load_before", "load_after", "cores", "contended"}  # benchmarks/report.py
# The model of the tiny runs (cpu_tiny's architecture, 2 x 64), in each script's override syntax.
TINY = tiny({"data.seq_len": 32})
del TINY["model.vocab_size"]  # the benchmarked configs keep their own vocabulary
TINY_PIPE = "|".join(f"{k}={v}" for k, v in {**TINY, "data.global_batch": 8}.items())
TINY_SET = [a for k, v in TINY.items() for a in ("--set", f"{k}={v}")]
TINY_7B = [a for k, v in {"model.num_layers": 4, "model.hidden_size": 128, "model.num_heads": 4,
                          "model.num_kv_heads": 4, "model.mlp_dim": 256,
                          "model.vocab_size": 512}.items() for a in ("--set", f"{k}={v}")]
# DeepSeek-V2-Lite's config at 64 wide: MLA 2 heads, 8 experts of 32, top-2, 3 layers.
TINY_V2_LITE = [a for k, v in {
    "model.num_layers": 3, "model.hidden_size": 64, "model.num_heads": 2,
    "model.num_kv_heads": 2, "model.mlp_dim": 128, "model.vocab_size": 512,
    "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 16, "model.n_routed_experts": 8, "model.num_experts_per_tok": 2,
    "model.moe_intermediate_size": 32}.items() for a in ("--set", f"{k}={v}")]

# name: (script, its arguments at a tiny size ({out}: a temporary folder), the JSON it writes
# under {out}, the top-level keys its docstring promises, the keys of each of its "rows").
SMOKE = {
    "step_time": ("step_time", ["--config", "configs/h100_bf16.py", "--config",
                                "configs/h100_fp8.py", "--preset", "smoke", "--steps", "1",
                                "--rounds", "1", "--out", "{out}/step_time.json"],
                  "step_time.json", {"rows", "ratios", *LOAD_KEYS},
                  {"config", "step_ms", "tokens_per_sec", "mfu", "mem_bytes"}),
    # The CPU defaults (h100_bf16:smoke vs h100_fp8:smoke): test_compare_smoke_configs.
    "compare": ("compare", ["--steps", "2", "--round", "1", "--out", "{out}"], "compare.json",
                {"baseline", "candidate", "change_pct", *LOAD_KEYS}, None),
    "compare_overrides": ("compare", ["--baseline", "configs/h100_bf16.py:smoke", "--candidate",
                                      "configs/h100_fp8.py:smoke|optim.name=adamw"
                                      "|metrics.cost_per_gpu_hour=2.5", "--steps",
                                      "1", "--round", "1", "--out", "{out}"],
                          "compare.json", {"baseline", "candidate", "change_pct", *LOAD_KEYS},
                          None),
    # test_peers_tiny
    "peers": ("peers", ["--config", "configs/cpu_tiny.py|" + TINY_PIPE, "--steps", "10",
                        "--round", "2", "--warmup", "1", "--out", "{out}/peers.json"],
              "peers.json", {"dsjax_tokens_per_sec", "dsjax_mesh_tokens_per_sec",
                             "transformers_tokens_per_sec", "ratio", "ratio_mesh", "model",
                             "final_loss", "loss_history", *LOAD_KEYS}, None),
    # test_peers_maxtext_tiny: the same, with MaxText in its own venv (installed on first use)
    "peers_maxtext": ("peers", ["--config", "configs/cpu_tiny.py|" + TINY_PIPE, "--steps", "10",
                                "--round", "2", "--warmup", "1", "--maxtext", "--out",
                                "{out}/peers.json"],
                      "peers.json", {"maxtext_tokens_per_sec", "ratio_maxtext", "startup_s",
                                     "final_loss", "loss_history", *LOAD_KEYS}, None),
    # 4 layers: circular's chunks per stage default to 2, the smallest that splits them.
    # 2 microbatches, not cpu_tiny's 4: the FLOPs columns compile every tick unrolled
    "pipeline_table": ("pipeline_table", ["--config", "configs/cpu_tiny.py", *TINY_SET,
                                          "--set", "model.num_layers=4", "--microbatches", "2",
                                          "--out", "{out}/pipeline.json"],
                       "pipeline.json", {"config", "rows"},
                       {"schedule", "microbatches", "repeats", "temp_bytes",
                        "collective_permutes", "bubble"}),
    # docs/pipeline.md's flags; 2 layers do not split into 2 stages x 3 repeats: circular's row
    # says so (and is not compiled) instead of the script crashing.
    "pipeline_table_flags": ("pipeline_table", ["--config", "configs/cpu_tiny.py", "--pipeline",
                                                "2", "--repeats", "3", "--microbatches", "2",
                                                "--rows_per_microbatch", "2", *TINY_SET,
                                                "--out", "{out}/pipeline.json"],
                             "pipeline.json", {"config", "rows"},
                             {"schedule", "microbatches", "repeats", "global_batch"}),
    # DeepSeek-7B's config at 128 wide and 2 of its 10 rows: the 10 rows at full width compile
    # 40 programs, ~2 minutes on 2 cores (benchmarks/results/remat_deepseek_7b.json).
    "remat_table": ("remat_table", ["--config", "configs/deepseek_7b.py", *TINY_7B, "--seq_len",
                                    "64", "--rows", "full/all", "--out",
                                    "{out}/remat.json"],
                    "remat.json", {"config", "rows"},
                    {"policy", "layers", "temp_bytes", "flops", "mem_ratio", "flops_ratio"}),
    # The same at S 256 (flash blocks 64) against the unfused attention and unchunked loss.
    "remat_table_baseline": ("remat_table", [
        "--config", "configs/deepseek_7b.py", *TINY_7B, "--set", "model.attention_block_q=64",
        "--set", "model.attention_block_k=64", "--set", "model.loss_chunk=64", "--set",
        "model.attention_impl=flash", "--seq_len", "256", "--rows", "none/all", "--baseline",
        "model.attention_impl=xla", "--baseline", "model.loss_chunk=0", "--out",
        "{out}/remat.json"],
        "remat.json", {"config", "rows", "baseline"},
        {"policy", "layers", "temp_bytes", "baseline_temp_bytes", "temp_vs_baseline"}),
    # docs/moe.md's whole-model comparison: dropless auto against capacity 1.25.
    "remat_table_moe": ("remat_table", [
        "--config", "configs/deepseek_v2_lite.py", *TINY_V2_LITE, "--seq_len", "64", "--rows",
        "none/all", "--baseline", "model.moe_impl=capacity", "--baseline",
        "model.capacity_factor=1.25", "--out", "{out}/remat.json"],
        "remat.json", {"config", "rows", "baseline"},
        {"policy", "layers", "temp_bytes", "baseline_temp_bytes", "temp_vs_baseline"}),
    "comm_bytes": ("comm_bytes", ["--config", "configs/cpu_tiny.py",
                                  "--config.optim.name=onebit_adam",
                                  *[f"--config.{k}={v}" for k, v in TINY.items()],
                                  "--out", "{out}/comm.json"],
                   "comm.json", {"config", "exact_bytes", "compressed_bytes", "ratio",
                                 "collectives_per_step", "exact_collectives_per_step", "mesh",
                                 "gradient_floats_per_device", "float32_allreduce_bytes"}, None),
    # fp8.select=auto against all-fp8 and bf16: one seed, 2 steps of the tiny model, 3 runs.
    "precision_table": ("precision_table", [
        "--config", "configs/cpu_tiny.py", "--steps", "2", "--seeds", "0", *TINY_SET,
        "--set", "data.global_batch=8", "--set", "data.eval_batches=1",
        "--set", "train.sample_tokens=0", "--set", "metrics.tensorboard=False",
        "--out", "{out}/precision.json"],
        "precision.json", {"config", "runs", "eval_loss", "auto_vs_bf16", "auto_minus_fp8"},
        None),
    "comm_bytes_smoke": ("comm_bytes", ["--config", "configs/h100_fp8.py:smoke", "--out",
                                        "{out}/comm.json"],
                         "comm.json", {"config", "exact_bytes", "compressed_bytes", "ratio"},
                         None),
    # 4 heads x 16 and MLA 4 x (8 + 8, v 16), S 64 and 128 (flash blocks 48: several, ragged)
    "attention_table": ("attention_table", ["--heads", "4", "--head_dim", "16", "--mla_dims",
                                            "4,8,8,16", "--seq_lens", "64,128", "--check_seq",
                                            "128", "--block", "48", "--rounds", "1", "--out",
                                            "{out}/attention.json"],
                        "attention.json", {"rows", "backend", "dims", *LOAD_KEYS},
                        {"impl", "seq_len", "attention", "temp_bytes", "max_abs_diff",
                         "grad_max_abs_diff", "ms"}),
    # One MoE layer at 32 wide, 8 experts, top-2, 64 tokens: every impl's row.
    "moe_table": ("moe_table", ["--tokens", "64", "--hidden", "32", "--expert_dim", "16",
                                "--experts", "8", "--k", "2", "--out", "{out}/moe.json"],
                  "moe.json", {"rows", "backend", "dims", "routed_fwd_flops", *LOAD_KEYS},
                  {"impl", "tile", "temp_bytes", "fwd_flops", "step_flops", "fwd_vs_routed",
                   "temp_vs_capacity"}),
    # The attention at 256 tokens over 1 and 2 devices (blocks of 16: 8 a shard), and the long
    # config's whole step at a tiny width.
    "context_table": ("context_table", ["--config", "configs/cpu_tiny.py", "--seq", "256",
                                        "--contexts", "1,2", "--block", "16", "--out",
                                        "{out}/context.json"],
                      "context.json", {"rows", "config", "seq", "dtype", "heads", "backend"},
                      {"context", "impl", "temp_bytes", "temp_vs_cp1", "one_over_c",
                       "total_bytes", "total_vs_cp1", "context_bytes", "blocks_zigzag",
                       "blocks_contiguous", "imbalance_zigzag", "imbalance_contiguous"}),
    "context_table_model": ("context_table", [
        "--config", "configs/deepseek_7b.py:long", "--model", "--seq", "64", "--contexts", "1",
        "--block", "16", *[f"--config.{k}={v}" for k, v in {
            "model.num_layers": 2, "model.hidden_size": 128, "model.num_heads": 4,
            "model.num_kv_heads": 4, "model.mlp_dim": 256, "model.vocab_size": 512,
            "data.seq_len": 256}.items()], "--out", "{out}/context.json"],
        "context.json", {"rows", "model"}, None),
    "decode_speed": ("decode_speed", ["--config", "configs/cpu_tiny.py", *TINY_SET,
                                      "--new_tokens", "8", "--rounds", "1", "--out",
                                      "{out}/decode.json"],
                     "decode.json", {"rows", "speedup", "new_tokens", "prompt_len", "model",
                                     *LOAD_KEYS},
                     {"side", "seconds", "tokens_per_sec", "compile_s"}),
    "plan_table": ("plan_table", ["--config", "configs/cpu_tiny.py", "--devices", "8",
                                  "--measure", "2", "--steps", "1", "--rounds", "1",
                                  *[f"--config.{k}={v}" for k, v in TINY_MODEL.items()],
                                  "--config.data.seq_len=32", "--config.data.global_batch=8",
                                  "--out", "{out}/plan.json"],
                   "plan.json", {"rows", "spearman_rho", "mem_error_max", "profile",
                                 *LOAD_KEYS},
                   {"layout", "predicted_step_ms", "measured_step_ms", "model_mem_bytes",
                    "compiled_mem_bytes", "mem_error"}),
    "fp8_hlo": ("fp8_hlo", ["--config", "configs/h100_fp8.py:smoke", "--out", "{out}/fp8.json"],
                "fp8.json", {"config", "fp8_dots", "expected_fp8_dots", "high_precision_dots",
                             "fp8_gemm_shapes", "upcast_gemm_inputs",
                             "expected_high_precision_dots", "cublas_fp8_gemms",
                             "triton_fp8_fusions", "dots"}, None),
}

# Every `python benchmarks/...` command of README.md, docs/*.md and the scripts' docstrings, and
# the tiny run above that stands for it (GPU-sized configs by their :smoke variants or presets).
DOCUMENTED = {
    "python benchmarks/step_time.py --config configs/h100_bf16.py --config configs/h100_fp8.py "
    "--preset 1b --out benchmarks/results/step_time_1b.json": "step_time",
    "python benchmarks/compare.py --baseline configs/h100_bf16.py --candidate "
    "configs/h100_fp8.py --steps 200 --out benchmarks/results/compare_h100": "compare",
    "python benchmarks/compare.py --steps 60 --out benchmarks/results/compare": "compare",
    "python benchmarks/compare.py --steps 100 --round 10 --out benchmarks/results/compare":
        "compare",
    "python benchmarks/compare.py --baseline configs/h100_bf16.py --candidate "
    "configs/h100_fp8.py|optim.name=adamw --steps 200 --out DIR": "compare_overrides",
    "python benchmarks/peers.py --config configs/cpu_tiny.py --steps 30 --maxtext "
    "--out benchmarks/results/peers_cpu.json": "peers_maxtext",
    "python benchmarks/peers.py --config configs/cpu_tiny.py --steps 30 --out /tmp/peers.json":
        "peers",
    "python benchmarks/peers.py --config configs/cpu_tiny.py --steps 20 --round 5 --maxtext "
    "--out benchmarks/results/peers_cpu.json": "peers_maxtext",
    "python benchmarks/peers.py --config configs/cpu_tiny.py --steps 20 --round 5 --maxtext":
        "peers_maxtext",
    "python benchmarks/pipeline_table.py --config configs/cpu_tiny.py "
    "--out benchmarks/results/pipeline_cpu_tiny.json": "pipeline_table",
    "python benchmarks/pipeline_table.py --config ... --pipeline 2": "pipeline_table_flags",
    "python benchmarks/pipeline_table.py --config configs/cpu_tiny.py --pipeline 2 --repeats 3 "
    "--microbatches 2,4,8 --rows_per_microbatch 2 --out /tmp/pipeline.json":
        "pipeline_table_flags",
    "python benchmarks/remat_table.py --config configs/deepseek_7b.py": "remat_table",
    "python benchmarks/remat_table.py --config configs/deepseek_7b.py "
    "--out benchmarks/results/remat_deepseek_7b.json": "remat_table",
    "python benchmarks/remat_table.py --config configs/deepseek_7b.py --rows "
    "none/all,attention_core/all --baseline model.attention_impl=xla --baseline "
    "model.loss_chunk=0 --out benchmarks/results/remat_deepseek_7b_vs_unfused.json":
        "remat_table_baseline",
    "python benchmarks/remat_table.py --config configs/deepseek_v2_lite.py":
        "remat_table_moe",
    "python benchmarks/comm_bytes.py --config configs/cpu_tiny.py "
    "--config.optim.name=onebit_adam": "comm_bytes",
    "python benchmarks/comm_bytes.py --config configs/cpu_tiny.py --config.optim.name=onebit_adam "
    "--out benchmarks/results/comm_bytes_cpu_tiny.json": "comm_bytes",
    "python benchmarks/comm_bytes.py --config ...": "comm_bytes",
    "python benchmarks/comm_bytes.py --config configs/h100_fp8.py:smoke "
    "--out benchmarks/results/comm_bytes_h100_fp8_smoke.json": "comm_bytes_smoke",
    "python benchmarks/attention_table.py --out benchmarks/results/attention_table_cpu.json":
        "attention_table",
    "python benchmarks/precision_table.py --config configs/cpu_tiny.py --steps 150 --seeds 0,1 "
    "--out benchmarks/results/precision_cpu_tiny.json": "precision_table",
    "python benchmarks/context_table.py": "context_table",
    "python benchmarks/context_table.py --out benchmarks/results/context_table_7b_32k.json":
        "context_table",
    "python benchmarks/context_table.py --config configs/deepseek_7b.py:long --model":
        "context_table_model",
    "python benchmarks/context_table.py --config configs/deepseek_7b.py:long --model "
    "--out benchmarks/results/context_long_7b.json": "context_table_model",
    "python benchmarks/moe_table.py": "moe_table",
    "python benchmarks/moe_table.py --out benchmarks/results/moe_table_v2_lite.json": "moe_table",
    "python benchmarks/decode_speed.py --config configs/cpu_tiny.py --new_tokens 256 "
    "--out benchmarks/results/decode_speed_cpu.json": "decode_speed",
    "python benchmarks/fp8_hlo.py --config configs/h100_fp8.py:smoke": "fp8_hlo",
    "python benchmarks/plan_table.py --config configs/cpu_tiny.py --devices 8 --measure 12 "
    "--out benchmarks/results/plan_cpu_tiny.json": "plan_table",
    "python benchmarks/fp8_hlo.py --config configs/h100_fp8.py:smoke "
    "--out benchmarks/results/fp8_hlo_smoke.json": "fp8_hlo",
}


def documented_commands() -> set[str]:
    """`python benchmarks/X.py ...` in README.md, docs/*.md and each benchmark's module docstring,
    continuation lines joined, up to a closing backtick, a `#` comment or a `(` remark."""
    texts = []
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        with open(path, encoding="utf-8") as f:
            texts.append(ast.get_docstring(ast.parse(f.read())) or "")
    found = set()
    for text in texts:
        text = re.sub(r"\\\n\s*", " ", text)
        for m in re.finditer(r"python (benchmarks/\w+\.py)([^\n`#(]*)", text):
            found.add(" ".join(["python", m[1], *shlex.split(m[2])]))
    return found


def run_smoke(name: str, out) -> tuple[str, dict]:
    """Runs SMOKE[name] as a subprocess; asserts exit 0 and the promised keys; (stdout, JSON)."""
    script, args, written, keys, row_keys = SMOKE[name]
    cmd = [sys.executable, os.path.join("benchmarks", f"{script}.py"),
           *[a.replace("{out}", str(out)) for a in args]]
    env = child_env()  # each script sets its own device count
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    with open(os.path.join(out, written), encoding="utf-8") as f:
        result = json.load(f)
    assert keys <= set(result), keys - set(result)
    for row in result.get("rows", []) if row_keys else []:
        assert row_keys <= set(row), (row_keys - set(row), row)
    if LOAD_KEYS <= keys:
        assert len(result["load_before"]) == len(result["load_after"]) == 3
        assert result["cores"] == os.cpu_count()
        # The rule (test_load_record_marks_contention): other processes' share of the cores
        # where /proc/stat tells it, else the load average.
        share = result["others_cpu_share"]
        assert result["contended"] == (share > report.OTHERS_MAX if share is not None else max(
            result["load_before"][0], result["load_after"][0]) > result["cores"])
        assert ("not trustworthy" in proc.stdout) == result["contended"]
    return proc.stdout, result


# Pieces that benchmarks/gpu_mfu.sh runs itself: test_gpu_image dry-runs that script on the GPU
# image's packages, which runs each of these with the script's own arguments.
RUN_BY_GPU_MFU = {
    "python benchmarks/gpu_preflight.py --record OUT/gpu_mfu.json [--preset smoke]":
        "benchmarks/gpu_preflight.py --record",
    "python benchmarks/gpu_record.py mark RECORD PIECE STATUS RC LIMIT_S":
        "benchmarks/gpu_record.py mark",
}


def test_every_documented_command_has_a_smoke_run():
    documented = documented_commands()
    covered = set(DOCUMENTED) | set(RUN_BY_GPU_MFU)
    assert documented == covered, (
        f"documented but not smoke-tested: {sorted(documented - covered)}; "
        f"listed here but no longer documented: {sorted(covered - documented)}")
    with open(os.path.join(ROOT, "benchmarks", "gpu_mfu.sh"), encoding="utf-8") as f:
        script = f.read()
    for call in RUN_BY_GPU_MFU.values():
        assert call in script, f"gpu_mfu.sh no longer runs {call}: give it a smoke run here"
    assert set(DOCUMENTED.values()) == set(SMOKE)


@pytest.mark.parametrize("name", ["step_time", "compare_overrides", "pipeline_table",
                                  "pipeline_table_flags", "remat_table",
                                  "remat_table_baseline", "remat_table_moe", "comm_bytes",
                                  "comm_bytes_smoke", "fp8_hlo", "attention_table",
                                  "decode_speed", "moe_table", "context_table",
                                  "context_table_model"])
def test_documented_command(name, tmp_path):
    printed, result = run_smoke(name, tmp_path)
    if name == "context_table":
        # 256 tokens, blocks of 16, 2 devices: a query block ending at token p meets p // 16 + 1
        # key blocks. zigzag: device 0 holds chunks 0 and 3 (1..4 and 13..16: 10 + 58), device 1
        # chunks 1 and 2 (5..8 and 9..12: 26 + 42); contiguous: 1..8 = 36 against 9..16 = 100.
        ring = [r for r in result["rows"] if r["impl"] == "ring"][0]
        assert ring["blocks_zigzag"] == [68, 68]
        assert ring["blocks_contiguous"] == [36, 100]
    if name == "context_table_model":
        model = result["model"]
        assert model["mesh"] == {"data": 1, "tensor": 4, "pipeline": 1, "context": 2}
        assert model["context_bytes_per_step"] > 0 and model["fits"]
    if name == "moe_table":
        assert [r["impl"] for r in result["rows"]] == ["capacity", "ragged", "padded"]
        assert result["rows"][0]["temp_vs_capacity"] == 1
    if name == "decode_speed":
        cached, recompute = result["rows"]
        assert (cached["side"], recompute["side"]) == ("cached", "recompute")
        assert result["speedup"] == pytest.approx(recompute["seconds"] / cached["seconds"])
        assert "cached is" in printed
    if name == "step_time":
        assert [r["config"] for r in result["rows"]] == ["configs/h100_bf16.py",
                                                         "configs/h100_fp8.py"]
        assert result["rows"][0]["pid"] != result["rows"][1]["pid"]  # a process each
    elif name == "compare_overrides":
        cand = result["candidate"]
        assert cand["optim"] == "adamw" and cand["compute_dtype"] == "fp8"
        # 2.5 per device-hour x 8 devices, for a million tokens at the measured rate
        assert cand["cost_per_mtok"] == pytest.approx(2.5 * 8 / 3600 / cand["tokens_per_sec"]
                                                      * 1e6)
        assert result["baseline"]["cost_per_mtok"] is None  # no price: absent
    elif name == "pipeline_table":
        by_schedule = {r["schedule"]: r for r in result["rows"]}
        assert set(by_schedule) == {"gpipe", "circular", "1f1b", "interleaved_1f1b"}
        assert by_schedule["circular"]["repeats"] == 2  # 4 layers = 2 stages x 2 chunks
        assert by_schedule["interleaved_1f1b"]["repeats"] == 2
        # Neither 1F1B recomputes: a microbatch runs the FLOPs gpipe's does (measured 1.002 and
        # 1.013); a stage forward run twice adds about a third of the stage's work.
        for schedule in ("1f1b", "interleaved_1f1b"):
            assert abs(by_schedule[schedule]["flops_vs_gpipe"] - 1) < 0.02, by_schedule
            # the static count's extra: the head on every stage's every tick
            assert by_schedule[schedule]["flops_per_microbatch"] > by_schedule[schedule][
                "executed_flops_per_microbatch"] > 0
        assert all(r["temp_bytes"] > 0 for r in result["rows"])
    elif name == "pipeline_table_flags":
        by_schedule = {r["schedule"]: r for r in result["rows"]}
        assert "do not split" in by_schedule["circular"]["skipped"]
        assert "skipped: model.num_layers" in printed
        assert by_schedule["1f1b"]["temp_bytes"] > 0 and by_schedule["gpipe"]["global_batch"] == 4
    elif name == "remat_table":
        assert [(r["policy"], r["layers"]) for r in result["rows"]] == [
            ("none", "all"), ("full", "all")]
        assert result["rows"][1]["flops_ratio"] > 1  # full recompute redoes the forward
    elif name == "remat_table_baseline":
        assert result["baseline"] == ["model.attention_impl=xla", "model.loss_chunk=0"]
        (row,) = result["rows"]
        # S 256, vocab 512: the unfused step holds S x S logits and [S, V] float32 logits
        assert row["temp_bytes"] < row["baseline_temp_bytes"]
        assert row["temp_vs_baseline"] == row["temp_bytes"] / row["baseline_temp_bytes"]
        assert "baseline GiB" in printed
    elif name.startswith("comm_bytes"):
        assert 0 < result["compressed_bytes"] < result["exact_bytes"]
    elif name == "fp8_hlo":
        # h100_fp8:smoke runs 1f1b: each stage's forward once, its backward from the stashed
        # residuals. By hand: one scanned body of 7 fp8 projections x 3 GEMMs = 21, and 10
        # high-precision dots (the attention core's and the head's). A 1f1b that recomputes the
        # stage forward in its backward lists 28 fp8 dots.
        assert result["fp8_dots"] == result["expected_fp8_dots"] == 21, result
        assert (result["high_precision_dots"] == result["expected_high_precision_dots"]
                == 10), result
        # Every fp8 GEMM's shape is listed, and none of the smoke step's fp8 values is converted
        # up into an ordinary GEMM.
        assert sum(result["fp8_gemm_shapes"].values()) == 21
        assert all("xf8E" in k for k in result["fp8_gemm_shapes"])
        assert result["upcast_gemm_inputs"] == 0
    elif name == "attention_table":
        rows = {(r["attention"], r["impl"], r["seq_len"]): r for r in result["rows"]}
        assert {impl for _, impl, _ in rows} == {"xla", "flash"}  # CPU: cudnn/pallas need a GPU
        for kind in ("mha", "mla"):
            flash = rows[kind, "flash", 128]
            # float32: the blockwise softmax differs from xla by rounding only
            assert flash["max_abs_diff"] < 1e-4 and flash["grad_max_abs_diff"] < 1e-4, flash
            assert flash["temp_bytes"] < rows[kind, "xla", 128]["temp_bytes"]
            assert flash["ms"] > 0


def test_pipeline_table_reports_rows_that_do_not_split():
    """cpu_tiny's 6 layers: 2 stages x 2 chunks do not split (a row with the reason, nothing
    compiled); circular's default chunks per stage are 3, the smallest that splits them."""
    cfg = compare._load("configs/cpu_tiny.py")
    row = pipeline_table.measure(cfg, "circular", 4, 2)
    assert row == {"schedule": "circular", "microbatches": 4, "repeats": 2, "global_batch": 16,
                   "skipped": "model.num_layers: 6 layers do not split into mesh.pipeline x "
                              "pipeline.repeats = 2 x 2 equal chunks"}
    assert pipeline_table.interleaved_repeats(cfg, "circular", 4) == 3
    assert pipeline_table.interleaved_repeats(cfg, "interleaved_1f1b", 4) == 3
    assert pipeline_table.interleaved_repeats(
        compare._load("configs/cpu_tiny.py|model.num_layers=2"), "circular",
        4) == 2  # none splits: the row will say why


def test_load_record_marks_contention(monkeypatch):
    """Contended means other processes used the cores (from /proc/stat less this process's own CPU
    time); a high load average alone is this benchmark's own threads, or a job that just ended."""
    assert report.timing_start()["busy"] is not None  # Linux: /proc/stat is there
    # The counters set by hand (no timing): a window of 1000 s on 2 cores, in which the machine
    # ran `busy` CPU seconds and this process (with its children) `own` of them.
    counters = {}
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(report, "_busy_seconds", lambda: counters["busy"])
    monkeypatch.setattr(report, "_own_seconds", lambda: counters["own"])

    def window(busy, own, load=(5.0, 1.0, 1.0)):
        counters.update(busy=100.0, own=10.0)
        monkeypatch.setattr(os, "getloadavg", lambda: load)
        start = report.timing_start()
        start["wall"] -= 1000.0
        counters.update(busy=100.0 + busy, own=10.0 + own)
        return report.load_record(start)

    # This process alone, with a load far past the cores (its own threads): quiet.
    quiet = window(busy=1500.0, own=1500.0)
    assert quiet["load_after"] == [5.0, 1.0, 1.0] and quiet["cores"] == 2
    assert quiet["others_cpu_share"] == 0.0 and not quiet["contended"]
    # Others used 400 of the 2000 core-seconds: 20%, past OTHERS_MAX.
    other = window(busy=1500.0, own=1100.0)
    assert other["others_cpu_share"] == pytest.approx(0.2, abs=1e-3) and other["contended"]
    assert "others used 20% of them" in report.describe_load(other)
    # The load decides only where /proc/stat cannot: past the cores at either end.
    start = {**report.timing_start(), "busy": None, "load": [2.5, 1.0, 1.0]}
    assert report.load_record(start)["contended"]
    assert report.load_record(start)["others_cpu_share"] is None
    assert report.parse_overrides(["optim.name=adamw", "mesh.fsdp=true", "train.seed=3"]) == {
        "optim.name": "adamw", "mesh.fsdp": True, "train.seed": 3}
    with pytest.raises(ValueError, match="SECTION.FIELD=VALUE"):
        report.parse_overrides(["optim.name"])


def test_compare_smoke_configs(tmp_path):
    out = tmp_path / "compare"
    # The CPU default pair (h100_bf16:smoke vs h100_fp8:smoke); 2 timed steps each, in rounds
    # of one, after the warmup that compiles 1-bit Adam's compressed step too.
    printed, result = run_smoke("compare", out)
    for label in ("samples/s", "ms/step", "MFU", "GPU utilisation", "memory / device",
                  "communication share"):
        assert label in printed, label
    base, cand = result["baseline"], result["candidate"]
    assert base["config"] == "configs/h100_bf16.py:smoke"
    assert cand["compute_dtype"] == "fp8"
    for side in (base, cand):
        assert set(compare.FIGURES) <= set(side)
        assert side["samples_per_sec"] > 0 and side["step_ms"] > 0 and 0 < side["mfu"] < 1
        assert side["samples_per_sec"] == pytest.approx(8 / (side["step_ms"] / 1000))
        assert side["mem_bytes"] > 0 and side["mem_source"].startswith("compiled")
        # Data- and tensor-parallel steps on 8 devices: all-reduces were traced.
        assert 0 < side["comm_fraction"] < 1 and "all-reduce" in side["comm_kinds_us"]
        assert side["device_utilisation"] is None  # CPU: absent, not zero
        assert len(side["rounds_step_ms"]) == 2
        assert all(math.isfinite(h["loss"]) for h in side["history"])
        # Training happened. Both start at ~ln(512) = 6.24 (uniform over the padded vocabulary)
        # and fell by 1.76 (baseline) and 1.79 (candidate) nats over these 7 steps when
        # measured (lr 3e-3 after 5 warmup steps; the candidate's last 3 steps compressed).
        # 0.8 nats is under half of that, so other standard-library sources (the data) and float
        # reassociation stay clear of it; a side that does not train (lr 0, an update dropped)
        # or diverges (the H200 run's 64 nats) fails.
        losses = [h["loss"] for h in side["history"]]
        assert losses[-1] < losses[0] - 0.8, (side["config"], losses)
    # Both sides saw the same steps; warmup covers 1-bit Adam's switch (freeze_step = 4).
    assert [h["step"] for h in base["history"]] == [h["step"] for h in cand["history"]]
    assert result["warmup_steps"] == 5 and len(base["history"]) == 5 + 2
    assert set(result["change_pct"]) == set(compare.FIGURES)
    # CPU: no energy counter and no price set; absent (null), not zero.
    for key in ("joules_per_sample", "joules_per_token", "cost_per_mtok"):
        assert base[key] is None and cand[key] is None and "n/a" in printed, key
    for key, change in result["change_pct"].items():
        if base[key] is None:
            assert change is None, key
            continue
        assert change == pytest.approx(100 * (cand[key] - base[key]) / base[key]), key
    # Each side trained in a process of its own.
    assert base["pid"] != cand["pid"]
    # These two trained alike (final losses within 5%): a verdict, not "diverged".
    assert result["diverged"] is False and "DIVERGED" not in printed
    # The H200 run's fp8 + 1-bit candidate: loss 64 against 5.6, printed as "+1.1% samples/s".
    # With these sides' real figures and that candidate loss, the table says diverged instead.
    bad = {**result, "candidate": {**cand, "final_loss": 64.0},
           "baseline": {**base, "final_loss": 5.6}, "diverged": report.diverged(5.6, 64.0)}
    text = compare.table(bad)
    assert "DIVERGED" in text
    speed_rows = [line for line in text.splitlines()
                  if line[:26].strip() in ("samples/s", "ms/step", "tokens/s", "MFU")]
    assert len(speed_rows) == 4 and all(line.endswith("diverged") for line in speed_rows)
    assert "%" not in speed_rows[0].split()[-1]

    import matplotlib.image as mpimg  # pylint: disable=import-outside-toplevel
    for name in ("loss_vs_step.png", "loss_vs_time.png", "throughput.png"):
        path = out / name
        assert os.path.getsize(path) > 5_000, name
        image = mpimg.imread(path)
        # Curves, axes and labels, not a blank canvas.
        assert image.ndim == 3 and len(np.unique(image.reshape(-1, image.shape[-1]),
                                                 axis=0)) > 10, name
    assert os.path.isdir(out / base["profile"])


def test_compare_energy_counts_the_timed_rounds_only(monkeypatch):
    """compare's energy per sample: the NVML counter read around each timed round (a stand-in
    here: 10 J per step the devices ran), summed over the timed rounds, never the warmup; a
    reading that goes missing makes it absent, not a partial sum."""
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from dsjax import metrics as mx  # pylint: disable=import-outside-toplevel

    ran = [0]

    class Trainer:  # what Side uses of a trainer: a mesh's devices and step
        class mesh:  # pylint: disable=invalid-name
            devices = np.array(["gpu0", "gpu1"], dtype=object)

        def init(self):
            return 0

        def step(self, state, batch):
            ran[0] += 1
            return state + 1, {"loss": jnp.float32(1.0)}

    monkeypatch.setattr(mx, "energy_joules", lambda devices: 10.0 * ran[0])
    monkeypatch.setattr(mx, "device_utilisation", lambda device: None)
    side = compare.Side("baseline", "spec", None, Trainer(), [{}])
    side.run(3, timed=False)  # warmup: 30 J not counted
    side.run(2, timed=True)
    side.run(4, timed=True)
    assert side.joules == 60.0 and len(side.rounds) == 2
    monkeypatch.setattr(mx, "energy_joules", lambda devices: None)  # the counter goes away
    side.run(1, timed=True)
    assert side.joules is None


def test_compare_accepts_override_syntax():
    cfg = compare._load("configs/h100_fp8.py:smoke|optim.name=adamw|train.seed=3")
    assert cfg.optim.name == "adamw" and cfg.train.seed == 3
    assert compare.warmup_steps(cfg) == 1
    onebit = compare._load("configs/h100_fp8.py:smoke")
    assert compare.warmup_steps(onebit) == onebit.optim.freeze_step + 1


def test_peers_tiny(tmp_path):
    printed, result = run_smoke("peers", tmp_path)
    assert "transformers" in printed
    for key in ("dsjax_tokens_per_sec", "dsjax_mesh_tokens_per_sec",
                "transformers_tokens_per_sec"):
        assert result[key] > 0, key
    assert result["ratio"] == pytest.approx(result["dsjax_tokens_per_sec"] /
                                            result["transformers_tokens_per_sec"])
    assert result["model"]["hidden_size"] == 64 and result["model"]["num_kv_heads"] == 2
    assert result["mesh"] == {"data": 2, "tensor": 2, "pipeline": 2}
    # Both trained the same model from random init for 11 steps: below ln(512) = 6.2, and
    # finite (a diverged or NaN trainer fails).
    for loss in result["final_loss"].values():
        assert 0 < loss < 1.2 * math.log(512)
    history = result["loss_history"]
    assert set(history) == set(result["final_loss"]) and len(history) == 3
    for name, losses in history.items():
        assert len(losses) == 1 + 10 and losses[-1] == result["final_loss"][name]
        # Training happened: each fell from ~6.3 by 1.12 (dsjax) and 1.09 (transformers) nats
        # over these 11 steps when measured (cpu_tiny's lr 3e-3, warmup clamped to the run).
        # 0.5 nats is under half of that (margin for other data and float reassociation); a
        # trainer that does not train fails.
        assert losses[-1] < losses[0] - 0.5, (name, losses)
    dsjax_one, dsjax_mesh, torch_side = history.values()
    # The mesh changes only float rounding (measured equal to 3 decimals).
    assert dsjax_mesh == pytest.approx(dsjax_one, abs=1e-3)
    # The same recipe in both frameworks: final losses 0.02 nats apart when measured, from
    # different random initial weights; 0.15 nats catches one side training differently.
    assert abs(dsjax_one[-1] - torch_side[-1]) < 0.15


def test_maxtext_step_line_reads_step_seconds_and_loss():
    """The peer reads MaxText's metric_logger lines (format written out by hand from MaxText's
    log): the step, its seconds and `loss`, never `lm_loss` or another field."""
    import maxtext_peer  # pylint: disable=import-outside-toplevel
    line = ("I1205 10:00:00.000000 1 metric_logger.py:196] completed step: 7, seconds: 0.012, "
            "TFLOP/s/device: 0.5, Tokens/s/device: 1234.5, total_weights: 2048, loss: 5.431, "
            "lm_loss: 9.999, perplexity: 228.4")
    hit = maxtext_peer.STEP_LINE.search(line)
    assert (int(hit[1]), float(hit[2]), float(hit[3])) == (7, 0.012, 5.431)
    nan = maxtext_peer.STEP_LINE.search("completed step: 3, seconds: 1.5, loss: nan")
    assert nan[1] == "3" and float(nan[2]) == 1.5 and float(nan[3]) != float(nan[3])
    assert maxtext_peer.STEP_LINE.search("completed step: 3, seconds: 1.5, lm_loss: 2.0") is None


# Opt-in: it installs MaxText from the package registry into its own venv (minutes, and a
# third-party download inside CI). Its line parser is tested above on every run.
@pytest.mark.skipif(os.environ.get("DSJAX_PEERS_MAXTEXT") != "1",
                    reason="MaxText peer run is opt-in: DSJAX_PEERS_MAXTEXT=1 make test")
def test_peers_maxtext_tiny(tmp_path):
    """MaxText's own trainer beside dsjax's (benchmarks/maxtext_peer.py): installed into its venv
    on first use (minutes, once per machine), then trained on the same shapes."""
    printed, result = run_smoke("peers_maxtext", tmp_path)
    assert "x MaxText's tokens/s" in printed
    assert result["maxtext_tokens_per_sec"] > 0
    assert result["ratio_maxtext"] == pytest.approx(result["dsjax_tokens_per_sec"] /
                                                    result["maxtext_tokens_per_sec"])
    assert result["versions"]["maxtext"] == "0.2.5"
    history = result["loss_history"]
    assert len(history) == 4 and set(result["startup_s"]) == set(history)
    # 1 + 10 counted steps, as the others'. MaxText starts from its own random init on its own
    # synthetic tokens; with cpu_tiny's lr (3e-3) passed through, its loss falls by several nats
    # in these steps (MaxText's default 3e-5 moved it 0.4 in 12): a MaxText that does not get
    # our optimizer settings, or does not train, fails.
    losses = history["maxtext"]
    assert len(losses) == 11 and losses[-1] == result["final_loss"]["maxtext"]
    assert losses[-1] < losses[0] - 1.0, losses


def test_diverged_is_5_percent_above_the_baseline_loss():
    assert not report.diverged(5.6, 5.6 * 1.049)
    assert report.diverged(5.6, 5.6 * 1.051)
    assert not report.diverged(5.6, 3.0)  # lower loss: a verdict stands
    assert report.diverged(5.6, float("nan")) and report.diverged(5.6, float("inf"))


def test_fp8_hlo_finds_an_fp8_value_upcast_into_a_bf16_gemm():
    """fp8 storage feeding a bf16 GEMM (a silent upcast) is counted; a real fp8 GEMM is not."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import fp8_hlo  # pylint: disable=import-outside-toplevel

    f8 = jnp.float8_e4m3fn
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    upcast = jax.jit(lambda x, w: jnp.dot(x.astype(f8).astype(jnp.bfloat16),
                                          w.astype(jnp.bfloat16))).lower(x, w).as_text()
    real = jax.jit(lambda x, w: jax.lax.dot(x.astype(f8), w.astype(f8),
                                            preferred_element_type=jnp.float32)
                   ).lower(x, w).as_text()
    assert fp8_hlo.upcast_gemm_inputs(upcast) == 1 and fp8_hlo.fp8_gemm_shapes(upcast) == {}
    assert fp8_hlo.upcast_gemm_inputs(real) == 0
    assert fp8_hlo.fp8_gemm_shapes(real) == {"4x8xf8E4M3FN x 8x3xf8E4M3FN -> 4x3xf32": 1}


def test_fp8_hlo_reads_cublas_fp8_output_shapes():
    """The GPU-only count, on optimised-HLO lines written out by hand (the shape of XLA's
    custom calls): only the fp8 target counts, by its output's shape."""
    from dsjax.metrics import gemms  # pylint: disable=import-outside-toplevel

    call = ('  %custom-call.{i} = ({out}{{1,0}}, s8[33554432]{{0}}) custom-call(%a, %b, %c, %c, '
            '%c, %c), custom_call_target="{target}", backend_config={{"alpha_real":1}}\n')
    hlo = (call.format(i=1, out="bf16[256,1024]", target="__cublas$lt$matmul$f8")
           + call.format(i=2, out="bf16[256,512]", target="__cublas$lt$matmul$f8")
           + call.format(i=3, out="bf16[256,512]", target="__cublas$lt$matmul$f8")
           + call.format(i=4, out="f32[256,512]", target="__cublas$lt$matmul"))
    assert gemms.cublas_fp8_output_shapes(hlo) == {"bf16[256,1024]": 1, "bf16[256,512]": 2}


def test_fp8_hlo_expects_counts_for_every_impl():
    """fp8_hlo knows every concrete attention impl; on a GPU `auto` resolves to cudnn, whose core
    is one cuDNN custom call: the h100_fp8:smoke step's 21 fp8 dots stay, and its 10
    high-precision dots lose the xla core's 6 (the 4 left are the chunked head's)."""
    import fp8_hlo  # pylint: disable=import-outside-toplevel
    from dsjax.config import load  # pylint: disable=import-outside-toplevel
    from dsjax.config.validate import ATTENTION_IMPLS  # pylint: disable=import-outside-toplevel
    from dsjax.model.build import make_model  # pylint: disable=import-outside-toplevel

    assert set(fp8_hlo.ATTENTION_CORE_DOTS) == set(ATTENTION_IMPLS) - {"auto"}
    cfg = load(os.path.join(ROOT, "configs", "h100_fp8.py:smoke"))
    model = make_model(cfg)

    class Resolved:  # the model with its attention impl resolved as on a GPU
        def __init__(self, impl):
            self.impl = impl

        def attention_impl(self, seq_len):
            del seq_len
            return self.impl

        def __getattr__(self, name):
            return getattr(model, name)

    counts = {impl: fp8_hlo.expected_counts(types.SimpleNamespace(cfg=cfg, model=Resolved(impl)))
              for impl in ("xla", "flash", "cudnn", "pallas")}
    assert counts["xla"] == (21, 10)  # what test_documented_command counts in the program
    assert counts["flash"] == (21, 11)
    assert counts["cudnn"] == counts["pallas"] == (21, 4)
