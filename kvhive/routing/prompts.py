"""Request body -> the token ids the replica will compute (llm-d's PrefixStore and TokenizersPool).

The gateway uses the engine's own ``kvhive.core.tokenizer`` and turns bodies into prompts the way the
server does (``kvhive/server/completions.py`` and ``chat.py``), so both get the same ids.

Prefix store: a long text is cut into chunks of about ``chunk_chars`` characters, only where a
letter, a space and a letter meet ("...word| word..."). Every pre-tokenizer the tokenizer supports
(GPT-2, llama3, qwen2 splits, digits first or not) starts a new pre-token at such a space and never
joins it to the letter before, and BPE merges never cross pre-tokens, so
``encode(a + b) == encode(a) + encode(b)`` at those cuts. Each chunk's ids are cached by the chunk's
text, the chunks before it and the prompt's cache salt (LRU), so a repeated long prefix is not
tokenized again, and the chunk's key names that whole prefix (the indexer caches block keys by
it). The salt keeps tenants apart as the replicas' prefix caches do: with the gateway's
``--salt-with-api-key``, one key never finds another key's chunks, so the time a request takes at
the gateway does not tell whether another key sent the same text. A probe at start-up checks the
property on the actual tokenizer; if it fails the store is off and texts are encoded whole.

A completion's text gets the special tokens the model's tokenizer adds (its BOS), as the server
encodes it, unless the body's ``add_special_tokens`` is false; they are a piece of their own before
the chunks, and their key leads the chunks' keys, so a text with them never finds chunks or block
keys cached for it without them.

An Anthropic Messages body (/v1/messages) is turned into chat parts by the replica's own
``kvhive.core.anthropic_messages.messages_chat`` and rendered as chat is.

Chat messages are rendered as the replica renders them (``chat_text``): the body's ``tools`` and
a history of tool calls and results through ``kvhive.core.tool_definitions.chat_template_input``
(the replica's own function), with its ``chat_template_kwargs`` and its ``add_generation_prompt``
and ``continue_final_message`` (an Anthropic body ending with an assistant message continues it).
A body whose tools or history the replica would refuse raises here, and the gateway routes it by load (the replica answers the 400).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash

from kvhive.core.anthropic_messages import messages_chat
from kvhive.core.json_body import BodyError
from kvhive.core.tenancy import cache_salt
from kvhive.core.tokenize_bodies import check_template_kwargs
from kvhive.core.tokenizer import Tokenizer
from kvhive.core.tool_definitions import chat_functions, chat_template_input
from kvhive.routing.dialects import is_anthropic

_CUT_CANDIDATE = re.compile(r"(?<=\w) (?=\w)")
_PROBES = ("The quick brown fox jumps over the lazy dog again and again",
           "x = 12 if y else 345; naïve café élan über straße Ärger", "<|im_start|>user\nhello there")


@dataclass(frozen=True)
class Prompt:
    """What a request asks the model to read: a text, chat messages (with the tools they offer and
    the chat template's variables), or token ids (exactly one)."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[Any, ...] | None = None                # chat completions' ``tools``, as sent
    template_kwargs: Mapping[str, Any] | None = None    # the body's ``chat_template_kwargs``
    token_ids: tuple[int, ...] | None = None
    cache_salt: str | None = None
    # A text gets the BOS/EOS the model's tokenizer asks for, as a completion prompt does by default
    # (chat messages never: their template writes its own; token ids are used as given).
    add_special_tokens: bool = True
    # How chat messages end (``Tokenizer.apply_chat_template``): the assistant turn's opening, or
    # the last message left open for the model to go on with (a prefill).
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class PromptPieces(NamedTuple):
    """A prompt's token ids in consecutive pieces (one per chunk of text). ``keys[i]`` (xxh3-128)
    names chunks 0..i, their text and cuts; None where the text is not cached (token-id and short
    prompts)."""

    keys: list[bytes | None]
    ids: list[Sequence[int]]

    def joined(self) -> list[int]:
        """All the token ids, one list."""
        out: list[int] = []
        for ids in self.ids:
            out.extend(ids)
        return out


class SpecialAffixes(NamedTuple):
    """The ids a tokenizer adds before and after every text it encodes with special tokens."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]


NO_AFFIXES = SpecialAffixes((), ())


def prompt_from_body(body: Mapping[str, Any], key_owner: str | None = None) -> Prompt | None:
    """The prompt of a completion or chat body, as the server reads it; None if it cannot tell.
    ``key_owner`` (``kvhive.core.tenancy.key_owner`` of the caller's key) salts the prompt the way a
    replica with API keys and no ``--share-prefix-cache`` does."""
    body_salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    salt = cache_salt(key_owner, body_salt, share_prefix_cache=False)
    if "messages" in body:
        messages = chat_messages(body["messages"])
        tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
        opening = body.get("add_generation_prompt", True), body.get("continue_final_message", False)
        if (messages is None or not isinstance(tools, list | None) or not isinstance(kwargs, dict | None)
                or not all(isinstance(flag, bool) for flag in opening) or all(opening)):
            return None
        return Prompt(messages=messages, tools=None if tools is None else tuple(tools), template_kwargs=kwargs,
                      cache_salt=salt, add_generation_prompt=opening[0], continue_final_message=opening[1])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            return None
        prompt = prompt[0]
    special = body.get("add_special_tokens", True)
    if isinstance(prompt, str) and prompt and isinstance(special, bool):
        return Prompt(text=prompt, cache_salt=salt, add_special_tokens=special)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return Prompt(token_ids=tuple(prompt), cache_salt=salt)
    return None


def prompt_for_path(path: str, body: Mapping[str, Any], key_owner: str | None = None) -> Prompt | None:
    """The prompt of a body sent to ``path``: Anthropic's Messages body on /v1/messages (and
    count_tokens, ``messages_prompt``), else ``prompt_from_body``."""
    if is_anthropic(path):
        return messages_prompt(body, key_owner)
    return prompt_from_body(body, key_owner)


def messages_prompt(body: Mapping[str, Any], key_owner: str | None = None) -> Prompt | None:
    """The chat an Anthropic Messages body renders to, as the replica renders it
    (``kvhive.core.anthropic_messages.messages_chat``: system, messages, tool use and results, the
    tools), salted as a chat prompt; None for a body the replica refuses (it answers the 400). The
    prefix up to each cache breakpoint is a prefix of this prompt, so the replica holding the
    breakpointed prefix scores highest."""
    try:
        chat = messages_chat(body)
    except BodyError:
        return None
    return Prompt(messages=chat.messages, tools=chat.tools, cache_salt=cache_salt(key_owner, None, False),
                  add_generation_prompt=not chat.prefill, continue_final_message=chat.prefill)


def chat_messages(raw: Any) -> tuple[dict[str, Any], ...] | None:
    """Messages as the server hands them to the chat template (string content, developer -> system,
    an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` as the server reads them);
    None when it cannot tell."""
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for message in raw:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return None
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return None
            content = "\n".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            return None
        role = message["role"]
        entry = {"role": "system" if role == "developer" else role, "content": content or ""}
        if message.get("name") is not None:
            entry["name"] = message["name"]
        calls = message.get("tool_calls")
        if calls:
            entry["tool_calls"] = _tool_calls(calls)
            if entry["tool_calls"] is None:
                return None
        if message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                return None
            entry["tool_call_id"] = message["tool_call_id"]
        out.append(entry)
    return tuple(out)


def _tool_calls(raw: Any) -> list[dict[str, Any]] | None:
    """An assistant message's calls as the server hands them to the template ({id, type,
    function: {name, arguments}}); None when they are not calls."""
    if not isinstance(raw, list):
        return None
    out = []
    for call in raw:
        function = call.get("function") if isinstance(call, Mapping) else None
        if (not isinstance(function, Mapping) or not isinstance(call.get("id"), str)
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
            return None
        out.append({"id": call["id"], "type": call.get("type", "function"),
                    "function": {"name": function["name"], "arguments": function["arguments"]}})
    return out


def chat_text(tokenizer: Tokenizer, prompt: Prompt) -> str:
    """The chat template's text of ``prompt``'s messages, as the replica renders them: with its
    tools and tool history (``chat_template_input``) and its ``chat_template_kwargs``. Raises
    BodyError where the replica answers 400 (tools, history, template variables), and what the
    template raises."""
    assert prompt.messages is not None
    messages, variables = chat_template_input(tokenizer.chat_template, [dict(m) for m in prompt.messages],
                                              chat_functions(prompt.tools))
    check_template_kwargs(prompt.template_kwargs)
    return tokenizer.apply_chat_template(messages, prompt.add_generation_prompt, prompt.continue_final_message,
                                         **(prompt.template_kwargs or {}), **variables)


class PromptTokenizer:
    """Token ids of prompts, with an LRU store of text chunks -> ids and a thread pool for the work."""

    def __init__(self, tokenizer: Tokenizer, chunk_chars: int = 512, max_chunks: int = 100_000,
                 workers: int = 2) -> None:
        if chunk_chars < 16:
            raise ValueError(f"chunk_chars must be >= 16, got {chunk_chars}")
        self.tokenizer = tokenizer
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._lock = threading.Lock()
        # Key of a chunk (chained xxh3-128 of the chunks up to it) -> its ids; least recently used first.
        self._chunks: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self.chunk_hits = 0
        self.chunk_misses = 0
        self.prefix_store_enabled = max_chunks > 0 and all(self._cuts_are_exact(p) for p in _PROBES)
        # None: special tokens depend on the text (or no store); such texts are then encoded whole.
        self._affixes = self._special_affixes() if self.prefix_store_enabled else None
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvhive-tokenize")

    def token_ids(self, prompt: Prompt, max_new_chars: int | None = None) -> list[int] | None:
        """The ids the replica computes for ``prompt`` (raises what the tokenizer or template raises).
        With ``max_new_chars``: None, having tokenized nothing, when more characters than that are
        not in the prefix store (the caller then tokenizes off the event loop)."""
        pieces = self.pieces(prompt, max_new_chars)
        return None if pieces is None else pieces.joined()

    def pieces(self, prompt: Prompt, max_new_chars: int | None = None) -> PromptPieces | None:
        """``token_ids`` as the prefix store holds them: one piece per chunk of text."""
        if prompt.token_ids is not None:
            return PromptPieces([None], [prompt.token_ids])
        if prompt.messages is not None:
            return self.encode_pieces(chat_text(self.tokenizer, prompt), max_new_chars, prompt.cache_salt)
        return self.encode_pieces(prompt.text or "", max_new_chars, prompt.cache_salt, prompt.add_special_tokens)

    async def run(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the tokenizer pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def encode(self, text: str, max_new_chars: int | None = None,
               add_special_tokens: bool = False) -> list[int] | None:
        """``tokenizer.encode(text, add_special_tokens)``, built from cached chunks where the store
        allows; None (nothing tokenized) when more than ``max_new_chars`` characters would need
        tokenizing."""
        pieces = self.encode_pieces(text, max_new_chars, add_special_tokens=add_special_tokens)
        return None if pieces is None else pieces.joined()

    def encode_pieces(self, text: str, max_new_chars: int | None = None, salt: str | None = None,
                      add_special_tokens: bool = False) -> PromptPieces | None:
        """``encode`` as one piece per chunk of text (one uncached piece for a short text); chunks
        are cached under ``salt`` (a prompt's cache salt): found only by texts with the same salt.
        With ``add_special_tokens``, the ids the tokenizer adds around a text (a BOS) are a piece of
        their own before the chunks (and after them)."""
        affixes = self._affixes if add_special_tokens else NO_AFFIXES
        if affixes is None or not self.prefix_store_enabled or len(text) <= self.chunk_chars:
            if max_new_chars is not None and len(text) > max_new_chars:
                return None
            return PromptPieces([None], [self.tokenizer.encode(text, add_special_tokens=add_special_tokens)])
        chunks = self.chunks(text)
        head, keys = _chunk_keys(chunks, salt, affixes.prefix)
        ids = self._chunk_ids(chunks, keys, max_new_chars)
        if ids is None:
            return None
        tail: list[bytes | None] = [None] if affixes.suffix else []
        return PromptPieces([*head, *keys, *tail],
                            [affixes.prefix][:len(head)] + ids + [affixes.suffix][:len(tail)])

    def _chunk_ids(self, chunks: list[str], keys: list[bytes],
                   max_new_chars: int | None) -> list[Sequence[int]] | None:
        """Each chunk's ids, from the store or tokenized (and stored); None, having tokenized
        nothing, when more than ``max_new_chars`` characters are not in the store."""
        with self._lock:
            found = list(map(self._chunks.get, keys))
        if max_new_chars is not None:
            new_chars = sum(len(c) for c, ids in zip(chunks, found, strict=True) if ids is None)
            if new_chars > max_new_chars:
                return None
        ids: list[Sequence[int]] = [cached if cached is not None else self._tokenize_chunk(chunk, key)
                                    for chunk, key, cached in zip(chunks, keys, found, strict=True)]
        with self._lock:
            self.chunk_hits += len(chunks) - found.count(None)
            for key, cached in zip(keys, found, strict=True):
                if cached is not None and key in self._chunks:
                    self._chunks.move_to_end(key)
        return ids

    def chunks(self, text: str) -> list[str]:
        """``text`` cut at letter-space-letter points, each piece at least ``chunk_chars`` long; the
        last ``chunk_chars`` or less in pieces of at least ``chunk_chars // 8`` (the end of a shared
        document then sits in a short piece, so a new question after it costs little to
        tokenize). The space starts the next piece."""
        pieces, start, n = [], 0, len(text)
        for step in (self.chunk_chars, max(1, self.chunk_chars // 8)):
            while n - start > step:
                cut = self._next_cut(text, start + step)
                if cut is None:
                    break
                pieces.append(text[start:cut])
                start = cut
        pieces.append(text[start:])
        return pieces

    def close(self) -> None:
        """Stop the thread pool."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _next_cut(self, text: str, pos: int) -> int | None:
        match = _CUT_CANDIDATE.search(text, pos)
        while match is not None:
            i = match.start()
            if text[i - 1].isalpha() and text[i + 1].isalpha():   # \w also matches digits and "_"
                return i
            match = _CUT_CANDIDATE.search(text, i + 1)
        return None

    def _tokenize_chunk(self, chunk: str, key: bytes) -> tuple[int, ...]:
        ids = tuple(self.tokenizer.encode(chunk))
        with self._lock:
            self.chunk_misses += 1
            self._chunks[key] = ids
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)
        return ids

    def _special_affixes(self) -> SpecialAffixes | None:
        """What encoding with special tokens adds around each probe, when it adds the same around
        every one (the post-processor's BOS/EOS); else None."""
        found = set()
        for probe in _PROBES:
            plain = self.tokenizer.encode(probe)
            full = self.tokenizer.encode(probe, add_special_tokens=True)
            start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
            if start is None:
                return None
            found.add(SpecialAffixes(tuple(full[:start]), tuple(full[start + len(plain):])))
        return found.pop() if len(found) == 1 else None

    def _cuts_are_exact(self, probe: str) -> bool:
        whole = self.tokenizer.encode(probe)
        for match in _CUT_CANDIDATE.finditer(probe):
            i = match.start()
            if probe[i - 1].isalpha() and probe[i + 1].isalpha():
                if self.tokenizer.encode(probe[:i]) + self.tokenizer.encode(probe[i:]) != whole:
                    return False
        return True


def _chunk_keys(chunks: list[str], salt: str | None, prefix: Sequence[int]) -> tuple[list[bytes], list[bytes]]:
    """The key of the added ids before the text (none when there are none) and of each chunk: key
    i names the salt, the added ids and chunks 0..i, so equal keys mean equal salt, added ids and
    text up to the chunk's end."""
    key = b"" if salt is None else xxhash.xxh3_128_digest(b"salt:" + salt.encode("utf-8", "surrogatepass"))
    head = []
    if prefix:
        key = xxhash.xxh3_128_digest(key + b"special:" + _ids_bytes(prefix))
        head.append(key)
    keys = []
    for chunk in chunks:
        key = xxhash.xxh3_128_digest(key + chunk.encode("utf-8", "surrogatepass"))
        keys.append(key)
    return head, keys


def _ids_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32s (a key's share of them)."""
    return b"".join(i.to_bytes(4, "little", signed=True) for i in ids)
