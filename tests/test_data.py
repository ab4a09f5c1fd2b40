"""Tests for dsjax.data: tokenizers, shard format, packing, Grain pipelines, prepare, stdlib corpus.

References are rebuilt independently in the tests (plain Python over the documents the test wrote),
never read back through the code under test.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import file_digests
from dsjax.data import (ByteTokenizer, DataError, HFTokenizer, PackedSource, ShardWriter,
                        SampleStream, build_stdlib_corpus, eval_batches, load_tokenizer,
                        make_example, prepare_text)
from dsjax.data.prepare import main as prepare_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Mixed widths on purpose: 1-byte ASCII, 2-byte Latin, 3-byte CJK, 4-byte emoji.
_ALPHABET = list("abcdefghij klmnop\n\t") + ["é", "ü", "中", "文", "🙂", "Ω"]


def random_text(rng, min_len=1, max_len=40) -> str:
    n = int(rng.integers(min_len, max_len + 1))
    return "".join(rng.choice(_ALPHABET, size=n))


def random_docs(rng, n, **kw) -> list[str]:
    return [random_text(rng, **kw) for _ in range(n)]


class BigVocabTokenizer:
    """A vocabulary past uint16 and no eos: exercises the uint32 path and eos-less documents."""
    name = "big-test"
    vocab_size = 70_000
    eos_id = None
    is_byte = False

    def encode(self, text):
        return np.array([60_000 + ord(c) % 10_000 for c in text], np.int32)


def split_docs(split_dir, tokenizer):
    """Decodes a split's documents by cutting its token stream at eos."""
    meta = json.load(open(os.path.join(split_dir, "meta.json")))
    stream = np.concatenate([np.load(os.path.join(split_dir, s["tokens"])) for s in meta["shards"]])
    cuts = np.flatnonzero(stream == tokenizer.eos_id)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tokenizer.decode(stream[a:b]) for a, b in zip(starts, cuts)]


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trip():
    rng = np.random.default_rng(0)
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eos_id == 256
    for _ in range(20):
        text = random_text(rng, 1, 200)
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, list(text.encode("utf-8")))
        assert tok.decode(ids) == text
        # eos is not a byte: decode drops it wherever it sits.
        assert tok.decode(np.insert(ids, len(ids) // 2, 256)) == text


def _train_hf_tokenizer(path, texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return tok


def test_hf_tokenizer_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    texts = random_docs(rng, 200, max_len=60)
    ref = _train_hf_tokenizer(tmp_path / "tokenizer.json", texts)
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):  # file or its directory
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.vocab_size == ref.get_vocab_size()
        assert tok.eos_id == ref.token_to_id("</s>") == 1
    for text in random_docs(rng, 20, max_len=80):
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert tok.eos_id not in ids  # no special tokens added
        assert ids.tolist() == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text


def test_hf_tokenizer_bad_files(tmp_path):
    with pytest.raises(DataError, match="nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        load_tokenizer(str(bad))


# ---------------------------------------------------------------------------------------------
# Shards and packing


def _reference_stream(docs, tokenizer):
    """Concatenated tokens and the index of the document each token belongs to."""
    pieces, owners = [], []
    for d, text in enumerate(docs):
        eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        ids = list(tokenizer.encode(text)) + eos
        pieces += ids
        owners += [d] * len(ids)
    return np.array(pieces, np.int64), np.array(owners)


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), BigVocabTokenizer()],
                         ids=["byte", "uint32"])
def test_shards_pack_windows_of_the_document_stream(tmp_path, tokenizer):
    rng = np.random.default_rng(2)
    docs = random_docs(rng, 60, max_len=30)
    shard_tokens, seq_len = 211, 8  # small shards: documents straddle shard boundaries
    writer = ShardWriter(str(tmp_path), tokenizer, shard_tokens=shard_tokens)
    for text in docs:
        writer.add(text)
    meta = writer.close()
    stream, owner = _reference_stream(docs, tokenizer)

    assert meta["num_docs"] == len(docs) and meta["num_tokens"] == len(stream)
    assert meta["num_bytes"] == sum(len(t.encode()) for t in docs)
    assert meta["dtype"] == ("uint16" if tokenizer.vocab_size <= 65535 else "uint32")
    assert all(s["num_tokens"] == shard_tokens for s in meta["shards"][:-1])
    assert len(meta["shards"]) > 2
    assert json.load(open(tmp_path / "meta.json")) == meta

    source = PackedSource(str(tmp_path), seq_len)
    expected_rows = sum((s["num_tokens"] - 1) // seq_len for s in meta["shards"])
    assert len(source) == expected_rows
    row = 0
    for s, shard in enumerate(meta["shards"]):
        base = s * shard_tokens
        for r in range((shard["num_tokens"] - 1) // seq_len):
            a = base + r * seq_len
            got = source[row]
            np.testing.assert_array_equal(got["tokens"], stream[a:a + seq_len + 1])
            # Segment k+1 = the k-th document after the one the row starts in.
            np.testing.assert_array_equal(got["segment_ids"],
                                          owner[a:a + seq_len + 1] - owner[a] + 1)

            ex = make_example(got)
            own = owner[a:a + seq_len + 1]
            np.testing.assert_array_equal(ex["inputs"], stream[a:a + seq_len])
            np.testing.assert_array_equal(ex["targets"], stream[a + 1:a + seq_len + 1])
            positions, p = [], 0
            for j in range(seq_len):
                p = 0 if j == 0 or own[j] != own[j - 1] else p + 1
                positions.append(p)
            np.testing.assert_array_equal(ex["positions"], positions)
            np.testing.assert_array_equal(ex["weights"], (own[:-1] == own[1:]).astype(np.float32))
            assert ex["weights"].dtype == np.float32
            row += 1
    with pytest.raises(IndexError):
        source[len(source)]


def test_make_example_hand_built_row():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 257, size=7).astype(np.int32)
    ex = make_example({"tokens": tokens, "segment_ids": np.array([1, 1, 2, 2, 2, 3, 3], np.int32)})
    np.testing.assert_array_equal(ex["inputs"], tokens[:-1])
    np.testing.assert_array_equal(ex["targets"], tokens[1:])
    np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 0, 1, 2, 0])
    np.testing.assert_array_equal(ex["weights"], [1, 0, 1, 1, 0, 1])


def test_packed_source_pickles(tmp_path):
    import pickle
    rng = np.random.default_rng(4)
    writer = ShardWriter(str(tmp_path), ByteTokenizer())
    for text in random_docs(rng, 30):
        writer.add(text)
    writer.close()
    source = PackedSource(str(tmp_path), 16)
    clone = pickle.loads(pickle.dumps(source))
    assert len(clone) == len(source) and clone.meta == source.meta
    for i in rng.integers(0, len(source), size=5):
        np.testing.assert_array_equal(clone[i]["tokens"], source[i]["tokens"])
        np.testing.assert_array_equal(clone[i]["segment_ids"], source[i]["segment_ids"])


def _write_split(path, rng, n_docs=40, max_len=40, shard_tokens=2**24):
    writer = ShardWriter(str(path), ByteTokenizer(), shard_tokens=shard_tokens)
    for text in random_docs(rng, n_docs, max_len=max_len):
        writer.add(text)
    return writer.close()


def test_packed_source_rejects_bad_splits(tmp_path):
    rng = np.random.default_rng(5)
    with pytest.raises(DataError, match="not found"):
        PackedSource(str(tmp_path / "absent"), 8)

    (tmp_path / "nometa").mkdir()
    with pytest.raises(DataError, match="meta.json"):
        PackedSource(str(tmp_path / "nometa"), 8)

    meta = _write_split(tmp_path / "fmt", rng)
    (tmp_path / "fmt" / "meta.json").write_text(json.dumps({**meta, "format": "other-v9"}))
    with pytest.raises(DataError, match=r"meta.json.*other-v9"):
        PackedSource(str(tmp_path / "fmt"), 8)

    _write_split(tmp_path / "gone", rng)
    os.remove(tmp_path / "gone" / "docs-00000.npy")
    with pytest.raises(DataError, match="docs-00000.npy"):
        PackedSource(str(tmp_path / "gone"), 8)

    meta = _write_split(tmp_path / "tamper", rng, shard_tokens=300)
    shard = tmp_path / "tamper" / "tokens-00001.npy"
    tokens = np.load(shard)
    at = int(rng.integers(0, tokens.size))
    tokens[at] = 257 + int(rng.integers(0, 1000))  # past the byte vocabulary
    np.save(shard, tokens)
    with pytest.raises(DataError, match=rf"tokens-00001.npy: token id {tokens[at]} at offset {at}"):
        PackedSource(str(tmp_path / "tamper"), 8)

    meta = _write_split(tmp_path / "short", rng, n_docs=2, max_len=5)
    n = meta["num_tokens"]
    PackedSource(str(tmp_path / "short"), n - 1)  # exactly one row fits
    with pytest.raises(DataError, match=rf"{n} tokens.*seq_len={n} needs {n + 1} tokens"):
        PackedSource(str(tmp_path / "short"), n)


def test_shard_writer_rewrite_drops_old_meta_first(tmp_path):
    rng = np.random.default_rng(6)
    _write_split(tmp_path, rng, shard_tokens=50)
    writer = ShardWriter(str(tmp_path), ByteTokenizer())
    # Mid-rewrite the directory must not look complete, nor keep the old run's shards.
    assert not os.path.exists(tmp_path / "meta.json")
    assert not list(tmp_path.glob("tokens-*.npy"))
    writer.add("x" * 10)
    assert writer.close()["num_tokens"] == 11


# ---------------------------------------------------------------------------------------------
# Grain pipelines


@pytest.fixture(scope="module")
def unique_rows(tmp_path_factory):
    """A split whose rows are pairwise distinct, plus a map from row inputs back to row index."""
    path = tmp_path_factory.mktemp("rows")
    rng = np.random.default_rng(7)
    _write_split(path, rng, n_docs=60, max_len=40)
    seq_len = 16
    source = PackedSource(str(path), seq_len)
    index = {source[i]["tokens"][:-1].tobytes(): i for i in range(len(source))}
    assert len(index) == len(source)  # random text: distinct rows, so inputs identify the row
    return str(path), seq_len, index


def _row_ids(batches, index):
    return [index[row.astype(np.int32).tobytes()] for b in batches for row in b["inputs"]]


def test_train_stream_epochs_are_fresh_permutations(unique_rows):
    path, seq_len, index = unique_rows
    n, batch = len(index), 4
    it = SampleStream(path, seq_len, 11)
    batches = [it.take(batch) for _ in range(-(-2 * n // batch))]
    assert all(b["inputs"].shape == (batch, seq_len) for b in batches)
    assert set(batches[0]) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    ids = _row_ids(batches, index)
    epoch1, epoch2 = ids[:n], ids[n:2 * n]
    assert sorted(epoch1) == list(range(n)) and sorted(epoch2) == list(range(n))
    assert epoch1 != epoch2
    assert epoch1 != list(range(n))  # actually shuffled
    other = _row_ids([SampleStream(path, seq_len, 12).take(batch)], index)
    assert other != epoch1[:batch]  # the seed matters


def test_train_processes_split_one_global_stream(unique_rows):
    path, seq_len, index = unique_rows
    n, batch = len(index), 2
    steps = -(-n // (2 * batch))
    one = SampleStream(path, seq_len, 3, prefetch=0)
    single = _row_ids([one.take(2 * batch) for _ in range(steps)], index)
    streams = [SampleStream(path, seq_len, 3, p, 2, prefetch=0) for p in range(2)]
    per_process = [_row_ids([s.take(2 * batch) for _ in range(steps)], index) for s in streams]
    # Process p holds global stream items p, p+2, ...: disjoint, together one epoch.
    assert not set(per_process[0][:n // 2]) & set(per_process[1][:n // 2])
    assert sorted(per_process[0][:(n + 1) // 2] + per_process[1][:n // 2]) == list(range(n))
    # Step k's global batch is the same rows whether one or two processes read it.
    for k in range(steps):
        step = slice(k * batch, (k + 1) * batch)
        together = per_process[0][step] + per_process[1][step]
        assert sorted(together) == sorted(single[k * 2 * batch:(k + 1) * 2 * batch])


def test_train_stream_state_round_trips_through_json(unique_rows):
    path, seq_len, _ = unique_rows
    rng = np.random.default_rng(8)
    it = SampleStream(path, seq_len, 5, prefetch=2, prefetch_rows=6)
    for _ in range(int(rng.integers(3, 30))):
        it.take(3)
    state = json.dumps(it.get_state())
    expected = [it.take(3) for _ in range(3)]
    fresh = SampleStream(path, seq_len, 5, prefetch=2, prefetch_rows=6)
    first = fresh.take(3)
    fresh.set_state(json.loads(state))
    resumed = [fresh.take(3) for _ in range(3)]
    assert not np.array_equal(first["inputs"], expected[0]["inputs"])  # restoring mattered
    for want, got in zip(expected, resumed):
        assert set(want) == set(got)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_eval_batches_sequential_and_deterministic(unique_rows):
    path, seq_len, index = unique_rows
    n = len(index)
    a = eval_batches(path, seq_len, batch=4, max_batches=3)
    b = eval_batches(path, seq_len, batch=4, max_batches=3)
    assert len(a) == 3
    assert _row_ids(a, index) == list(range(12))
    for x, y in zip(a, b):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    assert len(eval_batches(path, seq_len, batch=4, max_batches=10**6)) == n // 4
    with pytest.raises(DataError, match="fewer than one eval batch"):
        eval_batches(path, seq_len, batch=n + 1, max_batches=1)


# ---------------------------------------------------------------------------------------------
# prepare


def test_prepare_text_paragraphs(tmp_path):
    rng = np.random.default_rng(9)
    paragraphs = [random_text(rng).replace("\n", " ").strip() or "z" for _ in range(30)]
    (tmp_path / "in").mkdir()
    for f in range(3):
        (tmp_path / "in" / f"part{f}.txt").write_text("\n\n".join(paragraphs[f * 10:(f + 1) * 10]))
    result = prepare_text([str(tmp_path / "in")], "text", "byte", str(tmp_path / "out"),
                     eval_fraction=0.2, seed=1, split_on_blank_lines=True)
    tok = ByteTokenizer()
    train, ev = split_docs(result["train_dir"], tok), split_docs(result["eval_dir"], tok)
    assert train and ev
    assert sorted(train + ev) == sorted(paragraphs)
    assert result["train"]["num_docs"] + result["eval"]["num_docs"] == len(paragraphs)
    # The function and its CLI module have different names, so neither hides the other.
    import dsjax.data
    assert dsjax.data.prepare is sys.modules["dsjax.data.prepare"]
    assert dsjax.data.prepare_text is dsjax.data.prepare.prepare_text


def test_prepare_cli_jsonl(tmp_path):
    rng = np.random.default_rng(10)
    docs = random_docs(rng, 50, max_len=60)
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:25]) + "\n\n")  # blank lines are skipped
    (tmp_path / "b.jsonl").write_text("\n".join(lines[25:]) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dsjax.data.prepare", "--input", str(tmp_path / "*.jsonl"),
         "--format", "jsonl", "--jsonl_field", "body", "--out", str(out), "--eval_fraction", "0.1",
         "--shard_tokens", "500"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and proc.stderr == ""
    tok = ByteTokenizer()
    train, ev = split_docs(out / "train", tok), split_docs(out / "eval", tok)
    assert sorted(train + ev) == sorted(docs) and train and ev
    assert len(json.load(open(out / "train" / "meta.json"))["shards"]) > 1
    PackedSource(str(out / "train"), 32)  # what prepare wrote, the reader accepts


def test_prepare_cli_rejects_bad_input_with_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": oops}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "dsjax.data.prepare", "--input", str(bad), "--format", "jsonl",
         "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad}:3: invalid JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # failed before writing anything


@pytest.mark.parametrize("case", ["missing_file", "missing_field", "not_object", "empty", "one_doc",
                                  "bad_utf8"])
def test_prepare_bad_inputs(tmp_path, capsys, case):
    path = tmp_path / "in.jsonl"
    fmt = "jsonl"
    if case == "missing_file":
        path, want = tmp_path / "absent.txt", "absent.txt: input file not found"
    elif case == "missing_field":
        path.write_text('{"text": "a"}\n{"txt": "b"}\n')
        want = f"{path}:2: missing field 'text'"
    elif case == "not_object":
        path.write_text('{"text": "a"}\n["b"]\n')
        want = f"{path}:2: expected a JSON object"
    elif case == "empty":
        path.write_text("\n\n")
        want = "empty input"
    elif case == "one_doc":
        path.write_text('{"text": "only"}\n')
        want = "only 1 document"
    else:
        path = tmp_path / "in.txt"
        path.write_bytes(b"good line\nbad \xff byte\n")
        fmt, want = "text", f"{path}:2: not valid UTF-8"
    out = tmp_path / "out"
    assert prepare_main(["--input", str(path), "--format", fmt, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert want in err, err
    assert not (out / "train" / "meta.json").exists()


# ---------------------------------------------------------------------------------------------
# stdlib corpus


def test_stdlib_corpus_split_and_cache(tmp_path, capsys):
    cache = tmp_path / "stdlib"
    train_dir, eval_dir = build_stdlib_corpus(str(cache), eval_fraction=0.1, max_bytes=1_500_000)
    assert "train" in capsys.readouterr().out
    tok = ByteTokenizer()
    train, ev = split_docs(train_dir, tok), split_docs(eval_dir, tok)
    assert train and ev
    assert not set(train) & set(ev)  # each document is a whole file: no file in both
    assert any("def " in doc for doc in train)
    meta = json.load(open(os.path.join(train_dir, "meta.json")))
    assert meta["tokenizer"] == "byte" and meta["num_bytes"] <= 1_500_000
    assert len(PackedSource(eval_dir, 64)) > 0

    mtimes = [os.stat(os.path.join(d, "meta.json")).st_mtime_ns for d in (train_dir, eval_dir)]
    again = build_stdlib_corpus(str(cache), eval_fraction=0.1, max_bytes=1_500_000)
    assert again == (train_dir, eval_dir)
    assert [os.stat(os.path.join(d, "meta.json")).st_mtime_ns for d in again] == mtimes
    assert capsys.readouterr().out == ""  # a cache hit builds nothing
    # Other settings are not a cache hit.
    build_stdlib_corpus(str(cache), eval_fraction=0.2, max_bytes=1_500_000)
    assert len(split_docs(eval_dir, tok)) > len(ev)
    assert not list(cache.glob(".build-*"))  # the temp build dir is gone


def _prepared_corpus(tmp_path):
    rng = np.random.default_rng(11)
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(random_text(rng).replace("\n", " ").strip() or "z"
                                for _ in range(20)))
    out = tmp_path / "mine"
    prepare_text([str(docs)], "text", "byte", str(out), eval_fraction=0.3,
                 split_on_blank_lines=True)
    return docs, out


def test_the_stdlib_corpus_never_replaces_a_prepared_corpus(tmp_path):
    """data.path pointing at a prepared corpus with data.source='stdlib' (the default) is one
    DataError naming both fields; every file of the user's corpus stays byte-identical."""
    from dsjax import config as config_lib
    from dsjax.data.splits import data_splits

    _, out = _prepared_corpus(tmp_path)
    before = file_digests(out)
    cfg = config_lib.load(os.path.join(REPO, "configs", "cpu_tiny.py"), {"data.path": str(out)})
    with pytest.raises(DataError, match=r"^data\.path: .* holds a prepared corpus .*"
                                        r"data\.source='prepared'"):
        data_splits(cfg, str(tmp_path / "run"))
    assert file_digests(out) == before and sorted(os.listdir(out)) == ["eval", "train"]
    # Any other file dsjax did not write is refused the same way, and kept.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"files dsjax did not write \(notes\.txt\)"):
        build_stdlib_corpus(str(other), max_bytes=200_000)
    assert os.listdir(other) == ["notes.txt"]
    # A cache of its own (other settings) it does rebuild.
    cache = tmp_path / "cache"
    build_stdlib_corpus(str(cache), max_bytes=200_000)
    build_stdlib_corpus(str(cache), eval_fraction=0.2, max_bytes=200_000)


def test_an_eval_split_too_small_for_one_batch_fails_before_training(tmp_path):
    """The held-out split is sized against one eval batch when the run finds its data, so a
    corpus that cannot be evaluated stops before step 1 (not after the last), naming the split
    and both sizes."""
    from dsjax import config as config_lib
    from dsjax.data.splits import data_splits

    _, out = _prepared_corpus(tmp_path)
    flags = {"data.source": "prepared", "data.path": str(out), "data.seq_len": 8}
    rows = len(PackedSource(str(out / "eval"), 8))
    fits, too_big = 8 * (rows // 8), 8 * (rows // 8 + 1)  # batches cpu_tiny's mesh divides
    assert fits >= 8
    cfg = config_lib.load(os.path.join(REPO, "configs", "cpu_tiny.py"),
                          {**flags, "data.global_batch": fits})
    assert data_splits(cfg, str(tmp_path / "run")).eval == str(out / "eval")
    cfg = config_lib.load(os.path.join(REPO, "configs", "cpu_tiny.py"),
                          {**flags, "data.global_batch": too_big})
    with pytest.raises(DataError, match=rf"^{re.escape(str(out / 'eval'))}: {rows} rows of "
                                        rf"data\.seq_len=8, fewer than one eval batch of "
                                        rf"data\.global_batch={too_big}; "):
        data_splits(cfg, str(tmp_path / "run"))


def test_prepare_refuses_to_overwrite_existing_splits(tmp_path, capsys):
    docs, out = _prepared_corpus(tmp_path)
    before = file_digests(out)
    with pytest.raises(DataError, match=r"exist already; nothing was written.*--overwrite"):
        prepare_text([str(docs)], "text", "byte", str(out), eval_fraction=0.5)
    assert prepare_main(["--input", str(docs), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert file_digests(out) == before
    result = prepare_text([str(docs)], "text", "byte", str(out), eval_fraction=0.5,
                     split_on_blank_lines=True, overwrite=True)
    assert file_digests(out) != before and result["eval"]["num_docs"] >= 1
