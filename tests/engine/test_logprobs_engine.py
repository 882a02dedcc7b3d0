"""Logprobs in the engine (tiny random model behind the default model's tokenizer) against a dense
reference, and the token strings and bytes of the default model's tokenizer that clients get."""

from __future__ import annotations

import random

import pytest
import torch
from support.engines import run_engine
from support.tiny import dense_logits, tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model.loader import LoadedModel
from kvhive.request import SamplingParams
from kvhive.server.logprobs import token_string


def test_engine_logprobs_match_a_dense_reference(tokenizer: Tokenizer) -> None:
    config = tiny_config(max_position_embeddings=512)
    model = tiny_model(config)
    engine = LLMEngine(EngineConfig(model_path="tiny", cache=CacheConfig(block_size=4, num_blocks=64),
                                    scheduler=SchedulerConfig(max_model_len=512)),
                       loaded=LoadedModel(config, model, "tiny-logprobs-test"), tokenizer=tokenizer)
    rng = random.Random(3)
    prompts = {rid: [rng.randrange(3, 256) for _ in range(n)] for rid, n in (("greedy", 13), ("hot", 6),
                                                                             ("plain", 9))}
    sampling = {"greedy": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=4),
                # Reported values ignore temperature and top-k: the raw distribution's.
                "hot": SamplingParams(max_tokens=6, temperature=1.7, top_k=5, seed=9, ignore_eos=True, logprobs=0),
                "plain": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)}
    outputs = run_engine(engine, {rid: (prompts[rid], sampling[rid]) for rid in prompts})
    assert all(out.logprobs is None for out in outputs["plain"])
    for rid in ("greedy", "hot"):
        generated: list[int] = []
        for out in outputs[rid]:
            (token,) = out.new_token_ids
            (lp,) = out.logprobs
            ref = torch.log_softmax(dense_logits(model, prompts[rid] + generated)[-1], dim=-1)
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-3)
            num_top = sampling[rid].logprobs
            assert [t for t, _ in lp.top] == ref.topk(num_top).indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(ref.topk(num_top).values.tolist(), abs=1e-3)
            if rid == "greedy":
                assert lp.top[0] == (token, lp.logprob)
            else:
                assert token in ref.topk(5).indices.tolist()
            generated.append(token)
        assert len(generated) == 6


def test_token_strings_and_bytes(tokenizer: Tokenizer) -> None:
    assert token_string(b" hello") == " hello"
    assert token_string(b"\xe6\x97") == "bytes:\\xe6\\x97"
    ids = tokenizer.encode("日本語 héllo <|im_end|>")
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == "日本語 héllo <|im_end|>".encode()
    assert any(token_string(p).startswith("bytes:") for p in pieces)       # a character split in two
    assert tokenizer.token_bytes(tokenizer.vocab_size + 5) == b""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 8))]
        joined = b"".join(tokenizer.token_bytes(i) for i in ids)
        assert joined.decode("utf-8", errors="replace") == tokenizer.decode(ids, skip_special_tokens=False)
