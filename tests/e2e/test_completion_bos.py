"""A model whose tokenizer asks for a BOS, served by a real ``kvhive serve`` replica behind a real
gateway, over HTTP: a completion's text prompt starts with the BOS exactly once (``add_special_tokens``
false drops it, token ids are used as given), chat and Responses prompts get only the BOS their
template writes, ``/tokenize`` gives the completion's ids, and the gateway's block keys for a
completion are the replica's (its KV score finds every full block the replica stored).

The model is a tiny random Llama (``support.families``) in a HF directory with a Llama 3 style
tokenizer trained at test time (``support.tokenizer_families``: ``<|begin_of_text|>`` added by its
post-processor, and written by its chat template).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from support.cluster import Cluster, ReplicaProcess, running_replicas, start_gateway, stop_gateway
from support.families import hf_model, save_hf
from support.servers import wait_until
from support.tokenizer_families import FAMILIES, build_vocab, write_hf_dir

from kvhive.core.tokenizer import Tokenizer

MODEL = "tiny-bos"
BLOCK_SIZE = 16                         # kvhive serve's default --block-size
FAMILY = next(f for f in FAMILIES if f.name == "llama3")
PROMPT = "The quick brown fox jumps over the lazy dog."
# Longer than the gateway's prefix-store chunks (512 characters), so its chunked path runs.
LONG = " ".join(f"Hello, world! How are you today? The quick brown fox number {i} jumps over the lazy dog."
                for i in range(9))
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Served:
    """The replica and the gateway in front of it, and the model's tokenizer."""

    server: str
    cluster: Cluster
    tokenizer: Tokenizer

    @property
    def bos(self) -> int:
        """The BOS id."""
        bos = self.tokenizer.bos_token_id
        assert bos is not None
        return bos


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A tiny Llama with a BOS-adding tokenizer, served by one replica behind a gateway."""
    directory = str(tmp_path_factory.mktemp("bos-model"))
    vocab = build_vocab(FAMILY)
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    save_hf(hf_model("llama", vocab_size=len(vocab.tokens), max_position_embeddings=2048,
                     bos_token_id=ids[FAMILY.bos], eos_token_id=ids[FAMILY.eos]), directory)
    write_hf_dir(FAMILY, vocab, directory)
    replica = ReplicaProcess(extra_args=("--model", directory, "--served-model-name", MODEL))
    with running_replicas([replica]):
        cluster = start_gateway([replica], "--model", directory)
        try:
            yield Served(replica.url, cluster, Tokenizer.from_model_path(directory))
        finally:
            stop_gateway(cluster)


def post(url: str, path: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def scored_prompt(url: str, prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    """A completion that scores its prompt (echo, max_tokens 0): its logprobs list each prompt token."""
    return post(url, "/v1/completions", prompt=prompt, max_tokens=0, echo=True, logprobs=0, **extra)


@pytest.mark.parametrize("via", ["server", "gateway"])
def test_a_text_prompt_starts_with_the_bos_once(served: Served, via: str) -> None:
    url = served.server if via == "server" else served.cluster.gateway_url
    plain = served.tokenizer.encode(PROMPT)
    assert served.bos not in plain
    answer = scored_prompt(url, PROMPT)
    assert answer["usage"]["prompt_tokens"] == len(plain) + 1
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"][0] == FAMILY.bos and logprobs["tokens"].count(FAMILY.bos) == 1
    assert logprobs["token_logprobs"][0] is None
    # The echoed text is the prompt as sent; the BOS sits at offset 0, the text's tokens after it.
    assert answer["choices"][0]["text"] == PROMPT
    text_tokens = logprobs["tokens"][1:]
    assert "".join(text_tokens) == PROMPT
    assert logprobs["text_offset"] == [0] + [len("".join(text_tokens[:i])) for i in range(len(text_tokens))]


def test_add_special_tokens_false_drops_the_bos(served: Served) -> None:
    plain = served.tokenizer.encode(PROMPT)
    answer = scored_prompt(served.server, PROMPT, add_special_tokens=False)
    assert answer["usage"]["prompt_tokens"] == len(plain)
    logprobs = answer["choices"][0]["logprobs"]
    assert FAMILY.bos not in logprobs["tokens"] and "".join(logprobs["tokens"]) == PROMPT
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][1] == len(logprobs["tokens"][0])
    bad = httpx.post(served.server + "/v1/completions", timeout=60,
                     json={"model": MODEL, "prompt": PROMPT, "add_special_tokens": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"


def test_token_id_prompts_are_used_as_given(served: Served) -> None:
    plain = served.tokenizer.encode(PROMPT)
    for ids in (plain, [served.bos, *plain]):
        answer = scored_prompt(served.server, ids)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert answer["choices"][0]["logprobs"]["tokens"].count(FAMILY.bos) == ids.count(served.bos)


@pytest.mark.parametrize("via", ["server", "gateway"])
def test_tokenize_gives_the_completion_ids(served: Served, via: str) -> None:
    url = served.server if via == "server" else served.cluster.gateway_url
    for special in (True, False):
        tokens = post(url, "/tokenize", prompt=LONG, add_special_tokens=special)["tokens"]
        assert tokens == served.tokenizer.encode(LONG, add_special_tokens=special)
        assert (tokens[0] == served.bos) is special
        by_text = scored_prompt(served.server, LONG, add_special_tokens=special)
        by_ids = scored_prompt(served.server, tokens)
        assert by_text["usage"]["prompt_tokens"] == len(tokens)
        assert by_text["choices"][0]["logprobs"]["token_logprobs"] == by_ids["choices"][0]["logprobs"]["token_logprobs"]


def test_chat_and_responses_prompts_hold_only_the_templates_bos(served: Served) -> None:
    expected = served.tokenizer.encode_chat(CHAT)
    assert expected[0] == served.bos and expected.count(served.bos) == 1
    assert post(served.server, "/tokenize", messages=CHAT)["tokens"] == expected
    answer = post(served.server, "/v1/chat/completions", messages=CHAT, max_tokens=1)
    assert answer["usage"]["prompt_tokens"] == len(expected)
    user_only = served.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    assert user_only.count(served.bos) == 1
    response = post(served.server, "/v1/responses", input=PROMPT, max_output_tokens=1, store=False)
    assert response["usage"]["input_tokens"] == len(user_only)


@pytest.mark.parametrize("special", [True, False])
def test_the_gateway_finds_every_block_the_replica_stored(served: Served, special: bool) -> None:
    prompt = f"{special} {LONG}"
    ids = served.tokenizer.encode(prompt, add_special_tokens=special)
    num_blocks = len(ids) // BLOCK_SIZE
    assert num_blocks >= 8
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if not special:
        body["add_special_tokens"] = False      # absent: the default, true
    cluster = served.cluster
    with cluster.client() as client:
        keys = cluster.metric("kvhive_gateway_index_keys")
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == len(ids)
        wait_until(lambda: cluster.metric("kvhive_gateway_index_keys") >= keys + num_blocks, 30,
                   "the replica's blocks")
        before = cluster.metric_sum("kvhive_gateway_routed_cached_blocks_total")
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 200, again.text
    assert again.headers["x-kvhive-route-reason"] == "kv"
    assert cluster.metric_sum("kvhive_gateway_routed_cached_blocks_total") - before == num_blocks
