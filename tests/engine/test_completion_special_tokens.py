"""A completion's text prompt gets the special tokens its model's tokenizer asks for, the same ids
on every path that reads one: ``/tokenize`` and the gateway's chunked tokenizer (its block keys
too); ``tests/e2e/test_completion_bos.py`` checks the server's completions against them.
Tokenizers of each family are trained at test time (GGUF and HF directory); the default model asks
for no BOS and keeps its ids."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support.tokenizer_families import FAMILIES, build_vocab, write_gguf, write_hf_dir

from kvhive.core.tokenize_bodies import TokenizeCompletionRequest, prompt_token_ids
from kvhive.core.tokenizer import Tokenizer
from kvhive.routing.indexer import BlockKeyCache
from kvhive.routing.prompts import Prompt, PromptPieces, PromptTokenizer, prompt_from_body
from kvhive.server.completion_prompts import text_start

SHORT = "Hello, world! How are you today?"
LONG = " ".join(f"The quick brown fox {i} jumps over the lazy dog, again and again." for i in range(12))
TEXTS = (SHORT, LONG, " leading space and more words after it " * 6, "<|im_start|> literal control text")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    """``family/source`` -> the family's tokenizer read from its GGUF or its HF directory."""
    tmp = tmp_path_factory.mktemp("special-tokens")
    vocabs = {family: build_vocab(family) for family in FAMILIES}
    paths = {f"{f.name}/gguf": write_gguf(f, v, tmp / f"{f.name}.gguf") for f, v in vocabs.items()}
    paths |= {f"{f.name}/hf": write_hf_dir(f, v, tmp / f.name) for f, v in vocabs.items()}
    return {name: Tokenizer.from_model_path(path) for name, path in paths.items()}


@contextmanager
def chunked(tokenizer: Tokenizer) -> Iterator[PromptTokenizer]:
    """The gateway's chunked tokenizer over ``tokenizer``, with short chunks."""
    prompts = PromptTokenizer(tokenizer, chunk_chars=32)
    try:
        yield prompts
    finally:
        prompts.close()


NAMES = [f"{f.name}/{source}" for f in FAMILIES for source in ("gguf", "hf")]


@pytest.mark.parametrize("name", NAMES)
def test_every_path_gives_the_completion_ids(tokenizers: dict[str, Tokenizer], name: str) -> None:
    tokenizer = tokenizers[name]
    asks_bos = next(f for f in FAMILIES if f.name == name.split("/")[0]).add_bos
    with chunked(tokenizer) as gateway:
        for text in TEXTS:
            check_text(tokenizer, gateway, text, asks_bos)


def check_text(tokenizer: Tokenizer, gateway: PromptTokenizer, text: str, asks_bos: bool) -> None:
    """The model's, /tokenize's and the gateway's ids of ``text``, with and without special tokens."""
    plain = tokenizer.encode(text)
    with_bos = tokenizer.encode(text, add_special_tokens=True)
    assert with_bos == ([tokenizer.bos_token_id, *plain] if asks_bos else plain), text
    for special, expected in ((True, with_bos), (False, plain)):
        tokenize = prompt_token_ids(tokenizer, TokenizeCompletionRequest(prompt=text, add_special_tokens=special))
        assert tokenize == expected
        body = {"model": "m", "prompt": text} if special else {"model": "m", "prompt": [text],
                                                                 "add_special_tokens": False}
        for _ in range(2):                          # the second time from the prefix store
            assert gateway.token_ids(prompt_from_body(body)) == expected, (text, special)
    # The echoed text starts after the ids added before it.
    assert text_start(tokenizer, text, with_bos) == (1 if asks_bos else 0)
    assert text_start(tokenizer, text, plain) == 0


@pytest.mark.parametrize("name", ["llama3/gguf", "gemma/hf"])
def test_block_keys_with_and_without_the_bos_stay_apart(tokenizers: dict[str, Tokenizer], name: str) -> None:
    with chunked(tokenizers[name]) as gateway:
        check_block_keys(gateway)


def check_block_keys(gateway: PromptTokenizer) -> None:
    """The pieces of LONG with and without the BOS share no key, and their block keys are the ids'."""
    assert gateway.prefix_store_enabled
    keys = BlockKeyCache(block_size=4, root=b"r" * 16)
    with_bos = gateway.pieces(Prompt(text=LONG))
    without = gateway.pieces(Prompt(text=LONG, add_special_tokens=False))
    assert len(with_bos.ids) == len(without.ids) + 1 and list(with_bos.ids[0]) == [gateway.tokenizer.bos_token_id]
    assert set(with_bos.keys).isdisjoint(without.keys)
    for _ in range(2):                                  # the second time from the key cache
        a, b = keys.block_keys(with_bos, None), keys.block_keys(without, None)
        assert a == keys.block_keys(PromptPieces([None], [with_bos.joined()]), None)
        assert b == keys.block_keys(PromptPieces([None], [without.joined()]), None)
        assert a[0] != b[0]


def test_the_default_model_asks_for_no_bos_and_keeps_its_ids(tokenizer: Tokenizer) -> None:
    with chunked(tokenizer) as prompts:
        for text in TEXTS:
            assert tokenizer.encode(text, add_special_tokens=True) == tokenizer.encode(text)
            assert prompts.pieces(Prompt(text=text)) == prompts.pieces(Prompt(text=text, add_special_tokens=False))


def test_the_gateway_reads_add_special_tokens_from_the_body() -> None:
    assert prompt_from_body({"prompt": "hi"}).add_special_tokens is True
    assert prompt_from_body({"prompt": "hi", "add_special_tokens": False}).add_special_tokens is False
    # A value the replica refuses: the gateway cannot tell the ids, so it routes by load.
    assert prompt_from_body({"prompt": "hi", "add_special_tokens": "false"}) is None
    assert prompt_from_body({"prompt": [1, 2], "add_special_tokens": True}) == Prompt(token_ids=(1, 2))
