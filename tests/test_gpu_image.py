"""benchmarks/gpu_mfu.sh against the GPU machine's software (../shared/gpu_image_packages.txt):
its import path imports nothing the image lacks, its limits fit the device time, and its smoke
dry run, in a virtual environment with exactly the image's packages (CPU builds) plus the carried
wheels, fills every row, fails loudly and returns at most 4 files."""

import fcntl
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

PACKAGE_LIST = os.path.join(os.path.dirname(ROOT), "shared", "gpu_image_packages.txt")
CARRIED = ("ml-collections",)  # carried as wheels (the script's header, the README)
# What the GPU script's import path needs from the image, pinned where the image's list pins.
NEEDED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "absl-py",
          "rich", "pillow", "scikit-learn", "scikit-image", "safetensors", "tokenizers",
          "nvidia-ml-py", "jinja2",  # jinja2: chat templates (dsjax.data, imported by train)
          "matplotlib")  # fp8.select=auto's heat map (dsjax.precision, imported by train)
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_mfu.sh")
MAX_FILES = 4  # the device machine returns few files: gpu_mfu.json, gpu_mfu.log and two more
MAX_LIMITS_S = 420  # the device time of a session, less the machine's start
PIECES = ("preflight", "model_bfloat16_2", "model_bfloat16_6", "model_fp8_2", "model_fp8_6",
          "attention", "ceilings", "fp8_census", "summary")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> dict[str, str | None]:
    """{normalized name: pinned version or None} of the GPU image's list."""
    out = {}
    with open(PACKAGE_LIST, encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, _, version = line.partition("==")
                out[_norm(name)] = version or None
    return out


def test_limits_fit_the_device_time():
    """Every piece's limit, read from the script: the sum fits a session, the preflight 15 s."""
    with open(SCRIPT, encoding="utf-8") as f:
        text = f.read()
    limits = dict(re.findall(r"^(?:if ! )?(?:piece|run) (\w+) (\d+) ", text, re.M))
    assert tuple(limits) == PIECES, limits
    assert int(limits["preflight"]) <= 15
    assert sum(map(int, limits.values())) <= MAX_LIMITS_S, limits


# Run in a child: every module the GPU script imports at module level, with a finder that
# refuses any third-party top-level module whose distribution is neither on the image nor
# carried (the standard library and this repository pass).
_BLOCKED_IMPORTS = textwrap.dedent("""
    import importlib.machinery, importlib.metadata, re, sys
    allowed = set(sys.argv[1].split(","))
    owners = importlib.metadata.packages_distributions()
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
    blocked = []

    class Blocker:  # third party: found in site-packages (the stdlib and this repo are not)
        def find_spec(self, name, path=None, target=None):
            if path is not None:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name)
            where = (spec and (spec.origin or str(list(spec.submodule_search_locations or []))))
            if not where or "-packages" not in where:
                return None
            dists = {norm(d) for d in owners.get(name, [])}
            if not dists & allowed:
                blocked.append(f"{name} ({', '.join(sorted(dists)) or 'no distribution'})")
                raise ImportError(f"{name} is not on the GPU image")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path[:0] = ["benchmarks", "."]
    import dsjax.train, dsjax.metrics, dsjax.batching, dsjax.model.attention
    import gpu_mfu, gpu_preflight, gpu_record, gpu_summary, fp8_hlo, step_time
    print("imported; blocked:", blocked)
""")


def test_gpu_import_path_needs_nothing_the_image_lacks():
    allowed = set(image_packages()) | {_norm(c) for c in CARRIED}
    proc = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORTS, ",".join(sorted(allowed))],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("blocked: []"), proc.stdout


def test_the_blocker_can_fail():
    """The finder refuses what is off the list: pillow taken off it, importing PIL fails."""
    allowed = set(image_packages()) - {"pillow"}
    proc = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORTS.replace(
        "import dsjax.train,", "import PIL, dsjax.train,"), ",".join(sorted(allowed))],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "PIL is not on the GPU image" in proc.stderr, proc.stderr


def _python312() -> str:
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))
    assert found, "the GPU image runs Python 3.12: install one with pyenv"
    return found[-1]


def gpu_image_env() -> tuple[str, str]:
    """(python, wheel folder) of a virtual environment with the image's packages this path needs
    (CPU builds, the image's pins) and the carried wheels; built once per machine, in a cache
    keyed by the package list and NEEDED."""
    packages = image_packages()
    missing = [n for n in NEEDED if _norm(n) not in packages]
    assert not missing, f"not on the GPU image: {missing}"
    reqs = [f"{n}=={packages[_norm(n)]}" if packages[_norm(n)] else n for n in NEEDED]
    with open(PACKAGE_LIST, "rb") as f:
        key = hashlib.sha256(f.read() + repr((reqs, CARRIED)).encode()).hexdigest()[:16]
    root = os.path.expanduser(os.path.join("~", ".cache", "dsjax", "gpu_image_venv"))
    home = os.path.join(root, key)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f"{key}.lock"), "w", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine, however many tests wait
        if not os.path.exists(os.path.join(home, "ready")):
            subprocess.run(["rm", "-rf", home], check=True)
            subprocess.run([_python312(), "-m", "venv", home], check=True)
            py = os.path.join(home, "bin", "python")
            pip = [py, "-m", "pip", "install", "-q", "--only-binary=:all:"]
            subprocess.run(pip + reqs, check=True, timeout=600)
            subprocess.run([py, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", os.path.join(home, "wheels"), *CARRIED], check=True, timeout=300)
            with open(os.path.join(home, "ready"), "w", encoding="utf-8") as f:
                f.write(" ".join(reqs))
    return os.path.join(home, "bin", "python"), os.path.join(home, "wheels")


def _dry_run(out, python: str, wheels: str):
    env = {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")},
           "GPU_MFU_PRESET": "smoke", "OUT": str(out), "PYTHON": python, "GPU_WHEELS": wheels,
           # One compilation cache for the session's dry runs: the second reads what the first
           # compiled (the script's own cache, as on the GPU, where the 6-layer rows reuse it).
           "GPU_MFU_CACHE": os.path.join(os.environ["DSJAX_TEST_DATA_DIR"], "gpu_mfu_cache")}
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    with open(out / "gpu_mfu.json", encoding="utf-8") as f:
        return proc, json.load(f)


def test_dry_run_on_the_gpu_image_fills_every_row(tmp_path):
    """The smoke preset on CPU in the image's environment: exit 0, every piece ok, the rows and
    the extrapolation right by hand, the MaxText settings recorded, at most 4 files."""
    python, wheels = gpu_image_env()
    proc, result = _dry_run(tmp_path / "out", python, wheels)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(os.listdir(tmp_path / "out")) <= MAX_FILES
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu_mfu.json", "gpu_mfu.log"]
    assert proc.stdout.strip().splitlines()[-1] == (
        "gpu_mfu pieces: " + ", ".join(f"{p} ok" for p in PIECES))
    rows = result["rows"]
    assert list(rows) == list(PIECES)
    assert all(r["status"] == "ok" and r["device_kind"] == "cpu" for r in rows.values()), rows
    pre = rows["preflight"]
    assert pre["jax"] == pre["jaxlib"] == image_packages()["jax"] == result["jax"]
    assert "skipped" in pre["nvidia_smi"] and pre["seconds"] < 15
    flags = result["xla_flags"]
    assert all(f in flags for f in ("--xla_gpu_enable_command_buffer= ",
                                    "--xla_gpu_enable_triton_gemm=false",
                                    "--xla_disable_hlo_passes=rematerialization"))
    assert "latency_hiding" not in flags  # no overlap profile on one GPU
    model = {(r["dtype"], r["layers"]): r for r in rows.values() if r.get("piece") == "model"}
    assert set(model) == {(d, n) for d in ("bfloat16", "fp8") for n in (2, 6)}
    for r in model.values():
        assert r["batch"] == 4 and r["batch_fit"]["tried"][0]["predicted_bytes"] > 0
        assert r["step_ms"] > 0 and r["last_loss"] < r["first_loss"] and not r["scan_layers"]
        assert r["joules_per_token"] is None  # CPU: no energy counter, absent, not zero
    assert "mfu_bf16_equivalent" in model["fp8", 2] and "mfu" not in model["fp8", 2]
    # The extrapolation by hand (equal batches): 4 layers apart, then 30 layers.
    lo, hi = model["bfloat16", 2], model["bfloat16", 6]
    full = result["full_depth"]["bfloat16"]
    per_layer = (hi["step_ms"] - lo["step_ms"]) / 4
    assert full["extrapolated_to_layers"] == 30 and full["per_layer_ms"] == pytest.approx(per_layer)
    assert full["step_ms"] == pytest.approx(lo["step_ms"] + 28 * per_layer)
    fp8 = result["full_depth"]["fp8"]
    assert result["fp8_speedup_end_to_end"] == pytest.approx(full["step_ms"] / fp8["step_ms"])
    assert result["fp8_speedup_per_layer"] == pytest.approx(per_layer / fp8["per_layer_ms"])
    assert result["fp8_over_bf16_gemm_ceiling"] == pytest.approx(
        rows["ceilings"]["fp8_gemm_flops"] / rows["ceilings"]["bf16_gemm_flops"])
    assert abs(result["fp8_loss_gap"]) < 0.02  # same seed and batches; fp8 emulated on CPU
    impls = {(r["impl"], r["packed"]): r for r in rows["attention"]["rows"]}
    assert set(impls) == {(i, p) for i in ("xla", "flash") for p in (False, True)}  # CPU
    assert all(r["max_abs_diff_vs_xla"] < 1e-4 for r in impls.values())
    assert rows["fp8_census"]["fp8_dots"] == rows["fp8_census"]["expected_fp8_dots"] == 21


def test_dry_run_with_a_broken_piece_fails_loudly(tmp_path):
    """The ceilings piece broken on purpose (a PYTHON that fails for it): exit 1, that piece
    marked failed in the record and on the last line, every other row still written."""
    python, wheels = gpu_image_env()
    broken = tmp_path / "python"
    broken.write_text(f'#!/bin/bash\n[[ "$*" == *"gpu_mfu.py ceilings"* ]] && '
                      f'{{ echo "broken on purpose" >&2; exit 3; }}\nexec {python} "$@"\n')
    broken.chmod(0o755)
    proc, result = _dry_run(tmp_path / "out", str(broken), wheels)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "ceilings failed" in proc.stdout.strip().splitlines()[-1]
    status = {name: row["status"] for name, row in result["rows"].items()}
    assert status == {p: "failed" if p == "ceilings" else "ok" for p in PIECES}, status
    assert result["rows"]["ceilings"]["exit_code"] == 3
    assert result["fp8_over_bf16_gemm_ceiling"] is None
    assert result["fp8_speedup_end_to_end"] is not None  # the model rows were still measured
    assert "broken on purpose" in (tmp_path / "out" / "gpu_mfu.log").read_text()
