"""The post-training recipe (posttrain.recipe, configs/cpu_sft.py): its arithmetic chat task
(replies checked against sums this file computes from the question's words, pools disjoint,
built once), exact match against a cache-free greedy recomputation, and pretrain -> SFT -> DPO
through `python launch.py` at the tiny shape: stages chained by their weights, summary.json as
the metrics say. That the recipe reaches its accuracies at cpu_sft's size is measured, not
tested (docs/posttraining.md): 15 minutes of training is no unit test."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FLAT_MESH, ROOT, read_records, run_launch, tiny
from dsjax import config as config_lib
from dsjax.config import ConfigError
from dsjax.errors import DataError
from dsjax.data import ByteTokenizer
from dsjax.data import arithmetic_chat as arithmetic
from dsjax.data.chat_template import ChatTemplate, prompt_ids
from dsjax.evaluate.exact_match import MAX_REPLY_TOKENS, ExactMatch
from dsjax.train.trainer import build_trainer

PLUS, MINUS = ("added",), ("taken",)


def _read(question):
    """(a, b, "+" or "-") from a problem's words, as a reader would."""
    a, b = (int(n) for n in re.findall(r"\d+", question))
    plus, minus = (any(word in question for word in words) for words in (PLUS, MINUS))
    assert plus != minus, question
    return a, b, "+" if plus else "-"


def _right(question):
    a, b, op = _read(question)
    return f"{a} {op} {b} = {a + b if op == '+' else a - b}"


def _question(record):
    messages = record.get("messages") or record["prompt"]
    return next(m["content"] for m in messages if m["role"] == "user")


def test_arithmetic_replies_are_right_and_the_pools_disjoint():
    pools = arithmetic.pools()
    assert pools == arithmetic.pools()  # seeded
    questions = {name: [_question(r) for r in records] for name, records in pools.items()}
    for name, qs in questions.items():
        assert len(set(qs)) == len(qs), name
    sft, pref, held = (set(questions[k]) for k in ("sft", "preference", "heldout"))
    assert not sft & pref and not sft & held and not pref & held
    assert len(sft) + len(pref) + len(held) >= 0.99 * len(arithmetic.problems())
    assert len(held) >= 1000

    for r in pools["sft"]:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][1]["content"] == _right(_question(r))
    for r in pools["heldout"]:
        assert r["answer"] == _right(_question(r))
    others = 0
    for r in pools["preference"]:
        q = _question(r)
        assert r["chosen"] == _right(q)
        a, b, op = _read(q)
        left, result = r["rejected"].split(" = ")
        assert r["rejected"] != r["chosen"] and int(result) >= 0
        if left == f"{a} {op} {b}":
            assert 1 <= abs(int(result) - int(r["chosen"].split(" = ")[1])) <= 2
        else:  # the other operation, done right
            other = "-" if op == "+" else "+"
            assert left == f"{a} {other} {b}"
            assert int(result) == (a - b if other == "-" else a + b)
            others += 1
    assert 0.1 < others / len(pools["preference"]) < 0.4  # both kinds of near miss

    # Every held-out fact (a, b, operation) is trained on under other words.
    trained = {_read(q) for q in sft}
    assert all(_read(q) in trained for q in held)


def test_the_task_is_built_once(tmp_path):
    root = str(tmp_path / "task")
    paths = arithmetic.build_arithmetic_corpus(root, 160, log=lambda *_: None)
    with open(paths["heldout"], encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == arithmetic.pools()["heldout"]
    for kind in ("chat", "preference"):
        with open(os.path.join(paths[kind], "train", "meta.json"), encoding="utf-8") as f:
            assert json.load(f)["seq_len"] == 160
    stamps = {p: os.stat(os.path.join(d, p)).st_mtime_ns
              for d, _, names in os.walk(root) for p in names}
    assert arithmetic.build_arithmetic_corpus(root, 160, log=lambda *_: None) == paths
    assert {p: os.stat(os.path.join(d, p)).st_mtime_ns
            for d, _, names in os.walk(root) for p in names} == stamps
    with pytest.raises(DataError,
                       match=r"^data\.seq_len: 140 is too short .* are 153 tokens together"):
        arithmetic.build_arithmetic_corpus(str(tmp_path / "short"), 140, log=lambda *_: None)
    assert not os.path.exists(tmp_path / "short")
    os.remove(os.path.join(root, arithmetic.BUILT))  # an interrupted build: built.json is last
    arithmetic.build_arithmetic_corpus(root, 160, log=lambda *_: None)
    assert os.path.isfile(os.path.join(root, arithmetic.BUILT))


def test_exact_match_scores_the_greedy_reply():
    cfg = config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"),
                          tiny(FLAT_MESH, {"data.seq_len": 128, "model.init_std": 0.3}))
    trainer = build_trainer(cfg)
    params = trainer.init(seed=5).params
    tok, template = ByteTokenizer(), ChatTemplate.for_tokenizer("byte")
    records = [{"messages": [{"role": "user", "content": q}], "answer": ""}
               for q in ("Ana collects pens. It had 9, and 2 were taken. How many now?",
                         "What is 3 plus 4?", "Zoe has a bag of cards. It had 1, and 5 were "
                         "added. How many now?", "8 - 8?")]
    model = trainer.eval_model
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t)[0, -1])
    replies = []
    for r in records:  # greedy by a full forward per token: no cache, no generator
        ids = list(prompt_ids(template, tok, r["messages"]))
        new = []
        while len(new) < MAX_REPLY_TOKENS:
            new.append(int(np.argmax(np.asarray(apply(params, jnp.asarray([ids + new])))[
                :tok.vocab_size])))
            if new[-1] == tok.eos_id:
                new.pop()
                break
        replies.append(tok.decode(new).strip())
    assert len(set(replies)) > 1  # the prompts steer the untrained model
    for r, reply in zip(records, replies):
        r["answer"] = reply
    for r in records[1::2]:
        r["answer"] += "0"
    got = ExactMatch.for_trainer(trainer, tok, template)(params, records)
    assert got["exact_match"] == 0.5 and got["prompts"] == 4
    assert [e["reply"] for e in got["examples"]] == replies


def test_a_stage_that_does_not_combine_fails_at_load_naming_the_stage():
    with pytest.raises(ConfigError) as err:
        config_lib.load(os.path.join(ROOT, "configs", "cpu_tiny.py"),
                        tiny(FLAT_MESH, {"posttrain.recipe": "pretrain,sft,dpo", "optim.name":
                              "onebit_adam", "optim.freeze_step": 2}))
    message = str(err.value)
    assert message.startswith("optim.name: train.task='dpo'"), message
    assert message.endswith("(the recipe's dpo stage)"), message


RECIPE = tiny(FLAT_MESH, {
    "posttrain.recipe": "pretrain,sft,dpo", "posttrain.start_from": "",
    "posttrain.pretrain_steps": 2, "posttrain.sft_steps": 4, "posttrain.dpo_steps": 4,
    "posttrain.eval_prompts": 6, "posttrain.sft_lr": 1e-3, "posttrain.dpo_lr": 1e-4,
    "data.seq_len": 160, "data.global_batch": 8, "data.eval_batches": 1,
    "train.log_every": 1, "train.sample_tokens": 4, "optim.warmup_steps": 1,
    "checkpoint.every": 0,
})


def test_a_corpus_of_another_tokenizer_is_refused_before_training(tmp_path):
    from test_data import _train_hf_tokenizer
    from dsjax.data.prepare import prepare_text
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(3000)))
    _train_hf_tokenizer(tmp_path / "tokenizer.json", [docs.read_text()])
    prepare_text([str(docs)], "text", str(tmp_path / "tokenizer.json"), str(tmp_path / "data"),
                 eval_fraction=0.3, split_on_blank_lines=True)
    workdir = tmp_path / "recipe"
    proc = run_launch(str(workdir), {**RECIPE, "data.source": "prepared",
                                     "data.path": str(tmp_path / "data")},
                      config="configs/cpu_sft.py")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.path: the recipe's chat task is byte-tokenized" in proc.stderr, proc.stderr
    assert not os.path.exists(workdir / "pretrain" / "checkpoints")


def test_the_recipe_chains_its_stages_and_sums_them_up(tmp_path):
    workdir = str(tmp_path / "recipe")
    # --max_runtime spans the recipe: the stage it runs out in stops early, and so does the
    # recipe; the same command resumes that stage.
    proc = run_launch(workdir, RECIPE, config="configs/cpu_sft.py", args=["--max_runtime=1s"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = re.search(r"posttrain: stopped in the (\w+) stage", proc.stdout)
    assert stopped, proc.stdout[-2000:]
    stage = stopped.group(1)
    later = ("pretrain", "sft", "dpo")[("pretrain", "sft", "dpo").index(stage) + 1:]
    assert not any(os.path.exists(os.path.join(workdir, s)) for s in later)
    # A stage may start after the budget is spent (when the one before finished inside it: its
    # step was compiled before its clock started) and stop before its first step: no records.
    records = read_records(os.path.join(workdir, stage))
    stopped_at = records[-1]["step"] if records else 0
    assert stopped_at < RECIPE[f"posttrain.{stage}_steps"]

    proc = run_launch(workdir, RECIPE, config="configs/cpu_sft.py", timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    if stopped_at:
        assert f"resumed from step {stopped_at} ({workdir}/{stage}/checkpoints)" in proc.stdout
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    stages = {s: os.path.join(workdir, s) for s in ("pretrain", "sft", "dpo")}
    for stage, init_from in (("pretrain", ""), ("sft", stages["pretrain"]),
                             ("dpo", stages["sft"])):
        with open(os.path.join(stages[stage], "config.json"), encoding="utf-8") as f:
            run = json.load(f)
        assert run["checkpoint"]["init_from"] == init_from, stage
        assert run["train"]["task"] == stage
        assert run["posttrain"]["recipe"] == ""
        steps = [r["step"] for r in read_records(stages[stage]) if "loss" in r]
        assert steps[-1] == RECIPE[f"posttrain.{stage}_steps"], stage
    assert summary["started_from"] == stages["pretrain"]
    assert summary["heldout_prompts"] == 6
    rewards = [r["dpo_reward_accuracy"] for r in read_records(stages["dpo"])
               if "dpo_reward_accuracy" in r]
    assert len(rewards) == 4
    assert summary["dpo_reward_accuracy"] == pytest.approx(rewards[-1])  # the last 25% of 4
    for key in ("sft_exact_match_before", "sft_exact_match", "dpo_exact_match"):
        assert 0.0 <= summary[key] <= 1.0
        assert f"{summary[key]:.3f}" in proc.stdout
    assert set(summary["stage_seconds"]) == {"pretrain", "sft", "dpo", "total"}
    assert summary["stopped_early"] is None
    assert len(summary["examples"]) == 5

    # A run of this model with a checkpoint (`make train`'s runs/cpu_tiny, in cpu_sft) is the
    # start instead of a pretrain stage.
    again = str(tmp_path / "again")
    proc = run_launch(again, {**RECIPE, "posttrain.start_from": stages["pretrain"]},
                      config="configs/cpu_sft.py", args=["--max_runtime=1s"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (f"posttrain: starting from {stages['pretrain']} (posttrain.start_from): no "
            f"pretraining") in proc.stdout
    assert not os.path.exists(os.path.join(again, "pretrain"))
    with open(os.path.join(again, "sft", "config.json"), encoding="utf-8") as f:
        assert json.load(f)["checkpoint"]["init_from"] == stages["pretrain"]
