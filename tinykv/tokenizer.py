"""Tokenizer: text <-> token ids, the model's chat template, and streaming detokenization.

A thin layer over the `tokenizers` library (which does the BPE work from `tokenizer.json`) plus
the few facts that live in the other files of a Hugging Face-style model folder: BOS/EOS tokens,
whether to add BOS, and the Jinja chat template (rendered with `jinja2`, as transformers does).
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .modelfiles import Fields


class TokenizerError(ValueError):
    """A missing or unusable tokenizer file; the message is one line meant for the user."""


def _tojson(x: object, indent: int | None = None) -> str:
    """transformers' `tojson` filter for chat templates: non-ASCII characters kept as they are."""
    return json.dumps(x, ensure_ascii=False, indent=indent)


class Tokenizer:
    """encode/decode with a model's tokenizer.json; `eos_ids` are all the ids that end
    generation."""

    def __init__(self, tok: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, add_bos: bool, eos_ids: set[int],
                 vocab_size: int | None = None):
        self.tok, self.chat_template = tok, chat_template
        self.add_bos, self.eos_ids = add_bos, eos_ids
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = tok.token_to_id(bos_token) if bos_token else None
        self.vocab_size = vocab_size  # the model's embedding rows (config.json), when known

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face-style model folder (tokenizer.json and its configs)."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise TokenizerError(f"no tokenizer.json in {path} "
                                 "(`python -m tinykv fetch` gets the default)")
        try:
            tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            first = (str(e).strip().splitlines() or ["unreadable"])[0]
            raise TokenizerError(f"malformed {path / 'tokenizer.json'}: {first}") from None
        tcfg = Fields.load(path / "tokenizer_config.json")
        bos, eos_token = tcfg.token("bos_token"), tcfg.token("eos_token")
        config = Fields.load(path / "config.json")
        eos = set(config.ids("eos_token_id"))
        eos |= set(Fields.load(path / "generation_config.json").ids("eos_token_id"))
        if eos_token and tok.token_to_id(eos_token) is not None:
            eos.add(tok.token_to_id(eos_token))
        template = tcfg.chat_template()
        # A chat turn ends with the terminator the template writes after each message (e.g.
        # <|im_end|>); a model that emits it is done even when the config names another eos token.
        for added in tok.get_added_tokens_decoder().values():
            name = added.content
            ends = "end" in name or "eot" in name
            if added.special and name in (template or "") and ends:
                eos.add(tok.token_to_id(name))
        return cls(tok, template, bos, eos_token, tcfg.bool("add_bos_token", False), eos,
                   config.int("vocab_size", None, lo=1))

    def encode(self, text: str) -> list[int]:
        try:  # a lone surrogate (a JSON "\ud800", a byte of another encoding) is no text
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"the text holds U+{ord(text[e.start]):04X} at character "
                                 f"{e.start}, a lone surrogate, not a character") from None
        # Special tokens written in the text (e.g. "<|im_start|>") become their single ids.
        ids = self.tok.encode(text, add_special_tokens=False).ids
        ids = [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids
        # A tokenizer.json from another model gives ids the embedding has no row for: said here,
        # not as an index error deep in the first forward pass.
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            raise TokenizerError(f"the tokenizer gives token id {max(ids)}, past the model's "
                                 f"{self.vocab_size} tokens (config.json's vocab_size): "
                                 "tokenizer.json is not this model's")
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; run without --chat")

        def raise_exception(message: str):
            raise TemplateError(message)

        # Same environment settings as transformers, so the rendered text matches it byte for byte.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from e


class StreamDecoder:
    """Turns ids arriving one at a time into text pieces, never splitting a multi-byte character.

    Decoding ids one by one would break characters whose UTF-8 bytes span several tokens, and some
    decoders change a piece depending on what precedes it. So each step decodes a short window
    (the previous piece + new ids) and emits only what extends the previous piece's text, holding
    back while the text ends in U+FFFD (an incomplete character).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        # ids[prefix:read] is the last emitted piece; ids[read:] are pending.
        self.prefix = self.read = 0

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def feed(self, token_id: int) -> str:
        """The text one more id adds ("" while it is held back)."""
        self.ids.append(int(token_id))
        before = self._text(self.ids[self.prefix:self.read])
        text = self._text(self.ids[self.prefix:])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """Whatever is still held back (e.g. a character cut off by the end of generation)."""
        before = self._text(self.ids[self.prefix:self.read])
        text = self._text(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]
