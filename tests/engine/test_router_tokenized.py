"""The router's parts that tokenize text, through the default model's tokenizer: the indexer's scores
and block keys equal hashing the prompt's ids, and the replica simulator's HTTP API hashes prompts as
the gateway does."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator

import httpx
import pytest
from replica_sim import SimConfig, SimReplica, create_sim_app

from kvhive.core.blocks import ExtraKeys, hash_blocks, root_hash
from kvhive.core.tokenizer import Tokenizer
from kvhive.gateway.replicas import parse_load
from kvhive.routing.index import InMemoryIndex
from kvhive.routing.indexer import KVCacheIndexer
from kvhive.routing.prompts import Prompt, PromptTokenizer, prompt_from_body
from kvhive.routing.scorer import SCORERS, LongestPrefixMatch, TierWeights

KEYS_ROOT = root_hash(0, "fingerprint")


def test_indexer_scores_a_prompt_through_tokenizer_hashes_and_index(tokenizer: Tokenizer) -> None:
    root = root_hash(0, "fp")
    index = InMemoryIndex()
    prompts = PromptTokenizer(tokenizer, chunk_chars=64)
    indexer = KVCacheIndexer(prompts, index, LongestPrefixMatch(), TierWeights(), 16, root)
    text = "The history of the printing press begins long before Gutenberg. " * 8
    ids = tokenizer.encode(text)
    held = hash_blocks(ids, 16, root)
    index.add(held[:3], "a", "GPU")
    index.add(held, "b", "CPU")
    try:
        scores = asyncio.run(indexer.score(Prompt(text=text)))
        assert scores.num_tokens == len(ids) and scores.num_blocks == len(ids) // 16
        assert scores.scores == pytest.approx({"a": 3.0, "b": 0.8 * len(held)})
        salted = hash_blocks(ids, 16, root, ExtraKeys(cache_salt="t1"))
        index.add(salted, "c", "GPU")
        assert indexer.score_sync(Prompt(text=text, cache_salt="t1")).scores == {"c": float(len(held))}
        assert indexer.score_sync(Prompt(token_ids=tuple(ids[:40]))).scores == \
            pytest.approx({"a": 2.0, "b": 1.6})
    finally:
        prompts.close()


def test_indexer_keys_of_text_prompts_equal_hashing_their_ids(tokenizer: Tokenizer) -> None:
    class RecordingIndex:
        def __init__(self) -> None:
            self.looked_up: list[bytes] = []

        def lookup(self, keys: list[bytes]) -> list:
            self.looked_up = list(keys)
            return []

    prompts = PromptTokenizer(tokenizer, chunk_chars=128)
    index = RecordingIndex()
    indexer = KVCacheIndexer(prompts, index, SCORERS["longest_prefix"](), TierWeights(), 16, KEYS_ROOT)
    rng = random.Random(5)
    doc = " ".join(rng.choice(["river", "stone", "café", "über", "data", "x_y", "42"]) for _ in range(900))
    try:
        for i in range(12):
            body = {"prompt": doc[:rng.randint(3000, len(doc))] + f" question {i}?"}
            if i % 3 == 1:
                body["cache_salt"] = "tenant"
            prompt = prompt_from_body(body)
            ids = prompts.token_ids(prompt)
            scores = indexer.score_sync(prompt)
            assert index.looked_up == hash_blocks(ids, 16, KEYS_ROOT, ExtraKeys(cache_salt=prompt.cache_salt))
            assert (scores.num_tokens, scores.num_blocks) == (len(ids), len(ids) // 16)
        assert len(indexer.block_keys) > 0
    finally:
        prompts.close()


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> Iterator[PromptTokenizer]:
    prompts = PromptTokenizer(tokenizer, workers=1)
    yield prompts
    prompts.close()


def test_http_api_reports_cached_tokens_load_and_hashing(prompts: PromptTokenizer) -> None:
    config = SimConfig(capacity_blocks=64, prefill_ms_per_token=0.01, decode_ms_per_token=1.0)
    replica = SimReplica(config, prompts, publisher=None)
    app = create_sim_app(replica)
    text = "The quick brown fox jumps over the lazy dog. " * 20

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            card = (await client.get("/v1/models")).json()["data"][0]
            assert (card["kvhive_fingerprint"], card["kvhive_block_size"], card["kvhive_hash_seed"]) == \
                (config.fingerprint, 16, 0)
            body = {"model": "m", "prompt": text, "max_tokens": 3}
            first = (await client.post("/v1/completions", json=body)).json()
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert first["usage"]["completion_tokens"] == 3
            second = (await client.post("/v1/completions", json=body)).json()
            n = first["usage"]["prompt_tokens"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
            chat = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2,
                    "stream": True, "stream_options": {"include_usage": True}}
            streamed = await client.post("/v1/chat/completions", json=chat)
            lines = [x[6:] for x in streamed.text.splitlines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            chunks = [json.loads(x) for x in lines[:-1]]
            assert [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]] == [" tok"] * 2
            assert chunks[-1]["usage"]["completion_tokens"] == 2
            load = parse_load((await client.get("/metrics")).text)
            assert load.running == 0 and load.waiting == 0 and 0 < load.kv_usage <= 1
            bad = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"

    asyncio.run(scenario())
    # The replica hashed the prompt as the gateway does: its blocks are the gateway's keys.
    ids = prompts.encode(text)
    keys = hash_blocks(ids, 16, root_hash(0, config.fingerprint))
    assert replica.cache.match(keys) == len(keys)
