"""Tokenizers behind one small interface: raw UTF-8 bytes, or a Hugging Face `tokenizer.json`.

Both expose `name`, `vocab_size`, `eos_id` (None when the vocabulary has no end-of-document token),
`is_byte`, `encode(text) -> int32 ids` (never adds special tokens: the shard writer appends eos
itself, so every tokenizer delimits documents the same way), `encode_offsets(text) -> (ids,
offsets int64[n, 2])` (each token's [start, end) in characters of `text`, what a chat template's
loss mask is cut by) and `decode(ids) -> str`.
"""

from __future__ import annotations

import os

import numpy as np

from dsjax.errors import DataError

# End-of-document spellings of the common open model families, most specific first
# (DeepSeek, Llama/Mistral, GPT-2/Qwen, Gemma).
_EOS_CANDIDATES = (
    "<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 is end-of-document. Lossless for any text."""

    name = "byte"
    vocab_size = 257
    eos_id = 256
    is_byte = True

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self.encode(text)
        # A byte belongs to the character its lead byte starts; continuation bytes are 10xxxxxx.
        char = np.cumsum((ids & 0xC0) != 0x80) - 1
        return ids, np.stack([char, char + 1], axis=1).astype(np.int64)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        # Special ids (eos) are not bytes; a window cut mid-character decodes with U+FFFD.
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer from `tokenizer.json` (or a directory holding one)."""

    is_byte = False

    def __init__(self, path: str):
        # Imported here so the byte-level path (the default) never loads the Rust extension.
        import tokenizers  # pylint: disable=g-import-not-at-top

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise DataError(
                f"{file}: tokenizer file not found (expected a Hugging Face tokenizer.json)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # The Rust side raises a bare Exception for every parse failure.
            raise DataError(f"{file}: not a valid Hugging Face tokenizer.json ({e})") from None
        self.name = path
        self.vocab_size = int(self._tok.get_vocab_size())
        self.eos_id = None
        for token in _EOS_CANDIDATES:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                self.eos_id = int(token_id)
                break

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int32), offsets

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._tok.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """`"byte"` -> ByteTokenizer; anything else is a path to a tokenizer.json (or its directory)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
