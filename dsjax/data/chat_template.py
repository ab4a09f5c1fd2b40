"""Chat templates: a conversation -> the text a chat model reads, its token ids, and the loss mask
that trains only on the assistant's replies (SFT / DPO).

A template is a Jinja2 string rendered as Hugging Face's `apply_chat_template` renders
`chat_template` (a sandboxed environment with trim_blocks and lstrip_blocks, `raise_exception`,
and the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`). A Hugging Face
tokenizer brings its own (tokenizer_config.json beside tokenizer.json); the byte tokenizer gets
`BYTE_TEMPLATE`, DeepSeek-LLM's chat format.

The one idea: the mask comes from the text, not from the tokens. Rendering the conversation's
growing prefixes shows which characters each message adds (so the template must be
prefix-stable); in an assistant message's part, its content and the eos right after it are the
reply. The whole rendering is encoded once, and a token is masked when its characters overlap a
reply, as transformers' `return_assistant_tokens_mask` masks what `{% generation %}` encloses:
a BPE token that joins a header's space to the reply's first word counts as reply, which is
what the model emits after the generation prompt.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
from typing import Sequence

import jinja2
import jinja2.ext
import numpy as np
from jinja2 import sandbox

from dsjax.errors import DataError

ROLES = ("system", "user", "assistant")
# The byte tokenizer has no spelling for eos (id 256): templates write DeepSeek's, and encoding
# maps the string to the id.
BYTE_EOS = "<｜end▁of▁sentence｜>"
# DeepSeek-LLM chat: "[system]\n\nUser: ...\n\nAssistant: ...<eos>User: ...". The generation prompt
# is the assistant header as training renders it, "Assistant: " with its space, because with byte
# tokens that space is a token of its own that no reply trains.
BYTE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")
# Special-token variables Hugging Face passes a template (its special_tokens_map), when set.
_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
               "mask_token")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, Hugging Face's marker of assistant text, renders
    its body unchanged: the mask here comes from the rendered prefixes, so templates that carry
    the marker and templates that do not are read alike."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> sandbox.ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols",
                                                            _GenerationBlock])
    env.globals["raise_exception"] = raise_exception
    # Llama 3 templates date their system header with it.
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                  indent=indent)
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special-token strings it renders.

    `source` names where it came from (errors and meta.json say it); `specials` maps strings the
    tokenizer cannot spell to their ids (the byte tokenizer's eos), replaced while encoding.
    """

    def __init__(self, text: str, source: str, tokens: dict[str, str],
                 specials: dict[str, int] | None = None):
        self.text, self.source = text, source
        self.tokens = dict(tokens)
        self.specials = dict(specials or {})
        self.eos_token = self.tokens.get("eos_token")
        try:
            self._compiled = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"{source}: chat template is not valid Jinja (line {e.lineno}: "
                            f"{e.message})") from None
        self._split = (re.compile("(" + "|".join(map(re.escape, self.specials)) + ")")
                       if self.specials else None)

    @property
    def digest(self) -> str:
        """A short hash of the template text (stored in meta.json)."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()[:16]

    @classmethod
    def for_tokenizer(cls, spec: str) -> "ChatTemplate":
        """"byte" -> `BYTE_TEMPLATE`; a tokenizer.json path (or its directory) -> the
        `chat_template` of tokenizer_config.json beside it (or of chat_template.jinja)."""
        if spec == "byte":
            return cls(BYTE_TEMPLATE, "byte (built-in DeepSeek chat template)",
                       {"bos_token": "", "eos_token": BYTE_EOS}, {BYTE_EOS: 256})
        folder = spec if os.path.isdir(spec) else os.path.dirname(spec)
        config_path = os.path.join(folder, "tokenizer_config.json")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        how = ("a Hugging Face chat model's tokenizer_config.json carries its `chat_template`; "
               "copy it beside tokenizer.json")
        if not os.path.isfile(config_path):
            raise DataError(f"{config_path}: not found; chat data needs the tokenizer's chat "
                            f"template ({how})")
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{config_path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise DataError(f"{config_path}: expected a JSON object")
        text, source = config.get("chat_template"), config_path
        if isinstance(text, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
            text = named.get("default")
        if text is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                text, source = f.read(), jinja_path
        if not isinstance(text, str) or not text:
            raise DataError(f"{config_path}: has no 'chat_template' (and there is no "
                            f"{jinja_path}); chat data needs one: {how}, or add a Jinja "
                            f"template under 'chat_template'")
        tokens = {k: _token_text(config.get(k)) for k in _TOKEN_KEYS}
        return cls(text, source, {k: v for k, v in tokens.items() if v is not None})

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the model reads it; a template error is a DataError."""
        try:
            return self._compiled.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self.tokens)
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. a str + a non-str
            raise DataError(f"chat template {self.source}: {e}") from None

    def encode(self, tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32[n], character offsets int64[n, 2]) of `text`; `specials` become their ids."""
        if self._split is None:
            return tokenizer.encode_offsets(text)
        ids, offsets, at = [], [], 0
        for piece in self._split.split(text):
            if piece in self.specials:
                ids.append(np.array([self.specials[piece]], np.int32))
                offsets.append(np.array([[at, at + len(piece)]], np.int64))
            elif piece:
                piece_ids, piece_offsets = tokenizer.encode_offsets(piece)
                ids.append(piece_ids)
                offsets.append(piece_offsets + at)
            at += len(piece)
        if not ids:
            return np.zeros(0, np.int32), np.zeros((0, 2), np.int64)
        return np.concatenate(ids).astype(np.int32), np.concatenate(offsets)

    def reply_spans(self, messages: Sequence[dict], last_only: bool = False
                    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and the [start, end) characters of each assistant reply in it (its
        content and the eos right after it); only the last message's with `last_only`."""
        # Not render([]): many templates read messages[0] unconditionally.
        rendered, spans = "", []
        for k, message in enumerate(messages):
            longer = self.render(messages[:k + 1])
            if not longer.startswith(rendered):
                raise DataError(f"chat template {self.source} is not prefix-stable: the "
                                f"rendering of the first {k + 1} messages does not begin with "
                                f"that of the first {k}, so replies cannot be located in it")
            if message["role"] == "assistant" and (not last_only or k == len(messages) - 1):
                spans.append(self._reply_span(longer, len(rendered), message["content"]))
            rendered = longer
        return rendered, spans

    def _reply_span(self, rendered: str, begin: int, content: str) -> tuple[int, int]:
        part = rendered[begin:]
        # The last occurrence: a header ("Assistant: ") comes before the content, never after it.
        found = part.rfind(content)
        if found < 0 and content.strip():
            content = content.strip()  # templates that trim the content
            found = part.rfind(content)
        if found < 0 or not content:
            raise DataError(f"chat template {self.source} does not render an assistant "
                            f"message's content as it is, so its reply cannot be located")
        end = found + len(content)
        eos = self.eos_token
        if eos and part[end:].lstrip(" \t\n").startswith(eos):
            end = part.index(eos, end) + len(eos)
        return begin + found, begin + end


def encode_chat(template: ChatTemplate, tokenizer, messages: Sequence[dict],
                last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32[n], loss_mask bool[n]): True exactly on the tokens of the assistant replies
    (content and end-of-turn eos), not on headers, system or user text. `last_only`: the last
    message's reply alone (a preference pair's prompt may hold earlier assistant turns)."""
    text, spans = template.reply_spans(messages, last_only)
    ids, offsets = template.encode(tokenizer, text)
    mask = np.zeros(ids.size, bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return ids, mask


def prompt_ids(template: ChatTemplate, tokenizer, messages: Sequence[dict]) -> np.ndarray:
    """The ids a chat model continues to answer `messages` (which end with a user turn)."""
    if not messages or messages[-1].get("role") != "user":
        last = messages[-1].get("role") if messages else "nothing"
        raise DataError(f"a generation prompt ends with a user turn, got {last}")
    ids, _ = template.encode(tokenizer, template.render(messages, add_generation_prompt=True))
    return ids
