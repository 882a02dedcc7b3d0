"""``kvhive serve --generation-config`` over real HTTP on a tiny random Qwen3 in a Hugging Face
directory whose ``generation_config.json`` recommends sampling values: with ``auto`` (the default)
a request that leaves them out gets them (``max_new_tokens`` as its ``max_tokens``, the Responses
object's temperature and top_p), its own values win, and the startup log names them; with ``vllm``
none apply. The same model's chat template reads ``chat_template_kwargs`` (Qwen3's
``enable_thinking``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.cluster import ReplicaProcess, running_replicas
from support.families import hf_model, save_hf
from support.tokenizer_families import FAMILIES, build_vocab, write_hf_dir

MODEL = "tiny-gen"
FAMILY = next(f for f in FAMILIES if f.name == "qwen3")
GENERATION = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ReplicaProcess]]:
    """One replica with ``--generation-config auto`` and one with ``vllm``, on the same model."""
    directory = str(tmp_path_factory.mktemp("gen-model"))
    vocab = build_vocab(FAMILY)
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    save_hf(hf_model("qwen3", vocab_size=len(vocab.tokens), max_position_embeddings=2048,
                     eos_token_id=ids[FAMILY.eos]), directory)
    write_hf_dir(FAMILY, vocab, directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(GENERATION, f)
    common = ("--model", directory, "--served-model-name", MODEL, "--log-level", "info", "--max-model-len", "256")
    replicas = {"auto": ReplicaProcess(extra_args=common),
                "vllm": ReplicaProcess(extra_args=(*common, "--generation-config", "vllm"))}
    with running_replicas(list(replicas.values()), print_logs=False):
        yield replicas


def post(replica: ReplicaProcess, path: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(replica.url + path, json={"model": MODEL, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_auto_applies_the_models_defaults_to_unset_fields(servers: dict[str, ReplicaProcess]) -> None:
    auto = servers["auto"]
    assert "temperature=0.6 top_p=0.9 max_tokens=3" in auto.log_tail()
    unset = post(auto, "/v1/completions", prompt="Hello there", ignore_eos=True)
    assert unset["usage"]["completion_tokens"] == 3 and unset["choices"][0]["finish_reason"] == "length"
    asked = post(auto, "/v1/completions", prompt="Hello there", ignore_eos=True, max_tokens=5)
    assert asked["usage"]["completion_tokens"] == 5
    chat = post(auto, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], ignore_eos=True)
    assert chat["usage"]["completion_tokens"] == 3
    response = post(auto, "/v1/responses", input="hi", store=False)
    assert (response["temperature"], response["top_p"]) == (0.6, 0.9)
    assert response["usage"]["output_tokens"] <= 3
    own = post(auto, "/v1/responses", input="hi", store=False, temperature=0.0, max_output_tokens=1)
    assert (own["temperature"], own["top_p"]) == (0.0, 0.9)


def test_vllm_applies_none(servers: dict[str, ReplicaProcess]) -> None:
    plain = servers["vllm"]
    assert "none (vllm)" in plain.log_tail()
    unset = post(plain, "/v1/completions", prompt="Hello there", ignore_eos=True, temperature=0)
    assert unset["usage"]["completion_tokens"] > 3          # to the end of the context
    response = post(plain, "/v1/responses", input="hi", store=False, max_output_tokens=1)
    assert (response["temperature"], response["top_p"]) == (1.0, 1.0)


def test_chat_template_kwargs_reach_the_template(servers: dict[str, ReplicaProcess]) -> None:
    auto = servers["auto"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    thinking = post(auto, "/v1/chat/completions", **chat)
    plain = post(auto, "/v1/chat/completions", **chat, chat_template_kwargs={"enable_thinking": False})
    # Qwen3's template writes an empty think block when thinking is off.
    tokenized = post(auto, "/tokenize", messages=chat["messages"], chat_template_kwargs={"enable_thinking": False})
    assert plain["usage"]["prompt_tokens"] == tokenized["count"] > thinking["usage"]["prompt_tokens"]
