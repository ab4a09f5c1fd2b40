"""Chat and preference JSONL records -> tokenized, loss-masked train/eval splits (`chat_source`).

  chat:        {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
  preference:  {"prompt": [messages ending with a user turn] or "one user turn",
                "chosen": "the preferred reply", "rejected": "the other reply"}

A bad record is skipped, not fatal: it gets one line, `file:line: what is wrong`, and the count is
reported at the end; only when no record is usable is it an error, and then nothing is written.
Two passes, like the text path: the first checks and encodes every record (its length against
`seq_len` included) and scores it by a seeded hash of its content, before `out_dir` is touched;
the second encodes the usable records again and writes them. A preference record is scored by its
prompt, so pairs that share a prompt land in the same split and no prompt leaks into eval.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator, Sequence

import numpy as np

from dsjax.errors import DataError
from dsjax.data.chat_source import CHAT_FORMAT, PREFERENCE_FORMAT, ExampleWriter
from dsjax.data.chat_template import ROLES, ChatTemplate, encode_chat
from dsjax.data.inputs import check_out_dir, eval_score, expand_inputs
from dsjax.data.tokenizers import load_tokenizer

FORMATS = {"chat": CHAT_FORMAT, "preference": PREFERENCE_FORMAT}


def _records(files: Sequence[str]) -> Iterator[tuple[str, dict | None, str]]:
    """("file:line", JSON object or None, problem) for every non-blank line of every file."""
    for path in files:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                where = f"{path}:{line_no}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    yield where, None, "not valid UTF-8"
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    yield where, None, f"invalid JSON ({e.msg} at column {e.colno})"
                    continue
                if not isinstance(record, dict):
                    yield where, None, f"expected a JSON object, got {type(record).__name__}"
                    continue
                yield where, record, ""


def check_messages(messages, field: str = "messages") -> list[dict]:
    """The record's messages, each a {"role", "content": str} object with a known role;
    DataError saying what is wrong otherwise."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"field {field!r} must be a non-empty list of {{'role', 'content'}} "
                        f"objects, got {type(messages).__name__ if messages else messages!r}")
    for i, message in enumerate(messages):
        at = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at} is {type(message).__name__}, expected an object with 'role' "
                            f"and 'content'")
        if message.get("role") not in ROLES:
            raise DataError(f"{at}: unknown role {message.get('role')!r}; valid: "
                            f"{', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise DataError(f"{at}: content is {type(content).__name__}, expected a string")
        if message["role"] == "assistant" and not content.strip():
            raise DataError(f"{at}: empty assistant content")
    return messages


def _reply(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in record else (
            "empty" if isinstance(value, str) else type(value).__name__)
        raise DataError(f"field {key!r} must be a non-empty string (the assistant's reply), "
                        f"got {got}")
    return value


def _row_limit(seq_len: int) -> str:
    return f"one row of --seq_len {seq_len} + 1 = {seq_len + 1} tokens"


def encode_chat_record(record: dict, template: ChatTemplate, tokenizer, seq_len: int
                       ) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """([(ids, mask)], the content the split is assigned by) of a chat record."""
    if "messages" not in record:
        raise DataError(f"missing field 'messages' (has {sorted(record)[:5]})")
    messages = check_messages(record["messages"])
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant turn: nothing to train on")
    ids, mask = encode_chat(template, tokenizer, messages)
    if ids.size > seq_len + 1:
        raise DataError(f"conversation is {ids.size} tokens, longer than {_row_limit(seq_len)}")
    if not mask.any():
        raise DataError(f"chat template {template.source} renders no assistant reply tokens")
    return [(ids, mask)], json.dumps(messages, sort_keys=True, ensure_ascii=False)


def encode_preference_record(record: dict, template: ChatTemplate, tokenizer, seq_len: int
                             ) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """([chosen (ids, mask), rejected (ids, mask)], the prompt, which assigns the split)."""
    if "prompt" not in record:
        raise DataError(f"missing field 'prompt' (has {sorted(record)[:5]})")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError("field 'prompt' is an empty string")
        prompt = [{"role": "user", "content": prompt}]
    else:
        prompt = check_messages(prompt, "prompt")
        if prompt[-1]["role"] != "user":
            raise DataError(f"prompt must end with a user turn, ends with "
                            f"{prompt[-1]['role']!r}")
    chosen, rejected = _reply(record, "chosen"), _reply(record, "rejected")
    if chosen == rejected:
        raise DataError("'chosen' and 'rejected' are the same reply: nothing to prefer")
    pair = [encode_chat(template, tokenizer, prompt + [{"role": "assistant", "content": reply}],
                        last_only=True) for reply in (chosen, rejected)]
    sizes = [ids.size for ids, _ in pair]
    if sum(sizes) > seq_len + 1:
        raise DataError(f"chosen ({sizes[0]} tokens) and rejected ({sizes[1]} tokens) are "
                        f"{sum(sizes)} tokens together; a pair must fit in {_row_limit(seq_len)}")
    if not all(mask.any() for _, mask in pair):
        raise DataError(f"chat template {template.source} renders no assistant reply tokens")
    return pair, json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def _examples(files, fmt, template, tokenizer, seq_len, on_skip=None):
    """(sequences, content key) of each usable record, in order; bad ones go to `on_skip`."""
    encode = encode_chat_record if fmt == "chat" else encode_preference_record
    for where, record, problem in _records(files):
        if not problem:
            try:
                yield encode(record, template, tokenizer, seq_len)
                continue
            except DataError as e:
                problem = str(e)
        if on_skip is not None:
            on_skip(f"{where}: {problem}")


def prepare_chat(inputs: Sequence[str] | str, fmt: str, tokenizer_spec: str, out_dir: str,
                 seq_len: int, eval_fraction: float = 0.01, seed: int = 0,
                 shard_tokens: int = 2**24, overwrite: bool = False,
                 on_skip: Callable[[str], None] | None = None) -> dict:
    """Writes `out_dir/train` and `out_dir/eval` of `fmt` ("chat" or "preference"); existing
    splits there are a DataError unless `overwrite` (checked before any input is read). Each bad
    record's line goes to `on_skip` as it is found.

    Returns {"train": meta, "eval": meta, "train_dir", "eval_dir", "skipped": [lines]}.
    """
    if fmt not in FORMATS:
        raise DataError(f"unknown chat format {fmt!r}; expected one of {tuple(FORMATS)}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if seq_len < 1:
        raise DataError(f"--seq_len must be >= 1, got {seq_len}")
    check_out_dir(out_dir, overwrite)
    files = expand_inputs([inputs] if isinstance(inputs, str) else inputs)
    tokenizer = load_tokenizer(tokenizer_spec)
    template = ChatTemplate.for_tokenizer(tokenizer_spec)

    # Pass 1: check and score every record before touching out_dir.
    skipped = []

    def skip(line: str) -> None:
        skipped.append(line)
        if on_skip is not None:
            on_skip(line)

    scores = np.array([eval_score(key, seed) for _, key in
                       _examples(files, fmt, template, tokenizer, seq_len, skip)])
    unit = "conversation" if fmt == "chat" else "preference pair"
    if scores.size < 2:
        found = "no usable record" if scores.size == 0 else f"only 1 usable {unit}"
        raise DataError(f"{', '.join(files)}: {found} ({len(skipped)} bad record(s) skipped); "
                        f"train and eval need at least one {unit} each; nothing was written")
    to_eval = scores < eval_fraction
    # Keep both splits non-empty: the lowest score goes to eval, the highest to train.
    to_eval[np.argmin(scores)] = True
    to_eval[np.argmax(scores)] = False

    # Pass 2: both writers first, so neither split's old meta.json survives a failed rewrite.
    dirs = {"train": os.path.join(out_dir, "train"), "eval": os.path.join(out_dir, "eval")}
    extra = {"chat_template": template.source, "chat_template_digest": template.digest,
             "skipped_records": len(skipped)}
    writers = {split: ExampleWriter(d, FORMATS[fmt], tokenizer, seq_len, shard_tokens, extra)
               for split, d in dirs.items()}
    for i, (sequences, _) in enumerate(_examples(files, fmt, template, tokenizer, seq_len)):
        writers["eval" if to_eval[i] else "train"].add(sequences)
    metas = {split: w.close() for split, w in writers.items()}
    return {**metas, "train_dir": dirs["train"], "eval_dir": dirs["eval"], "skipped": skipped}
