"""Gateway tokenization gives the engine's ids, and its prefix store is exact and avoids re-tokenizing."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from kvhive.core.tokenizer import Tokenizer
from kvhive.routing.prompts import PromptTokenizer, prompt_from_body
from kvhive.server.chat import template_messages
from kvhive.server.chat_protocol import ChatCompletionRequest
from kvhive.server.completion_prompts import prompt_token_ids
from kvhive.server.protocol import CompletionRequest

WORDS = ("the quick brown fox jumps over lazy dogs 1234 56 naïve café über straße ÄÖÜ 日本語 🙂 "
         "it's don't x_y foo-bar a.b, c; d: 'quoted' \"double\" <|im_start|> <|im_end|> \n \t  ").split(" ")


def random_text(rng: random.Random, max_words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
    for _ in range(rng.randint(0, 3)):
        text = text.replace(" ", rng.choice(["  ", "\n", " \n", "\t"]), 1)
    return text


def random_bodies(rng: random.Random, n: int) -> list[dict]:
    bodies: list[dict] = []
    for i in range(n):
        if i % 3 == 0:
            prompt: object = random_text(rng, 400)
            bodies.append({"model": "m", "prompt": [prompt] if i % 2 else prompt})
            continue
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": rng.choice(["system", "developer"]), "content": random_text(rng, 200)})
        for turn in range(rng.randint(1, 4)):
            role = "user" if turn % 2 == 0 else "assistant"
            if rng.random() < 0.3:
                content: object = [{"type": "text", "text": random_text(rng, 60)} for _ in range(2)]
            else:
                content = random_text(rng, 300)
            message = {"role": role, "content": content}
            if rng.random() < 0.2:
                message["name"] = "alice"
            messages.append(message)
        bodies.append({"model": "m", "messages": messages})
    return bodies


def engine_ids(tokenizer: Tokenizer, body: dict) -> list[int]:
    """What the server computes for the body (kvhive/server/completion_prompts.py and chat.py)."""
    class Service:
        pass

    service = Service()
    service.tokenizer = tokenizer
    if "messages" in body:
        request = ChatCompletionRequest.model_validate(body)
        return tokenizer.encode_chat(template_messages(request.messages))
    return prompt_token_ids(service, CompletionRequest.model_validate(body).prompt)


@pytest.mark.parametrize("chunk_chars", [16, 64, 512])
def test_gateway_ids_equal_engine_ids_for_many_bodies(tokenizer: Tokenizer, chunk_chars: int) -> None:
    rng = random.Random(chunk_chars)
    prompts = PromptTokenizer(tokenizer, chunk_chars=chunk_chars)
    assert prompts.prefix_store_enabled
    try:
        for body in random_bodies(rng, 60):
            prompt = prompt_from_body(body)
            assert prompt is not None
            expected = engine_ids(tokenizer, body)
            assert prompts.token_ids(prompt) == expected
            assert prompts.token_ids(prompt) == expected      # again, now from the prefix store
        assert prompts.chunk_hits > 0
    finally:
        prompts.close()


def test_token_id_prompts_and_salts_pass_through(tokenizer: Tokenizer) -> None:
    prompts = PromptTokenizer(tokenizer)
    try:
        assert prompts.token_ids(prompt_from_body({"prompt": [5, 6, 7]})) == [5, 6, 7]
        assert prompts.token_ids(prompt_from_body({"prompt": [[5, 6]]})) == [5, 6]
        assert prompt_from_body({"prompt": "hi", "cache_salt": "t1"}).cache_salt == "t1"
        assert prompt_from_body({"messages": [{"role": "user", "content": "x"}], "cache_salt": "s"}
                                ).cache_salt == "s"
    finally:
        prompts.close()


class CountingTokenizer:
    """Wraps a tokenizer and records the length of each text it encodes."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.encoded: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append(len(text))
        return self.inner.encode(text, add_special_tokens)

    def apply_chat_template(self, messages: list) -> str:
        return self.inner.apply_chat_template(messages)


def test_repeated_long_prefix_is_not_tokenized_again(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    prompts = PromptTokenizer(counting, chunk_chars=256)
    shared = " ".join(random.Random(1).choice(WORDS[:20]) for _ in range(3000))    # ~20k characters
    try:
        first = prompts.encode(shared + " first question?")
        assert first == tokenizer.encode(shared + " first question?")
        counting.encoded.clear()
        misses = prompts.chunk_misses
        second = prompts.encode(shared + " another question entirely?")
        assert second == tokenizer.encode(shared + " another question entirely?")
        # Only the tail chunk (around the new question) went through the tokenizer.
        assert prompts.chunk_misses - misses <= 2
        assert sum(counting.encoded) < 600
    finally:
        prompts.close()


def test_prefix_store_is_bounded(tokenizer: Tokenizer) -> None:
    prompts = PromptTokenizer(tokenizer, chunk_chars=16, max_chunks=5)
    try:
        prompts.encode(" ".join(f"word{i} and more" for i in range(100)))
        assert len(prompts._chunks) == 5
    finally:
        prompts.close()


def test_store_turns_itself_off_for_a_tokenizer_that_is_not_split_exact() -> None:
    class WholeTextTokenizer:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [len(text)]

    prompts = PromptTokenizer(WholeTextTokenizer(), chunk_chars=16)
    try:
        assert not prompts.prefix_store_enabled
        assert prompts.encode("a b " * 100) == [400]
    finally:
        prompts.close()


def test_tokenization_runs_off_the_event_loop(tokenizer: Tokenizer) -> None:
    prompts = PromptTokenizer(tokenizer, workers=2)

    async def main() -> tuple[str, list[int]]:
        name = await prompts.run(lambda: threading.current_thread().name)
        ids = await prompts.run(prompts.encode, "hello world")
        return name, ids

    try:
        name, ids = asyncio.run(main())
        assert name.startswith("kvhive-tokenize") and name != threading.main_thread().name
        assert ids == tokenizer.encode("hello world")
    finally:
        prompts.close()


def test_the_prefix_store_is_kept_per_salt() -> None:
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.routing.prompts import Prompt, PromptTokenizer

    prompts = PromptTokenizer(Tokenizer.from_model_path(default_model_path()), chunk_chars=64)
    text = " ".join(["alpha beta gamma delta"] * 40)
    try:
        assert prompts.prefix_store_enabled
        a = prompts.pieces(Prompt(text=text, cache_salt="key:a"))
        assert a is not None
        misses = prompts.chunk_misses
        again = prompts.pieces(Prompt(text=text, cache_salt="key:a"))
        assert again is not None and again.keys == a.keys and prompts.chunk_misses == misses
        # Another salt (another key's) finds none of those chunks: it tokenizes the text again.
        b = prompts.pieces(Prompt(text=text, cache_salt="key:b"))
        assert b is not None and prompts.chunk_misses == 2 * misses
        assert set(a.keys).isdisjoint(b.keys) and b.joined() == a.joined()
        unsalted = prompts.pieces(Prompt(text=text))
        assert unsalted is not None and set(unsalted.keys).isdisjoint(a.keys)
    finally:
        prompts.close()
