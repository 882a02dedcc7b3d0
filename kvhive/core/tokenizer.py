"""Text and chat messages to token ids and back, shared by the engine and the gateway (torch-free).

The BPE runs in the `tokenizers` library, built from a HF `tokenizer.json` or from a GGUF file's
vocabulary (`kvhive.core.gguf_vocab`: byte-level BPE split as llama.cpp splits it for the file's
`tokenizer.ggml.pre`, or SentencePiece merged by score as llama.cpp merges it). Control tokens
(`<|im_start|>`, ...) are registered as special added tokens, so they encode to single ids wherever
they appear in the text. Neither torch nor transformers is imported (a test checks it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from kvhive.core.chat_template import END_OF_TURN_TOKENS, ChatTemplate
from kvhive.core.gguf_vocab import SPACE_MARK, read_gguf_vocab
from kvhive.core.model_files import read_gguf_metadata

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# GPT-2's byte-level alphabet, reversed: the character a byte-level BPE vocabulary writes -> the byte.
# Printable Latin-1 bytes stand for themselves; the other 68 bytes take the code points from 256 on.
_PRINTABLE_BYTES = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_BYTE_OF_CHAR = {chr(b): b for b in _PRINTABLE_BYTES} | {
    chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _PRINTABLE_BYTES)}
# Tokens of the prompt decoded with the first output tokens, so a tokenizer whose decoding depends on
# the preceding token (sentencepiece's leading space) streams the same text it would decode in context.
_PROMPT_CONTEXT_TOKENS = 5

# Texts this long (characters) or longer are encoded without the GIL (about 10 ms of work and up).
GIL_FREE_CHARS = 16384


class Tokenizer:
    """A model's tokenizer and chat template: text and chat messages to token ids, and ids to text."""

    def __init__(
        self,
        backend: BackendTokenizer,
        name_or_path: str,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.name_or_path = name_or_path
        # Named special tokens ("bos_token", "eos_token", ...) -> their text; rendered into the template too.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = ChatTemplate(chat_template, self.special_tokens) if chat_template else None
        eos_ids = [self._id_of(self.special_tokens.get("eos_token")), *extra_eos_token_ids]
        if self.chat_template is not None:
            eos_ids += [self._id_of(t) for t in END_OF_TURN_TOKENS if self.chat_template.uses_token(t)]
        self._eos_token_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # A SentencePiece-style vocabulary: U+2581 for spaces, `<0xNN>` tokens for other bytes.
        self._byte_fallback = bool(getattr(backend.model, "byte_fallback", False))
        self._token_bytes: dict[int, bytes] = {}       # filled as token_bytes is asked

    @classmethod
    def from_model_path(cls, path: str) -> Tokenizer:
        """The tokenizer of a model given as a `.gguf` file or a HF directory (tokenizer.json + tokenizer_config.json)."""
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model path {path!r} does not exist")
        if path.endswith(".gguf"):
            return cls.from_gguf(path)
        raise ValueError(f"model path {path!r} is neither a .gguf file nor a HF model directory")

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """The tokenizer a GGUF file describes: byte-level BPE (`gpt2`) or SentencePiece (`llama`)."""
        meta = read_gguf_metadata(path)
        vocab = read_gguf_vocab(meta, path)
        return cls(vocab.backend, path, vocab.special_tokens, meta.get("tokenizer.chat_template"),
                   vocab.extra_eos_token_ids)

    @classmethod
    def from_hf_dir(cls, directory: str) -> Tokenizer:
        """The tokenizer of a HF model directory: tokenizer.json, tokenizer_config.json, chat template, eos ids."""
        tokenizer_file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        backend = BackendTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        special = {name: _token_content(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        # As in transformers: a chat_template.jinja file wins over the template in tokenizer_config.json.
        template_file = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        else:
            template = _default_template(config.get("chat_template"))
        generation_eos = _read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
        extra_eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        return cls(backend, directory, special, template, [i for i in extra_eos if isinstance(i, int)])

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids generation stops on: the eos token, the end-of-turn token the chat template writes, and any
        the model lists besides (GGUF eot/eom, generation_config.json)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token id, or None."""
        return self._id_of(self.special_tokens.get("bos_token"))

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of the vocabulary's special (control) tokens, ``<|im_end|>`` and the like, in order."""
        return tuple(sorted(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS only where the model asks for them.

        A text of GIL_FREE_CHARS or more is encoded without holding the GIL, so other threads (the
        server's event loop) run meanwhile: the backend's ``encode`` holds it throughout, its
        ``encode_batch`` releases it (same ids).
        """
        if len(text) < GIL_FREE_CHARS:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form a whole UTF-8 character come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's own string for one token ("Ġworld", "▁the", "<0x0A>"); "" outside it."""
        return self._backend.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (b"" for an id outside the vocabulary).

        With a byte-level BPE or a SentencePiece vocabulary with byte fallback (every GGUF this
        loads) they are exact: a token may hold part of a UTF-8 character, a SentencePiece piece
        keeps its leading space, and a control token gives its text. Other tokenizers give the
        UTF-8 of the token decoded alone.
        """
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._token_bytes[token_id] = self._bytes_of(token_id)
        return data

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_fallback:
            return _sentencepiece_bytes(piece)
        if not self._byte_level:
            return self._backend.decode([token_id], skip_special_tokens=False).encode()
        try:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        except KeyError:
            # As the ByteLevel decoder does: a piece outside the alphabet (an added token) is its own text.
            return piece.encode()

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **extra: Any
    ) -> str:
        """The prompt text of a chat body, rendered as transformers renders it (raises ChatTemplateError);
        ``continue_final_message``: left open at the end of the last message's content (a prefill the
        model goes on with; ``ChatTemplate.render_continued``), with no generation prompt."""
        if self.chat_template is None:
            raise ValueError(f"model {self.name_or_path} has no chat template; use a completion prompt")
        if continue_final_message:
            return self.chat_template.render_continued(messages, **extra)
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **extra: Any
    ) -> list[int]:
        """Token ids of a chat body; the template writes any BOS itself, so none is added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, continue_final_message, **extra))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


class IncrementalDetokenizer:
    """Streams the text of generated tokens as deltas that never end inside a UTF-8 character.

    Each `add` decodes only a small window: the tokens from `prefix_offset` on. The text of
    `[prefix_offset, read_offset)` was already emitted; what the window adds beyond it is the delta.
    A delta ending in U+FFFD is held back (the character is incomplete) until a later token
    completes it; `flush` emits whatever is still held at the end of the stream.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or ())[-_PROMPT_CONTEXT_TOKENS:]
        # Invariant: _ids[:_read_offset] has been emitted (or is prompt context); its text up from
        # _prefix_offset is decoded again only to measure where the new text starts.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens and return the text they complete ("" while a character is partial)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        # Drop what no later window needs: the next window starts where this one's new text starts.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back at the end of the stream (a trailing partial character as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""


def _sentencepiece_bytes(piece: str) -> bytes:
    """The bytes of a SentencePiece piece: `<0xNN>` is that byte, U+2581 is a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(SPACE_MARK, " ").encode()


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _default_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (take "default")."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None
