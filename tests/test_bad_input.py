"""Bad input, table-driven, through real `launch.py` processes: each case must end with exit code
2, one `dsjax: error:` line naming the field, flag or file, no traceback, and the checkpoint that
was already in the run directory byte-for-byte unchanged. "Unchanged" means something only for a
case that fails inside the run, with the checkpoint in reach (`REACH_RUN`; checked from its
output): the others must fail before the run starts and write nothing into the run directory."""

import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, TINY_FLAGS, child_env, run_launch
from dsjax.data import ShardWriter, prepare_text

BASE = {"metrics.profile_every": 0, "train.sample_tokens": 0, "metrics.tensorboard": False,
        "mesh.data": 4, "mesh.tensor": 2, "mesh.pipeline": 1}


class _WideTokenizer:
    """A tokenizer whose vocabulary (70,000) does not fit the tiny model's 512 embeddings."""
    name = "wide-test"
    vocab_size = 70_000
    eos_id = 69_999
    is_byte = False

    def encode(self, text):
        return np.array([1000 + ord(c) for c in text], np.int32)


def _write_text(path, rng):
    words = ["def", "return", "self", "import", "class", "value", "(", ")", ":", "\n"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(20, 80)))) for _ in range(120)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(docs))


def _damage_prepared(data_dir, how):
    split = os.path.join(data_dir, "train")
    meta = json.load(open(os.path.join(split, "meta.json"), encoding="utf-8"))
    tokens = os.path.join(split, meta["shards"][0]["tokens"])
    if how == "empty":
        open(tokens, "wb").close()
    elif how == "beyond_vocab":
        arr = np.load(tokens)
        arr[5] = 300  # the byte tokenizer has 257 ids
        np.save(tokens, arr)
    return tokens


def _tree_digest(directory):
    h = hashlib.sha256()
    for root, _, names in sorted(os.walk(directory)):
        for n in sorted(names):
            path = os.path.join(root, n)
            h.update(os.path.relpath(path, directory).encode())
            h.update(open(path, "rb").read())
    return h.hexdigest()


# (id, overrides, extra launch.py args, expected text of the one error line)
CASES = [
    ("mesh_vs_devices", {"mesh.data": 2}, ["XLA8"],
     "mesh: data*tensor*pipeline*context = 2*2*1*1 = 4 must equal the device count 8"),
    ("heads_vs_hidden", {"model.num_heads": 3, "model.num_kv_heads": 3}, [], "model.num_heads:"),
    ("kv_heads_vs_heads", {"model.num_kv_heads": 3}, [], "model.num_kv_heads:"),
    ("mlp_vs_tensor", {"model.mlp_dim": 127}, [], "model.mlp_dim:"),
    ("vocab_vs_tensor", {"model.vocab_size": 511}, [], "model.vocab_size:"),
    ("batch_vs_data", {"data.global_batch": 6}, [], "data.global_batch:"),
    ("zero_layers", {"model.num_layers": 0}, [], "model.num_layers: must be > 0, got 0"),
    ("negative_seq_len", {"data.seq_len": -4}, [], "data.seq_len: must be > 0, got -4"),
    ("unknown_key", {}, ["--config.model.hidden=64"], "model.hidden: unknown config key"),
    ("unknown_section", {}, ["--config.trian.steps=3"], "trian.steps: unknown config key"),
    ("unknown_remat_policy", {"remat.policy": "sometimes"}, [], "remat.policy:"),
    ("unknown_nonfinite_policy", {"train.nonfinite": "ignore"}, [], "train.nonfinite:"),
    ("unknown_optimizer", {"optim.name": "sgd"}, [], "optim.name: unknown optimizer 'sgd'"),
    ("unknown_dtype", {"train.compute_dtype": "int8"}, [], "train.compute_dtype:"),
    ("adam_beta_out_of_range", {"optim.b1": 1.5}, [], "optim.b1: must be in [0, 1)"),
    ("fp8_keeps_too_many_layers", {"fp8.keep_first_layers": 2, "fp8.keep_last_layers": 1}, [],
     "fp8.keep_first_layers:"),
    ("onebit_with_fsdp", {"optim.name": "onebit_adam", "mesh.fsdp": True,
                          "optim.freeze_step": 1}, [], "mesh.fsdp:"),
    ("missing_config_file", {}, ["--config=configs/no_such.py"],
     "--config: no such config file 'configs/no_such.py'"),
    ("bad_max_runtime", {}, ["--max_runtime=soon"], "--max_runtime: cannot read 'soon'"),
    ("recipe_in_eval_mode", {"posttrain.recipe": "pretrain,sft,dpo"}, ["--mode=eval"],
     "posttrain.recipe: --mode eval evaluates one run"),
    ("init_from_missing", {"checkpoint.init_from": "/nonexistent/dsjax"}, [],
     "checkpoint.init_from: '/nonexistent/dsjax' is not a directory"),
    ("data_path_missing", {"data.source": "prepared", "data.path": "/nonexistent/dsjax"}, [],
     "data.path: /nonexistent/dsjax/train is not a prepared split"),
    ("empty_data_file", {"data.source": "prepared", "data.path": "PREPARED:empty"}, [],
     "SHARD: cannot read shard"),
    ("token_ids_beyond_vocab", {"data.source": "prepared", "data.path": "PREPARED:beyond_vocab"},
     [], "SHARD: token id 300 at offset 5 is >= vocab_size 257"),
    ("tokenizer_vs_model", {"data.source": "prepared", "data.path": "PREPARED:wide"}, [],
     "model.vocab_size: 512 is smaller than the data's tokenizer vocabulary 70000"),
    ("checkpoint_of_another_model", {"model.mlp_dim": 256}, [],
     "model.mlp_dim: checkpoint has 128, config has 256"),
    ("checkpoint_of_other_data", {"data.source": "prepared", "data.path": "PREPARED:good"}, [],
     "was trained on other data (data.source was 'stdlib', now 'prepared'; data.path was "),
    ("workdir_not_writable", {}, ["WORKDIR_UNDER_FILE"], "--workdir"),
    ("disk_full_during_save", {"train.steps": 4}, ["FSIZE"],
     "could not write checkpoint step 4 to"),
]


# The cases that fail inside `train.run`, after the model was built (its "dsjax: config ..." line),
# where the data is read and the checkpoint restored or saved.
REACH_RUN = {"data_path_missing", "empty_data_file", "token_ids_beyond_vocab", "tokenizer_vs_model",
             "checkpoint_of_another_model", "checkpoint_of_other_data", "disk_full_during_save"}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Runs every case (3 at a time) against a copy of a run directory that has a checkpoint."""
    root = tmp_path_factory.mktemp("bad_input")
    seeded = str(root / "seeded")
    corpus = str(root / "corpus")  # shared stdlib cache: case workdirs hold only checkpoints
    proc = run_launch(seeded, {**BASE, "train.steps": 2, "checkpoint.every": 0,
                               "data.path": corpus}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rng = np.random.default_rng(0)
    text = str(root / "docs.txt")
    _write_text(text, rng)
    prepared = {"good": str(root / "prepared_good")}
    prepare_text(text, "text", "byte", prepared["good"], eval_fraction=0.2,
                 split_on_blank_lines=True)
    for how in ("empty", "beyond_vocab"):
        prepared[how] = str(root / f"prepared_{how}")
        prepare_text(text, "text", "byte", prepared[how], eval_fraction=0.2,
                split_on_blank_lines=True)
        prepared[how + "_shard"] = _damage_prepared(prepared[how], how)
    prepared["wide"] = str(root / "prepared_wide")
    for split in ("train", "eval"):
        writer = ShardWriter(os.path.join(prepared["wide"], split), _WideTokenizer())
        for doc in open(text, encoding="utf-8").read().split("\n\n")[:60]:
            writer.add(doc)
        writer.close()
    blocker = str(root / "a_file")
    open(blocker, "w").close()

    def run(case):
        name, overrides, extra, _ = case
        workdir = str(root / name)
        shutil.copytree(os.path.join(seeded, "checkpoints"), os.path.join(workdir, "checkpoints"))
        shutil.copy(os.path.join(seeded, "config.json"), workdir)
        saved = os.path.join(workdir, "checkpoints", "2")  # the seeded run's checkpoint
        before = _tree_digest(saved)
        with open(os.path.join(workdir, "config.json"), "rb") as f:
            config_before = f.read()
        flags = {**TINY_FLAGS, **BASE, "train.steps": 2, "checkpoint.every": 0,
                 "data.path": corpus, **overrides}
        for key, value in flags.items():
            if isinstance(value, str) and value.startswith("PREPARED:"):
                flags[key] = prepared[value.split(":")[1]]
        env = child_env()
        args, wrapper = [], []
        for item in extra:
            if item == "XLA8":
                env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
            elif item == "WORKDIR_UNDER_FILE":
                pass
            elif item == "FSIZE":  # files may not grow past 64 KiB: a full disk, for writes
                wrapper = ["bash", "-c", 'ulimit -f 64 && exec "$@"', "limited"]
            else:
                args.append(item)
        workdir_arg = os.path.join(blocker, "run") if "WORKDIR_UNDER_FILE" in extra else workdir
        cmd = wrapper + [sys.executable, os.path.join(ROOT, "launch.py"),
                         f"--workdir={workdir_arg}"]
        if not any(a.startswith("--config=") for a in args):  # overrides of cpu_tiny's keys
            cmd += [f"--config.{k}={v}" for k, v in flags.items()]
        cmd += args
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        after = _tree_digest(saved) if os.path.isdir(saved) else None
        with open(os.path.join(workdir, "config.json"), "rb") as f:
            config_kept = f.read() == config_before
        return name, (proc, before == after, config_kept, sorted(os.listdir(workdir)))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = dict(pool.map(run, CASES))
    return results, prepared


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_saved_work_is_intact(outcomes, case):
    results, prepared = outcomes
    name, _, _, expected = case
    proc, checkpoint_intact, config_kept, entries = results[name]
    expected = expected.replace("SHARD", prepared.get(
        {"empty_data_file": "empty_shard", "token_ids_beyond_vocab": "beyond_vocab_shard"}.get(
            name, ""), "SHARD"))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dsjax: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert expected in errors[0], errors[0]
    assert checkpoint_intact
    # The run's config.json is rewritten only once a checkpoint is accepted: the one case that
    # fails later (a save on a full disk) has started training.
    assert config_kept == (name != "disk_full_during_save"), name
    started = "dsjax: config " in proc.stdout
    assert started == (name in REACH_RUN), (name, proc.stdout[-2000:])
    if not started:  # nothing of the run: no data cache, metrics or new checkpoint
        assert set(entries) <= {"checkpoints", "logs", "config.json"}, entries

