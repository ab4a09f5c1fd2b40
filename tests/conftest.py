"""Test setup: 8 simulated CPU devices, configured before the first `import jax`."""

import atexit
import os
import shutil
import tempfile

# One XLA compilation cache for the session. The xdist workers and the training processes the
# tests launch inherit it (they are started after this runs in the controller), so a program
# that several tests or a run and its resume compile is compiled once and then read from disk:
# a cpu_moe trainer's init + first step take 31 s compiled, 5 s loaded. A fresh folder each
# session, so no result depends on an earlier session's files; the process that made it
# removes it. JAX_COMPILATION_CACHE_DIR set by the caller is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsjax-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# One stdlib corpus for the session, in the same way: every launched run that reads the stdlib
# corpus and names no data.path of its own reads this one (`launch_flags`) instead of building
# its own 12 MB copy in its workdir, as about 30 launches once did.
if "DSJAX_TEST_DATA_DIR" not in os.environ:
    os.environ["DSJAX_TEST_DATA_DIR"] = tempfile.mkdtemp(prefix="dsjax-test-data-")
    atexit.register(shutil.rmtree, os.environ["DSJAX_TEST_DATA_DIR"], True)

# The cheapest XLA:CPU code generation: most of a test's time is compiling small programs that
# then run a few times. LLVM at its lowest level, and XLA's older elemental emitters for fusions
# in place of the MLIR fusion emitters. The HLO the tests read (collectives, buffer sizes, dtypes)
# and IEEE float semantics stay; the order of a sum inside a fused kernel may not, so results may
# differ from the default build in the last bit, which every tolerance here covers as it covers
# another CPU. Two programs that compute the same thing in different fusions agree bit for bit
# under the default emitters but not always under these: the tests that compare such programs
# bit for bit run them with XLA's defaults (`in_default_xla`). Measured on 2 cores: the
# optimisation level took test_pipeline's schedule tests from 178 s to 141 s; the emitters took
# a cpu_moe fp8 1-bit Adam step's compile from 21.4 s to 15.8 s.
# Processes the tests start get it too (child_env); launch.py adds its own device count.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false")
if os.environ.get("DSJAX_TEST_XLA_DEFAULTS") == "1":  # a process `in_default_xla` started
    TEST_XLA_FLAGS = ""
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS,
                                    "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="session")
def _from_the_repository_root():
    """Tests name configs, benchmarks and data as a user at the repository root does
    ("configs/cpu_tiny.py"); this makes those paths hold from any working directory (e.g.
    `cd tests && pytest test_config.py`)."""
    before = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(before)


def pytest_collection_modifyitems(config, items):
    """Marks `slow` the tests tests/slow.txt lists: measured, see tests/slow.py."""
    import slow
    listed = slow.read()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)


def random_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int = 257,
                 docs_per_row: int = 2) -> dict[str, np.ndarray]:
    """A host batch shaped like the data pipeline's: packed documents with segment ids."""
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    seg = np.ones((batch, seq + 1), np.int32)
    for r in range(batch):
        for cut in sorted(rng.choice(np.arange(1, seq), docs_per_row - 1, replace=False)):
            seg[r, cut:] += 1
    positions = np.zeros((batch, seq), np.int32)
    for r in range(batch):
        for s in range(1, seq):
            positions[r, s] = 0 if seg[r, s] != seg[r, s - 1] else positions[r, s - 1] + 1
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg[:, :-1],
            "positions": positions, "weights": (seg[:, :-1] == seg[:, 1:]).astype(np.float32)}


jax.config.update("jax_default_matmul_precision", "highest")


# A model small enough that a compile + a few steps take seconds on 2 cores.
TINY_MODEL = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
              "model.num_kv_heads": 2, "model.mlp_dim": 128, "model.vocab_size": 512}


def tiny(*changes: dict) -> dict:
    """TINY_MODEL's config overrides with each of `changes` on top, in order: what a test file's
    own tiny shape differs in, written once."""
    out = dict(TINY_MODEL)
    for change in changes:
        out.update(change)
    return out


# What launched runs of the tiny model train: a few steps, logged, checkpointed, sampled.
TINY_FLAGS = tiny({
    "data.seq_len": 32, "data.global_batch": 8, "data.eval_batches": 2,
    "train.steps": 4, "train.log_every": 1, "train.sample_tokens": 4,
    "optim.warmup_steps": 1, "checkpoint.every": 2,
})


@pytest.fixture
def tiny_overrides():
    """TINY_FLAGS, a copy each test may change."""
    return dict(TINY_FLAGS)


# cpu_tiny's mesh is (2, 2, 2) with a 1f1b pipeline. Tests of features that do not compose with
# pipelining (fsdp) or that count per-replica rows pin the unpipelined 8-device mesh instead.
FLAT_MESH = {"mesh.data": 4, "mesh.tensor": 2, "mesh.pipeline": 1}


def file_digests(root):
    """{path relative to `root`: sha256} of every file under it (what must stay byte-identical)."""
    import hashlib
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def read_records(workdir):
    """The run's metrics.jsonl, one dict per line."""
    import json
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def load_safetensors_dir(directory):
    """Every tensor of every .safetensors file in `directory` (torch tensors, by name)."""
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def once_per_session(name, build):
    """DSJAX_TEST_DATA_DIR/NAME, made by `build(path)` once per test session: the first process
    to ask (either xdist worker, or a process a test started) builds it while a file lock makes
    the others wait; later ones find it. A build that raises is not marked done: the next
    process to ask starts it again from nothing. Tests only read what is there; one that
    changes it copies it."""
    import fcntl
    path = os.path.join(os.environ["DSJAX_TEST_DATA_DIR"], name)
    done = path + ".done"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            shutil.rmtree(path, ignore_errors=True)  # a failed attempt's leftovers
            build(path)
            open(done, "w").close()  # written last: the build is complete
    return path


def session_stdlib_corpus():
    """The session's stdlib corpus directory."""
    from dsjax.data import build_stdlib_corpus
    return once_per_session("stdlib", build_stdlib_corpus)


def _config_source(config):
    """data.source of `config` ("configs/NAME.py[:ARG]") as its get_config sets it."""
    import importlib.util
    path, _, arg = config.partition(":")
    spec = importlib.util.spec_from_file_location("_test_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg or None).data.source


def launch_flags(config, overrides):
    """TINY_FLAGS under `overrides`; a run of the stdlib corpus that names no data.path of its
    own reads the session's corpus."""
    flags = {**TINY_FLAGS, **(overrides or {})}
    if "data.path" not in flags and flags.get("data.source", _config_source(config)) == "stdlib":
        flags["data.path"] = session_stdlib_corpus()
    return flags


def child_env() -> dict:
    """The environment for a process a test starts: this one's, with XLA_FLAGS holding only the
    compile-speed flags (no device count: launch.py and the benchmarks set their own)."""
    return {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}


def shared_run(name, overrides=None, config="configs/cpu_tiny.py", timeout=900):
    """A finished `launch.py` run that several tests (in one file or several, on either xdist
    worker) compare against, trained once per test session (`once_per_session`): (its workdir,
    its stdout). One name is one run: asking for it with other flags fails."""
    import json
    made_by = {"config": config, "flags": launch_flags(config, overrides)}

    def train(path):  # path/run: the run directory; path/launch.json: how it was made
        proc = run_launch(os.path.join(path, "run"), overrides, config=config, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(os.path.join(path, "launch.json"), "w", encoding="utf-8") as f:
            json.dump({**made_by, "stdout": proc.stdout}, f)

    path = once_per_session(os.path.join("runs", name), train)
    with open(os.path.join(path, "launch.json"), encoding="utf-8") as f:
        record = json.load(f)
    assert {k: record[k] for k in made_by} == json.loads(json.dumps(made_by)), (
        f"shared run {name!r} was made with other flags")
    return os.path.join(path, "run"), record["stdout"]


def in_default_xla(module, function, *args, timeout=600):
    """Calls tests/MODULE.py's `function(*args)` in a process of its own that compiles with
    XLA's default code generation instead of TEST_XLA_FLAGS: for a test that compares two
    differently fused programs bit for bit, which the default emitters hold to and the suite's
    cheaper ones do not. An exception there fails the calling test with its traceback."""
    import subprocess
    import sys
    env = {**os.environ, "DSJAX_TEST_XLA_DEFAULTS": "1", "XLA_FLAGS": ""}
    code = f"import {module}; {module}.{function}(*{args!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(ROOT, "tests"), env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run_launch(workdir, overrides=None, mode="train", config="configs/cpu_tiny.py", timeout=600,
               xla_flags=None, args=()):
    """Runs `python launch.py` as a user would (with `args` after the config flags); returns the
    CompletedProcess. Without `xla_flags` launch.py gives itself as many simulated CPU devices as
    the mesh needs."""
    import subprocess
    import sys
    flags = launch_flags(config, overrides)
    cmd = [sys.executable, os.path.join(ROOT, "launch.py"), f"--config={config}",
           f"--workdir={workdir}", f"--mode={mode}"]
    cmd += [f"--config.{k}={v}" for k, v in flags.items()] + list(args)
    env = child_env()
    if xla_flags:
        env["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {xla_flags}"
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
