"""Raw text or JSONL -> tokenized train/eval shards that `PackedSource` reads.

  python -m dsjax.data.prepare --input 'corpus/*.jsonl' --format jsonl --tokenizer byte --out data/
  -> wrote data/train: 9,812 docs, 41,023,512 tokens; data/eval: 98 docs, 402,133 tokens

Two passes over the input: the first reads and checks every document (so a bad line fails before
anything is written) and assigns it to train or eval by a seeded hash of its *content* -- the
same text always lands in the same split, so duplicates cannot leak from train into eval; the
second tokenizes and writes. Bad input exits with code 2 and one line naming the file and line.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
from typing import Iterator, Sequence

import numpy as np

from dsjax.errors import DataError
from dsjax.data.shards import ShardWriter
from dsjax.data.tokenizers import load_tokenizer

FORMATS = ("text", "jsonl")


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files, directories (recursively; hidden files skipped) and globs -> sorted file paths."""
    files = []
    for spec in inputs:
        if glob.has_magic(spec):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise DataError(f"{spec}: no files match")
            files.extend(matches)
        elif os.path.isdir(spec):
            found = []
            for dirpath, dirnames, filenames in os.walk(spec):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found.extend(os.path.join(dirpath, n) for n in filenames if not n.startswith("."))
            if not found:
                raise DataError(f"{spec}: directory has no input files")
            files.extend(sorted(found))
        elif os.path.isfile(spec):
            files.append(spec)
        else:
            raise DataError(f"{spec}: input file not found")
    return files


def _text_documents(path: str, split_on_blank_lines: bool) -> Iterator[str]:
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte offset {e.start})") from None
    if not split_on_blank_lines:
        if text:
            yield text
        return
    for paragraph in re.split(r"\n[ \t\r\f\v]*\n", text):
        paragraph = paragraph.strip("\n")
        if paragraph.strip():
            yield paragraph


def _jsonl_documents(path: str, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if field not in record:
                raise DataError(f"{where}: missing field {field!r} (has {sorted(record)[:5]})")
            value = record[field]
            if not isinstance(value, str):
                raise DataError(
                    f"{where}: field {field!r} is {type(value).__name__}, expected a string")
            if value:
                yield value


def iter_documents(files: Sequence[str], fmt: str, jsonl_field: str = "text",
                   split_on_blank_lines: bool = False) -> Iterator[str]:
    """Non-empty documents of all files, in order."""
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    for path in files:
        if fmt == "text":
            yield from _text_documents(path, split_on_blank_lines)
        else:
            yield from _jsonl_documents(path, jsonl_field)


def _eval_score(text: str, seed: int) -> float:
    """Stable, seeded hash of a document's content, uniform in [0, 1)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def prepare(inputs: Sequence[str] | str, fmt: str, tokenizer_spec: str, out_dir: str,
            eval_fraction: float = 0.01, seed: int = 0, jsonl_field: str = "text",
            split_on_blank_lines: bool = False, shard_tokens: int = 2**24,
            overwrite: bool = False) -> dict:
    """Writes `out_dir/train` and `out_dir/eval`; existing splits there are a DataError unless
    `overwrite` (checked before any input is read).

    Returns {"train": meta, "eval": meta, "train_dir": path, "eval_dir": path}.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    existing = [os.path.join(out_dir, split) for split in ("train", "eval")
                if os.path.exists(os.path.join(out_dir, split))]
    if existing and not overwrite:
        raise DataError(f"--out {out_dir}: {' and '.join(existing)} exist already; nothing was "
                        f"written. Pass --overwrite to replace them, or choose another --out")
    if isinstance(inputs, str):
        inputs = [inputs]
    files = expand_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_spec)

    # Pass 1: validate everything and score each document before touching out_dir.
    scores = np.array([_eval_score(doc, seed)
                       for doc in iter_documents(files, fmt, jsonl_field, split_on_blank_lines)])
    if scores.size == 0:
        raise DataError(f"empty input: no non-empty documents in {', '.join(files)}")
    if scores.size < 2:
        raise DataError(f"{files[0]}: only 1 document; train and eval need at least one each")
    to_eval = scores < eval_fraction
    # Keep both splits non-empty: the lowest score goes to eval, the highest to train.
    to_eval[np.argmin(scores)] = True
    to_eval[np.argmax(scores)] = False

    # Pass 2: both writers first, so neither split's old meta.json survives a failed rewrite.
    dirs = {"train": os.path.join(out_dir, "train"), "eval": os.path.join(out_dir, "eval")}
    writers = {split: ShardWriter(d, tokenizer, shard_tokens) for split, d in dirs.items()}
    for i, doc in enumerate(iter_documents(files, fmt, jsonl_field, split_on_blank_lines)):
        writers["eval" if to_eval[i] else "train"].add(doc)
    metas = {split: w.close() for split, w in writers.items()}
    return {**metas, "train_dir": dirs["train"], "eval_dir": dirs["eval"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsjax.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", required=True,
                        help="file, directory or glob; repeatable")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text: a file (or paragraph) per document; jsonl: a line per document")
    parser.add_argument("--split_on_blank_lines", action="store_true",
                        help="text format: each blank-line-separated paragraph is a document")
    parser.add_argument("--jsonl_field", default="text", help="jsonl: the field holding the text")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a path to tokenizer.json")
    parser.add_argument("--out", required=True, help="output directory (gets train/ and eval/)")
    parser.add_argument("--eval_fraction", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0, help="seeds the train/eval assignment")
    parser.add_argument("--shard_tokens", type=int, default=2**24, help="tokens per shard file")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace train/ and eval/ if --out holds them already")
    args = parser.parse_args(argv)
    try:
        result = prepare(args.input, args.format, args.tokenizer, args.out, args.eval_fraction,
                         args.seed, args.jsonl_field, args.split_on_blank_lines, args.shard_tokens,
                         args.overwrite)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = "; ".join(f"{result[s + '_dir']}: {result[s]['num_docs']:,} docs, "
                        f"{result[s]['num_tokens']:,} tokens" for s in ("train", "eval"))
    print(f"wrote {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
