"""Text -> token shards on disk -> packed, shuffled, resumable Grain batches.

Shards hold a tokenized document stream; packing into rows of `seq_len + 1` tokens happens at read
time, so one prepared corpus serves every sequence length. Importing this package costs numpy only:
Grain (which imports JAX) is loaded when a stream is first built. `splits` (which imports JAX and
the config) says where a run's train and held-out shards are. Multimodal splits (`multimodal/`:
prepared, stored, packed, media decoded) hold images beside the tokens; `mixture` mixes sources
of either kind by weight. Chat and preference splits (SFT, DPO: `chat_prepare` writes them with
a `chat_template`'s loss mask, `chat_source` packs whole examples) are read the same way.
"""

from dsjax.errors import DataError
from dsjax.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from dsjax.data.shards import PackedSource, ShardWriter
from dsjax.data.chat_source import ChatSource
from dsjax.data.stream import SampleStream, eval_batches, make_example, open_split
from dsjax.data.stdlib_corpus import build_stdlib_corpus
from dsjax.data.multimodal.media import MediaError, load_image, load_video
from dsjax.data.multimodal.shards import MultimodalWriter
from dsjax.data.multimodal.pack import MultimodalSource
from dsjax.data.mixture import mixed_eval_batches, mixed_stream, parse_mix


def __getattr__(name):
    # `prepare_text` is loaded on first use: importing its module here would make
    # `python -m dsjax.data.prepare` run it twice (runpy warns). Its name differs from the
    # module's, so `dsjax.data.prepare` is always the module, whatever was imported first.
    if name == "prepare_text":
        from dsjax.data.prepare import prepare_text  # pylint: disable=g-import-not-at-top
        globals()["prepare_text"] = prepare_text
        return prepare_text
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DataError",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "PackedSource",
    "ShardWriter",
    "ChatSource",
    "open_split",
    "SampleStream",
    "eval_batches",
    "make_example",
    "build_stdlib_corpus",
    "MediaError",
    "load_image",
    "load_video",
    "MultimodalWriter",
    "MultimodalSource",
    "mixed_stream",
    "mixed_eval_batches",
    "parse_mix",
    "prepare_text",
]
