"""The built-in chat task of post-training (`data.source="arithmetic"`): one-step arithmetic
word problems whose answers are checked exactly, built offline from nothing but this file.

  User: Mia has pears: 4, then 3 added. How many?
  Assistant: 4 + 3 = 7<eos>

Every problem is a setting (a name, an object) and two numbers a, b in 1..4, added or taken
(a >= b); the reply writes the sum out, so exact match checks that the model read both numbers
and the operation from the words, and the result. The sentences are shuffled with a fixed seed
and cut into three disjoint pools: SFT conversations, DPO preference pairs (chosen: the right
reply; rejected: a near miss, the result off by one or two, or the other operation) and
held-out prompts with their replies, which the post-training recipe scores by exact match. A
held-out sentence is never trained on; every (a, b, operation) fact also appears in training
under other names and objects, so the task is to read the numbers and add, not to recall a
sentence.

`build_arithmetic_corpus(root, seq_len)` writes root/raw/*.jsonl, then prepares root/chat and
root/preference (`chat_prepare.prepare_chat`, byte tokenizer) and root/heldout.jsonl, once: a
root/built.json naming what was built makes later calls free.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Callable

import numpy as np

from dsjax.data.chat_prepare import encode_preference_record, prepare_chat
from dsjax.data.chat_template import ChatTemplate
from dsjax.data.tokenizers import ByteTokenizer
from dsjax.errors import DataError

VERSION = 7  # of the generator: a change rebuilds every cache
SEED = 20261206
NAMES = ("Mia", "Leo", "Ana", "Sam", "Kai", "Zoe", "Ben", "Ivy", "Max", "Eva", "Tom", "Nia",
         "Ada", "Eli", "Uma", "Jon", "Ray", "Liz", "Ned", "Ava")
OBJECTS = ("apples", "pears", "books", "coins", "shells", "cards", "pens", "stamps", "eggs",
           "shoes")
# Small numbers: 26 facts (16 sums, 10 differences), which a 5M-parameter model learns within
# cpu_sft's minutes of SFT (0..9's 155 it did not), and every answer one digit (DPO unlearned
# 1..5's lone two-digit sum; docs/posttraining.md).
NUMBERS = range(1, 5)
SETTINGS = ("{n}'s {o}:", "{n} has {o}:", "{n}'s box of {o}:")
# Every problem ends the same way, so both numbers and the operation's word stand at the same
# distance from the reply whatever the setting, name or object: the words vary, the reading not.
# Short, because every token of a conversation costs step time and only the reply's train.
PROBLEM = "{setting} {a}, then {b} {verb}. How many?"
VERBS = {"+": "added", "-": "taken"}
POOLS = {"sft": 0.55, "preference": 0.35, "heldout": 0.10}  # shares of the sentences
BUILT = "built.json"


def reply(a: int, b: int, op: str, result: int | None = None) -> str:
    """The assistant's reply to a problem on a, b: "7 + 5 = 12" (`result` replaces the right
    one)."""
    right = a + b if op == "+" else a - b
    return f"{a} {op} {b} = {right if result is None else result}"


def problems() -> list[tuple[str, int, int, str]]:
    """Every (question, a, b, operation "+" or "-") the templates make, in a fixed order."""
    out = []
    for a, b in itertools.product(NUMBERS, repeat=2):
        for op, verb in VERBS.items():
            if op == "-" and a < b:
                continue
            for setting, n, o in itertools.product(SETTINGS, NAMES, OBJECTS):
                out.append((PROBLEM.format(setting=setting.format(n=n, o=o), a=a, b=b,
                                           verb=verb), a, b, op))
    return out


def _near_miss(rng: np.random.Generator, a: int, b: int, op: str) -> str:
    """A wrong reply a model could plausibly give: the other operation (where its result is not
    negative and differs), else a result off by one or two."""
    other = "-" if op == "+" else "+"
    if (other == "+" or a >= b) and b != 0 and rng.random() < 0.3:
        return reply(a, b, other)
    right = a + b if op == "+" else a - b
    miss = right + int(rng.choice([-2, -1, 1, 2]))
    return reply(a, b, op, miss if miss >= 0 else right + 1)


def _user(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def pools() -> dict[str, list[dict]]:
    """{"sft": chat records, "preference": preference records, "heldout": {"messages",
    "answer"} records, the answer being the whole expected reply}: disjoint sentences, seeded."""
    rng = np.random.default_rng(SEED)
    everything = problems()
    order = rng.permutation(len(everything))
    cuts = np.cumsum([int(share * len(order)) for share in POOLS.values()])
    chosen = dict(zip(POOLS, np.split(order, cuts[:-1])))
    sft = [{"messages": _user(q) + [{"role": "assistant", "content": reply(a, b, op)}]}
           for q, a, b, op in (everything[i] for i in chosen["sft"])]
    preference = [{"prompt": _user(q), "chosen": reply(a, b, op),
                   "rejected": _near_miss(rng, a, b, op)}
                  for q, a, b, op in (everything[i] for i in chosen["preference"])]
    heldout = [{"messages": _user(q), "answer": reply(a, b, op)}
               for q, a, b, op in (everything[i] for i in chosen["heldout"])]
    return {"sft": sft, "preference": preference, "heldout": heldout}


def _write_jsonl(path: str, records: list[dict]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(path + ".tmp", path)


def _check_fits(pairs: list[dict], seq_len: int) -> None:
    """DataError naming data.seq_len unless the longest pair fits a row (a pair is the task's
    longest example; byte tokens, so the most characters make the most tokens)."""
    longest = max(pairs, key=lambda r: len(json.dumps(r)))
    try:
        encode_preference_record(longest, ChatTemplate.for_tokenizer("byte"), ByteTokenizer(),
                                 seq_len)
    except DataError as err:
        raise DataError(f"data.seq_len: {seq_len} is too short for the arithmetic chat task's "
                        f"preference pairs: {err}") from None


def build_arithmetic_corpus(root: str, seq_len: int,
                            log: Callable[[str], None] = print) -> dict[str, str]:
    """{"chat": prepared chat dir, "preference": prepared preference dir, "heldout": JSONL of
    held-out prompts and answers} under `root`, built once for this generator and seq_len."""
    stamp = {"version": VERSION, "seed": SEED, "seq_len": int(seq_len)}
    paths = {"chat": os.path.join(root, "chat"), "preference": os.path.join(root, "preference"),
             "heldout": os.path.join(root, "heldout.jsonl")}
    built = os.path.join(root, BUILT)
    if os.path.isfile(built):
        with open(built, encoding="utf-8") as f:
            if json.load(f) == stamp:
                return paths
    records = pools()
    _check_fits(records["preference"], seq_len)
    raw = os.path.join(root, "raw")
    os.makedirs(raw, exist_ok=True)
    for name in ("sft", "preference"):
        _write_jsonl(os.path.join(raw, f"{name}.jsonl"), records[name])
    _write_jsonl(paths["heldout"], records["heldout"])
    for name, fmt in (("sft", "chat"), ("preference", "preference")):
        # 5% held out: the stage's held-out loss; exact match reads heldout.jsonl
        prepare_chat(os.path.join(raw, f"{name}.jsonl"), fmt, "byte", paths[fmt], seq_len,
                     eval_fraction=0.05, seed=SEED, overwrite=True)
    with open(built + ".tmp", "w", encoding="utf-8") as f:  # last: a partial build rebuilds
        json.dump(stamp, f)
    os.replace(built + ".tmp", built)
    log(f"arithmetic chat task: {len(records['sft']):,} conversations, "
        f"{len(records['preference']):,} preference pairs, {len(records['heldout']):,} "
        f"held-out prompts in {root}")
    return paths
