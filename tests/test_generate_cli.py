"""`python -m dsjax.generate` on a finished cpu_tiny run: greedy output against a full
recomputation of every prefix (no cache), prompts from flags, files and stdin, chat prompts, and
bad input in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, child_env, shared_run
from dsjax import checkpoint as ckpt
from dsjax.data import ByteTokenizer
from dsjax.data.chat_template import ChatTemplate, prompt_ids
from dsjax.generate.cli import read_run_config
from dsjax.model import Transformer
from dsjax.model.decoder import abstract_params


@pytest.fixture
def run():
    """The cpu_tiny run test_train makes (read only here)."""
    return shared_run("train-contract", {"metrics.profile_every": 3,
                                         "metrics.cost_per_gpu_hour": 2.5})[0]


def generate(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "dsjax.generate", *args], cwd=ROOT,
                          env=child_env(), input=stdin, capture_output=True, text=True,
                          timeout=600)


def recomputed_greedy(workdir, prompt_ids_, new):
    """Greedy continuation by a full forward over the whole sequence for every new token, on one
    device: no cache, no generator."""
    cfg = read_run_config(workdir).model
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nn.unbox(abstract_params(cfg)))
    params = ckpt.restore_params(workdir, abstract, cfg, log=lambda *_: None)
    model = Transformer(cfg)
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t)[0, -1])
    ids = list(prompt_ids_)
    for _ in range(new):
        logits = np.asarray(apply(params, jnp.asarray([ids])))
        ids.append(int(np.argmax(logits[:ByteTokenizer.vocab_size])))
        if ids[-1] == ByteTokenizer.eos_id:
            return ids[len(prompt_ids_):-1]
    return ids[len(prompt_ids_):]


def test_greedy_output_equals_full_recomputation(run, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = generate("--workdir", run, "--prompt", "def ", "--prompt", "import os\n",
                    "--greedy", "--max_new_tokens", "24", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["def ", "import os\n"]
    tok = ByteTokenizer()
    for r in records:
        want = recomputed_greedy(run, tok.encode(r["prompt"]).tolist(), 24)
        assert r["tokens"] == want
        assert r["completion"] == tok.decode(want)
        assert f"--- {r['prompt']}\n{r['completion']}" in proc.stdout


def test_prompts_from_a_file_stdin_and_chat(run, tmp_path):
    lines = tmp_path / "prompts.txt"
    lines.write_text("class A:\n\nfor i in\n")
    from_file = generate("--workdir", run, "--prompts", str(lines), "--max_new_tokens", "5",
                         "--out", str(tmp_path / "a.jsonl"))
    from_stdin = generate("--workdir", run, "--max_new_tokens", "5", "--out",
                          str(tmp_path / "b.jsonl"), stdin="class A:\nfor i in\n")
    for proc in (from_file, from_stdin):
        assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = ((tmp_path / n).read_text().splitlines() for n in ("a.jsonl", "b.jsonl"))
    assert [json.loads(r)["prompt"] for r in a] == ["class A:", "for i in"]
    assert a == b  # the same prompts and seed: the same samples
    chat = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is 2 + 3?"}]
    chat.write_text(json.dumps({"messages": messages}) + "\n")
    proc = generate("--workdir", run, "--chat", "--prompts", str(chat), "--greedy",
                    "--max_new_tokens", "8", "--out", str(tmp_path / "c.jsonl"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "c.jsonl").read_text())
    # the chat prompt is the template's rendering with the assistant header
    ids = prompt_ids(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), messages).tolist()
    assert record["tokens"] == recomputed_greedy(run, ids, 8)


@pytest.mark.parametrize("args, stdin, message", [
    (["--workdir", "/nonexistent/run", "--prompt", "x"], None, "config.json not found"),
    (["--prompt", "x", "--temperature", "-1"], None, "train.sample_temperature"),
    (["--prompt", "x", "--max_new_tokens", "0"], None, "--max_new_tokens"),
    ([], "", "no prompts"),
    (["--prompts", "PROMPTS_JSONL"], None, ":2: not valid JSON"),
    (["--prompts", "PROMPTS_JSONL_MESSAGES"], None, "needs --chat"),
], ids=["no-run", "temperature", "max-new", "no-prompts", "bad-jsonl", "messages-without-chat"])
def test_bad_input_is_one_line(run, tmp_path, args, stdin, message):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    chat = tmp_path / "m.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = [{"PROMPTS_JSONL": str(bad), "PROMPTS_JSONL_MESSAGES": str(chat)}.get(a, a)
            for a in args]
    if "--workdir" not in args:
        args = ["--workdir", run] + args
    before = sorted(os.listdir(run))
    proc = generate(*args, stdin=stdin)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(os.listdir(run)) == before
