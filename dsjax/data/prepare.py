"""Raw text or JSONL -> tokenized train/eval shards that `PackedSource` reads.

  python -m dsjax.data.prepare --input 'corpus/*.jsonl' --format jsonl --tokenizer byte --out data/
  -> wrote data/train: 9,812 docs, 41,023,512 tokens; data/eval: 98 docs, 402,133 tokens

Two passes over the input: the first reads and checks every document (so a bad line fails before
anything is written) and assigns it to train or eval by a seeded hash of its *content* -- the
same text always lands in the same split, so duplicates cannot leak from train into eval; the
second tokenizes and writes. Bad input exits with code 2 and one line naming the file and line.
`--format multimodal` (JSONL with images and videos, `--image_size N`) is `multimodal.prepare`;
`--format chat` and `--format preference` (JSONL conversations and preference pairs for SFT and
DPO, `--seq_len N`) are `chat_prepare`: there a bad record is skipped with its line, not fatal.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Iterator, Sequence

import numpy as np

from dsjax.config.sections import DataConfig, VisionConfig
from dsjax.errors import DataError
from dsjax.data.chat_prepare import FORMATS as CHAT_FORMATS, prepare_chat
from dsjax.data.inputs import check_out_dir, eval_score, expand_inputs, jsonl_records
from dsjax.data.multimodal.prepare import prepare_multimodal
from dsjax.data.shards import ShardWriter
from dsjax.data.tokenizers import load_tokenizer

FORMATS = ("text", "jsonl")


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
    for where, record in jsonl_records(path):
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


def prepare_text(inputs: Sequence[str] | str, fmt: str, tokenizer_spec: str, out_dir: str,
            eval_fraction: float = 0.01, seed: int = 0, jsonl_field: str = "text",
            split_on_blank_lines: bool = False, shard_tokens: int = 2**24,
            overwrite: bool = False) -> dict:
    """Writes `out_dir/train` and `out_dir/eval`; existing splits there are a DataError unless
    `overwrite` (checked before any input is read).

    Returns {"train": meta, "eval": meta, "train_dir": path, "eval_dir": path}.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    check_out_dir(out_dir, overwrite)
    if isinstance(inputs, str):
        inputs = [inputs]
    files = expand_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_spec)

    # Pass 1: validate everything and score each document before touching out_dir.
    scores = np.array([eval_score(doc, seed)
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
    parser.add_argument("--format", choices=FORMATS + ("multimodal",) + tuple(CHAT_FORMATS),
                        default="text",
                        help="text: a file (or paragraph) per document; jsonl: a line per "
                        "document; multimodal: JSONL records with 'images' or 'video'; chat: "
                        "JSONL {'messages': [{'role', 'content'}, ...]}; preference: JSONL "
                        "{'prompt', 'chosen', 'rejected'}")
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
    parser.add_argument("--seq_len", type=int, default=0,
                        help="chat, preference: the row length training reads (data.seq_len); "
                        "an example (a pair) longer than seq_len + 1 tokens is skipped")
    parser.add_argument("--image_size", type=int, default=VisionConfig.image_size,
                        help="multimodal: images and video frames are resized to N x N (the "
                        "model's vision.image_size)")
    parser.add_argument("--video_fps", type=float, default=DataConfig.video_fps,
                        help="multimodal: video frames sampled per second of presentation time")
    parser.add_argument("--max_frames", type=int, default=DataConfig.max_frames,
                        help="multimodal: frames kept per video")
    parser.add_argument("--shard_images", type=int, default=1024,
                        help="multimodal: images per shard file")
    parser.add_argument("--max_tiles", type=int, default=0,
                        help="multimodal: DeepSeek-VL2 tiling, a global view plus up to N tiles "
                        "per image (the model's vision.max_tiles with vision.tiling); 0: none")
    parser.add_argument("--eval_input", action="append", default=[],
                        help="multimodal: files whose records all go to eval (then every --input "
                             "record goes to train; --eval_fraction is unused)")
    args = parser.parse_args(argv)
    if args.eval_input and args.format != "multimodal":
        print(f"error: --eval_input is for --format multimodal, got --format {args.format}",
              file=sys.stderr)
        return 2
    chat = args.format in CHAT_FORMATS
    if chat != bool(args.seq_len):
        print(f"error: --seq_len is {'required' if chat else 'only'} for --format chat and "
              f"preference" + ("" if chat else f", got --format {args.format}"), file=sys.stderr)
        return 2
    try:
        if chat:
            result = prepare_chat(args.input, args.format, args.tokenizer, args.out,
                                  args.seq_len, args.eval_fraction, args.seed,
                                  args.shard_tokens, args.overwrite,
                                  on_skip=lambda line: print(f"skipped {line}", file=sys.stderr))
        elif args.format == "multimodal":
            result = prepare_multimodal(args.input, args.tokenizer, args.out, args.image_size,
                                        args.video_fps, args.max_frames, args.eval_fraction,
                                        args.seed, args.shard_tokens, args.shard_images,
                                        args.overwrite, args.eval_input, args.max_tiles)
        else:
            result = prepare_text(args.input, args.format, args.tokenizer, args.out,
                             args.eval_fraction, args.seed, args.jsonl_field,
                             args.split_on_blank_lines, args.shard_tokens, args.overwrite)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if chat:
        unit = "conversations" if args.format == "chat" else "preference pairs"
        print("wrote " + "; ".join(
            f"{result[s + '_dir']}: {result[s]['num_examples']:,} {unit}, "
            f"{result[s]['num_tokens']:,} tokens ({result[s]['num_target_tokens']:,} trained)"
            for s in ("train", "eval")))
        print(f"skipped {len(result['skipped'])} bad record(s)"
              + (" (each named above)" if result["skipped"] else ""))
        return 0
    images = lambda meta: f", {meta['num_images']:,} images" if "num_images" in meta else ""
    summary = "; ".join(f"{result[s + '_dir']}: {result[s]['num_docs']:,} docs, "
                        f"{result[s]['num_tokens']:,} tokens{images(result[s])}"
                        for s in ("train", "eval"))
    print(f"wrote {summary}")
    skipped = result.get("skipped", [])
    if skipped:
        print(f"skipped {len(skipped)} record(s) with bad media:")
        for line in skipped:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
