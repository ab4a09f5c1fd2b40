"""Chat and preference data (dsjax.data.chat_template, chat_prepare, chat_source): the loss mask
against transformers', the byte template against hand-written text, packing, bad records, the
task checks and the CLI. Expected values are written by hand or come from transformers."""

import json
import os
import pickle
import re

import numpy as np
import pytest

from conftest import FLAT_MESH, file_digests
from dsjax.data import (ByteTokenizer, ChatSource, DataError, SampleStream, eval_batches,
                        load_tokenizer, make_example)
from dsjax.data.chat_prepare import prepare_chat
from dsjax.data.chat_template import BYTE_EOS, ChatTemplate, encode_chat, prompt_ids
from dsjax.data.prepare import main as prepare_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 256  # the byte tokenizer's eos id

# DeepSeek-style, with Hugging Face's {% generation %} marker around what the mask should cover.
HF_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% else %}{{ 'Assistant: ' }}{% generation %}{{ message['content'] + eos_token }}"
    "{% endgeneration %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
# ChatML, reading messages[0] (so it cannot render an empty conversation), eos <|im_end|>, and a
# newline after each turn that is not the reply's.
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"},
     {"role": "assistant", "content": "Hello! How are you?"}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "And three plus three?"},
     {"role": "assistant", "content": "Six, of course. Café ünïcode"}],
]


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _hf_tokenizer_dir(path, config):
    """A byte-level BPE trained on a few chat lines (so merges like ' Hello' cross the header's
    space into the reply), saved with `config` as tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = ["User: Hello there", "Assistant: Hello! How are you?", "What is two plus two?",
             "Assistant: Four.", "And three plus three? Six, of course."] * 20
    tok.train_from_iterator(lines, trainer)
    path.mkdir(exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("chat_template,eos,straddling", [(HF_TEMPLATE, "</s>", 1),
                                                          (CHATML_TEMPLATE, "<|im_end|>", 0)])
def test_mask_matches_transformers(tmp_path, chat_template, eos, straddling):
    """ids and mask equal transformers' apply_chat_template(return_assistant_tokens_mask=True)
    on the same tokenizer and template, including tokens that join the header's space to the
    reply's first word (both count them as reply)."""
    from transformers import AutoTokenizer
    folder = _hf_tokenizer_dir(tmp_path / "tok", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": eos,
        "chat_template": chat_template})
    hf = AutoTokenizer.from_pretrained(folder)
    template, tokenizer = ChatTemplate.for_tokenizer(folder), load_tokenizer(folder)
    straddles = 0
    for messages in CONVERSATIONS:
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, mask = encode_chat(template, tokenizer, messages)
        assert ids.tolist() == list(ref["input_ids"])
        assert mask.astype(int).tolist() == list(ref["assistant_masks"])
        straddles += sum(hf.convert_ids_to_tokens(int(i)) == "ĠHello" for i in ids[mask])
        gen = hf.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)
        assert prompt_ids(template, tokenizer, messages[:-1]).tolist() == list(gen["input_ids"])
    # The case where a characters-inside-the-reply rule would differ.
    assert straddles == straddling


def test_byte_template_renders_deepseek_chat():
    template, tok = ChatTemplate.for_tokenizer("byte"), ByteTokenizer()
    messages = [{"role": "system", "content": "Be kind."}, _user("Hi é"),
                _assistant("Héllo!"), _user("Bye"), _assistant("Ciao")]
    expected = ("Be kind.\n\nUser: Hi é\n\nAssistant: Héllo!<｜end▁of▁sentence｜>"
                "User: Bye\n\nAssistant: Ciao<｜end▁of▁sentence｜>")
    assert template.render(messages) == expected
    pieces = [("Be kind.\n\nUser: Hi é\n\nAssistant: ", False), ("Héllo!", True), (None, True),
              ("User: Bye\n\nAssistant: ", False), ("Ciao", True), (None, True)]
    want_ids, want_mask = [], []
    for text, masked in pieces:
        ids = [EOS] if text is None else list(text.encode("utf-8"))
        want_ids += ids
        want_mask += [masked] * len(ids)
    ids, mask = encode_chat(template, tok, messages)
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    assert ids.dtype == np.int32 and mask.dtype == bool
    # Only the last reply, for a preference pair whose prompt has an earlier assistant turn.
    _, last = encode_chat(template, tok, messages, last_only=True)
    assert last.tolist() == [False] * (len(want_mask) - 5) + [True] * 5
    # The generation prompt is the training header, space included.
    assert prompt_ids(template, tok, messages[:4]).tolist() == list(
        "Be kind.\n\nUser: Hi é\n\nAssistant: Héllo!".encode()) + [EOS] + list(
        "User: Bye\n\nAssistant: ".encode())
    with pytest.raises(DataError, match="ends with a user turn"):
        prompt_ids(template, tok, messages)


def test_template_errors_name_the_file(tmp_path):
    folder = tmp_path / "tok"
    _hf_tokenizer_dir(folder, {"eos_token": "</s>"})
    with pytest.raises(DataError, match=r"tokenizer_config\.json: has no 'chat_template'"):
        ChatTemplate.for_tokenizer(str(folder / "tokenizer.json"))
    os.remove(folder / "tokenizer_config.json")
    with pytest.raises(DataError, match=r"tokenizer_config\.json: not found; chat data needs"):
        ChatTemplate.for_tokenizer(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(DataError, match=r"tokenizer_config\.json: chat template is not valid"):
        ChatTemplate.for_tokenizer(str(folder))
    # A template that renders earlier turns differently once later ones exist.
    unstable = ChatTemplate("{% for m in messages %}{{ m.content }}{% if loop.last %}!"
                            "{% endif %}{% endfor %}", "mine.jinja", {})
    with pytest.raises(DataError, match=r"mine\.jinja is not prefix-stable"):
        encode_chat(unstable, ByteTokenizer(), [_user("a"), _assistant("b")])


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _byte_text(messages):
    """The byte template's rendering, written out by hand (BYTE_EOS for eos)."""
    out = ""
    for m in messages:
        out += {"system": m["content"] + "\n\n", "user": "User: " + m["content"] + "\n\n",
                "assistant": "Assistant: " + m["content"] + BYTE_EOS}[m["role"]]
    return out


def _byte_len(text):
    return len(text.replace(BYTE_EOS, "\0").encode())


def _decode(tokens):
    """Byte ids -> text, eos written as BYTE_EOS where it stands."""
    out, piece = "", []
    for t in tokens.tolist():
        if t == EOS:
            out, piece = out + bytes(piece).decode() + BYTE_EOS, []
        else:
            piece.append(t)
    return out + bytes(piece).decode()


def test_chat_rows_pack_whole_examples(tmp_path):
    rng = np.random.default_rng(0)
    records = []
    for i in range(30):
        words = " ".join(rng.choice(["ab", "cde", "f", "ghij"], size=rng.integers(1, 6)))
        records.append({"messages": [_user(f"q{i} {words}"), _assistant(f"a{i} {words[::-1]}")]})
    seq_len = 80  # examples are 28 to 76 tokens
    result = prepare_chat(_write_jsonl(tmp_path / "c.jsonl", records), "chat", "byte",
                          str(tmp_path / "out"), seq_len, eval_fraction=0.0, shard_tokens=200)
    assert result["skipped"] == []
    source = ChatSource(result["train_dir"], seq_len)
    texts = {_byte_text(r["messages"]): r for r in records}
    seen, used = [], []  # the examples in row order; the tokens each row holds
    for i in range(len(source)):
        row = source[i]
        tokens, seg, mask = row["tokens"], row["segment_ids"], row["target_mask"]
        assert tokens.shape == seg.shape == mask.shape == (seq_len + 1,)
        n = int(np.sum(seg > 0))
        assert np.all(seg[n:] == 0) and np.all(tokens[n:] == 0) and not mask[n:].any()
        assert np.all(seg[:n] > 0) and seg[0] == 1 and set(np.diff(seg[:n])) <= {0, 1}
        for s in range(1, int(seg.max()) + 1):
            text = _decode(tokens[seg == s])
            assert text in texts  # a whole example, never a part of one
            seen.append(text)
            reply = texts[text]["messages"][-1]["content"]
            assert _decode(tokens[(seg == s) & mask]) == reply + BYTE_EOS
        # Weights are the mask shifted by one: the targets that are reply tokens.
        assert make_example(row)["weights"].tolist() == mask[1:].astype(np.float32).tolist()
        used.append(n)
    assert len(seen) == len(set(seen)) == result["train"]["num_examples"] == 29
    # Greedy, in order: a row closes where a shard ends or when the next example does not fit.
    shard_ends = set(np.cumsum([s["num_tokens"] for s in result["train"]["shards"]]).tolist())
    assert len(shard_ends) > 1
    first_of_next = np.cumsum([int(source[i]["segment_ids"].max()) for i in range(len(source))])
    for i in range(len(source) - 1):
        next_length = _byte_len(seen[first_of_next[i]])
        assert sum(used[:i + 1]) in shard_ends or used[i] + next_length > seq_len + 1
    # A longer seq_len reads the same split; a shorter one that cuts an example is refused.
    assert len(ChatSource(result["train_dir"], 4 * seq_len)) < len(source)
    with pytest.raises(DataError, match=r"longest example is \d+ tokens.*--seq_len 80.*"
                                        r"Prepare it again with --seq_len 20"):
        ChatSource(result["train_dir"], 20)
    clone = pickle.loads(pickle.dumps(source))
    assert all(np.array_equal(clone[3][k], source[3][k]) for k in source[3])


def test_preference_rows_hold_pairs(tmp_path):
    records = [{"prompt": [_user("Hi"), _assistant("Hey"), _user(f"Pick {i}")],
                "chosen": f"Good {i}", "rejected": f"Bad answer {i}"} for i in range(6)]
    records.append({"prompt": "Plain prompt", "chosen": "Yes", "rejected": "No"})
    result = prepare_chat(_write_jsonl(tmp_path / "p.jsonl", records), "preference", "byte",
                          str(tmp_path / "out"), 200, eval_fraction=0.3)
    assert result["train"]["format"] == "dsjax-preference-v1"
    assert result["train"]["num_examples"] + result["eval"]["num_examples"] == 7
    by_prompt = {}
    for r in records:
        prompt = [_user(r["prompt"])] if isinstance(r["prompt"], str) else r["prompt"]
        by_prompt[_byte_text(prompt)] = r
    pairs = 0
    for split in ("train_dir", "eval_dir"):
        source = ChatSource(result[split], 200)
        assert source.kind == "preference"
        for i in range(len(source)):
            row = source[i]
            seg, tokens, mask = row["segment_ids"], row["tokens"], row["target_mask"]
            assert int(seg.max()) % 2 == 0
            for j in range(1, int(seg.max()) // 2 + 1):
                chosen, rejected = (_decode(tokens[seg == s]) for s in (2 * j - 1, 2 * j))
                prompt = chosen[:chosen.rindex("Assistant: ") + len("Assistant: ")]
                record = by_prompt[prompt[:-len("Assistant: ")]]
                assert chosen == prompt + record["chosen"] + BYTE_EOS
                assert rejected == prompt + record["rejected"] + BYTE_EOS
                # Only the replies are trained, not the prompt's earlier assistant turn.
                assert _decode(tokens[(seg == 2 * j - 1) & mask]) == record["chosen"] + BYTE_EOS
                assert _decode(tokens[(seg == 2 * j) & mask]) == record["rejected"] + BYTE_EOS
                pairs += 1
    assert pairs == 7


CHAT_BAD = [
    ("not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"text": "hi"}, "missing field 'messages'"),
    ({"messages": []}, "field 'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, r"messages\[0\] is str, expected an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]: unknown role 'bot'"),
    ({"messages": [_user("a"), {"role": "assistant", "content": ["b"]}]},
     r"messages\[1\]: content is list, expected a string"),
    ({"messages": [_user("only a question")]}, "no assistant turn"),
    ({"messages": [_user("q"), _assistant("  ")]}, r"messages\[1\]: empty assistant content"),
    ({"messages": [_user("q"), _assistant("x" * 80)]},
     r"conversation is 101 tokens, longer than one row of --seq_len 64 \+ 1 = 65 tokens"),
]
PREFERENCE_BAD = [
    ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
    ({"prompt": [_user("q"), _assistant("a")], "chosen": "a", "rejected": "b"},
     "prompt must end with a user turn, ends with 'assistant'"),
    ({"prompt": "q", "rejected": "b"}, "field 'chosen' must be a non-empty string.*got missing"),
    ({"prompt": "q", "chosen": "a", "rejected": 3}, "field 'rejected' .* got int"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "the same reply"),
    ({"prompt": "q", "chosen": "y" * 20, "rejected": "n" * 20},
     r"chosen \(41 tokens\) and rejected \(41 tokens\) are 82 tokens together; a pair must fit "
     r"in one row of --seq_len 64"),
]


@pytest.mark.parametrize("fmt,bad", [("chat", CHAT_BAD), ("preference", PREFERENCE_BAD)])
def test_bad_records_are_named_skipped_and_counted(tmp_path, capsys, fmt, bad):
    good = ({"messages": [_user("q"), _assistant("fine")]} if fmt == "chat"
            else {"prompt": "q", "chosen": "yes", "rejected": "no"})
    # Good records first and last, bad ones between: line numbers are 2 .. len(bad) + 1.
    path = _write_jsonl(tmp_path / "in.jsonl", [good] + [r for r, _ in bad] + [
        dict(good, extra=1)])
    out = tmp_path / "out"
    code = prepare_main(["--format", fmt, "--input", path, "--out", str(out), "--seq_len", "64",
                         "--eval_fraction", "0.5"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == len(bad)
    for line_no, (line, (_, message)) in enumerate(zip(lines, bad), start=2):
        assert line.startswith(f"skipped {path}:{line_no}: ")
        assert re.search(message, line), (message, line)
    assert f"skipped {len(bad)} bad record(s)" in captured.out
    meta = json.loads((out / "train" / "meta.json").read_text())
    assert meta["skipped_records"] == len(bad) and meta["seq_len"] == 64


def test_a_failing_prepare_touches_nothing(tmp_path, capsys):
    good = [{"messages": [_user(f"q{i}"), _assistant(f"a{i}")]} for i in range(4)]
    out = tmp_path / "out"
    prepare_chat(_write_jsonl(tmp_path / "good.jsonl", good), "chat", "byte", str(out), 64,
                 eval_fraction=0.5)
    before = file_digests(out)
    stamps = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in before}
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [_user("q")]}, "nope"])
    with pytest.raises(DataError, match="exist already; nothing was written"):
        prepare_chat(bad, "chat", "byte", str(out), 64)
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable record \(2 bad record\(s\) "
                                        r"skipped\).*nothing was written"):
        prepare_chat(bad, "chat", "byte", str(out), 64, overwrite=True)
    assert file_digests(out) == before
    assert {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in before} == stamps
    fresh = tmp_path / "fresh"
    assert prepare_main(["--format", "chat", "--input", bad, "--out", str(fresh),
                         "--seq_len", "64"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: no assistant turn" in err and "error: " in err
    assert not fresh.exists()
    with pytest.raises(DataError, match="only 1 usable conversation"):
        prepare_chat(_write_jsonl(tmp_path / "one.jsonl", good[:1]), "chat", "byte",
                     str(fresh), 64)
    assert not fresh.exists()


def test_cli(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [_user(f"q{i}"), _assistant(f"a{i}")]} for i in range(6)])
    out = tmp_path / "out"
    assert prepare_main(["--format", "chat", "--input", path, "--out", str(out)]) == 2
    assert "--seq_len is required" in capsys.readouterr().err
    assert prepare_main(["--input", path, "--out", str(out), "--seq_len", "8"]) == 2
    assert "--seq_len is only for --format chat" in capsys.readouterr().err
    assert prepare_main(["--format", "chat", "--input", path, "--out", str(out),
                         "--seq_len", "32", "--eval_fraction", "0.3", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    train = json.loads((out / "train" / "meta.json").read_text())
    held = json.loads((out / "eval" / "meta.json").read_text())
    assert train["num_examples"] + held["num_examples"] == 6
    # Each example: "User: qN\n\nAssistant: aN" (23 bytes) + eos; the reply "aN" + eos is trained.
    assert train["num_tokens"] == 24 * train["num_examples"]
    assert train["num_target_tokens"] == 3 * train["num_examples"]
    assert (f"{out / 'train'}: {train['num_examples']} conversations, {train['num_tokens']} "
            f"tokens ({train['num_target_tokens']} trained)") in printed
    assert "skipped 0 bad record(s)" in printed
    assert sorted(os.listdir(out / "train")) == ["docs-00000.npy", "mask-00000.npy",
                                                 "meta.json", "tokens-00000.npy"]
    # Rows of 47 + 1 tokens hold exactly two such examples, which fill them.
    rows = ChatSource(str(out / "train"), 47)
    assert len(rows) == (train["num_examples"] + 1) // 2
    assert rows[0]["segment_ids"].tolist() == [1] * 24 + [2] * 24
    # Eval batches read it through the usual entry point: one example a row of 32, weights on
    # its reply's 3 tokens.
    batch = eval_batches(str(out / "eval"), 32, 1, 1)[0]
    assert batch["weights"].tolist() == [[0.0] * 20 + [1.0] * 3 + [0.0] * 9]
    # So does the training stream.
    taken = SampleStream(str(out / "train"), 32, seed=0, prefetch=0).take(2)
    assert taken["weights"].tolist() == [[0.0] * 20 + [1.0] * 3 + [0.0] * 9] * 2


def _config(path, task, **more):
    from dsjax import config as config_lib
    if task == "dpo":  # DPO starts from weights (any directory passes the config's check),
        more = {"checkpoint.init_from": str(path), **FLAT_MESH, **more}  # and is unpipelined
    return config_lib.load(os.path.join(REPO, "configs", "cpu_tiny.py"), {
        "data.source": "prepared", "data.path": str(path), "data.seq_len": 32,
        "data.global_batch": 8, "train.task": task, **more})


def test_the_task_must_read_its_kind_of_split(tmp_path):
    from dsjax import config as config_lib
    from dsjax.data.prepare import prepare_text
    from dsjax.data.splits import data_splits
    chat = [{"messages": [_user(f"q{i}"), _assistant(f"a{i}")]} for i in range(40)]
    pref = [{"prompt": f"q{i}", "chosen": "y", "rejected": "n"} for i in range(40)]
    prepare_chat(_write_jsonl(tmp_path / "c.jsonl", chat), "chat", "byte",
                 str(tmp_path / "chat"), 32, eval_fraction=0.5)
    prepare_chat(_write_jsonl(tmp_path / "p.jsonl", pref), "preference", "byte",
                 str(tmp_path / "pref"), 64, eval_fraction=0.5)
    (tmp_path / "t.txt").write_text("\n\n".join(f"paragraph {i} " * 40 for i in range(8)))
    prepare_text([str(tmp_path / "t.txt")], "text", "byte", str(tmp_path / "text"),
                 eval_fraction=0.5, split_on_blank_lines=True)
    run = str(tmp_path / "run")
    splits = data_splits(_config(tmp_path / "chat", "sft"), run)
    assert splits.kind == "chat" and not splits.pairs
    assert splits.train == str(tmp_path / "chat" / "train")
    splits = data_splits(_config(tmp_path / "pref", "dpo", **{"data.seq_len": 64}), run)
    assert splits.kind == "preference" and splits.pairs
    with pytest.raises(DataError, match=r"holds chat examples \(dsjax-chat-v1\).*"
                                        r"set train\.task='sft'"):
        data_splits(_config(tmp_path / "chat", "pretrain"), run)
    with pytest.raises(DataError, match=r"set train\.task='dpo'"):
        data_splits(_config(tmp_path / "pref", "pretrain"), run)
    with pytest.raises(DataError, match=r"'dpo' trains on preference splits.*holds chat.*"
                                        r"--format preference"):
        data_splits(_config(tmp_path / "chat", "dpo"), run)
    with pytest.raises(DataError, match=r"'sft' trains on chat splits.*holds text"):
        data_splits(_config(tmp_path / "text", "sft"), run)
    with pytest.raises(DataError, match=r"'sft' trains on a prepared chat split.*"
                                        r"data\.source is 'stdlib'"):
        data_splits(config_lib.load(os.path.join(REPO, "configs", "cpu_tiny.py"),
                                    {"train.task": "sft"}), run)
    # The pairs' split was prepared for 64: a row of 32 is refused before training.
    with pytest.raises(DataError, match=r"pref/train: its longest pair is 48 tokens, more than a "
                                        r"row of data\.seq_len=32 holds \(33\)"):
        data_splits(_config(tmp_path / "pref", "dpo"), run)
