"""Two models over one Redis tier and one disk dir never share KV.

Two random tiny Llama checkpoints of the same shape and the same tokenizer, written as HF
directories, are served by two ``kvhive serve`` processes under the same served model name (so
the Redis namespace is the same too) with one redis-server and one ``--disk-cache-dir``. Only the
model fingerprint in the block hashes and store keys tells their blocks apart: the second model
finds nothing of the first one's prompt, each model's own repeat is a hit, and a restarted first
model finds its blocks in the shared tiers (so the tiers did hold them).
"""

from __future__ import annotations

import os

import pytest
from support.kvhive_serve import ServeProcess
from support.redis_server import running_redis_server
from support.tokenizer_families import CORPUS, FAMILIES, build_vocab, write_hf_dir

PROMPT = " ".join(CORPUS[:3])


def _tiny_checkpoint(directory: str, vocab_size: int, seed: int) -> str:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    family = next(f for f in FAMILIES if f.name == "qwen2.5")
    vocab = build_vocab(family)
    root = tmp_path_factory.mktemp("two_models")
    dirs = []
    for seed, name in ((1, "model_a"), (2, "model_b")):
        directory = os.fspath(root / name)
        write_hf_dir(family, vocab, directory)
        dirs.append(_tiny_checkpoint(directory, len(vocab.tokens), seed))
    return dirs[0], dirs[1]


def test_two_models_over_one_redis_and_disk_share_no_kv(two_models, tmp_path) -> None:
    model_a, model_b = two_models
    with running_redis_server(str(tmp_path)) as redis_server:
        shared = ("--redis-url", redis_server.url, "--disk-cache-dir", str(tmp_path / "kv"),
                  "--served-model-name", "smollm2-135m", "--max-model-len", "512")
        first = ServeProcess("--model", model_a, *shared)
        try:
            _, num_prompt, cached = first.complete(PROMPT)
            assert num_prompt >= 48 and cached == 0
            assert first.complete(PROMPT)[2] >= 32             # its own repeat: a device hit
            first.wait_for_saves("redis")
            first.wait_for_saves("disk")
            assert first.metric("kvhive_kv_tier_bytes_in_total", "redis") > 0
            assert first.metric("kvhive_kv_tier_bytes_in_total", "disk") > 0
        finally:
            first.stop()

        second = ServeProcess("--model", model_b, *shared)
        try:
            _, num_prompt_b, cached_b = second.complete(PROMPT)
            assert num_prompt_b == num_prompt and cached_b == 0
            for tier in ("disk", "redis"):
                assert second.metric("kvhive_kv_tier_hit_tokens_total", tier) == 0
            assert second.complete(PROMPT)[2] >= 32            # its own repeat is a hit
        finally:
            second.stop()

        restarted = ServeProcess("--model", model_a, *shared)
        try:
            cached_again = restarted.complete(PROMPT)[2]
            assert cached_again >= 32
            assert (restarted.metric("kvhive_kv_tier_hit_tokens_total", "disk")
                    + restarted.metric("kvhive_kv_tier_hit_tokens_total", "redis")) >= 32
        finally:
            restarted.stop()
