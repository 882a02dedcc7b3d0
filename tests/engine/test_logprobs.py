"""Logprobs of sampled tokens: the computation against torch.log_softmax and a dense reference
forward, the engine's plumbing, and the server's model-free parts (which tokens go out with which
text, token strings and bytes, the seeds of n choices)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.engines import run_engine
from support.tiny import dense_logits, tiny_config, tiny_model

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.core import LLMEngine
from kvhive.engine.sampling import token_logprobs
from kvhive.engine.step import TokenLogprobs
from kvhive.model.loader import LoadedModel
from kvhive.request import MAX_LOGPROBS, SamplingParams
from kvhive.server.logprobs import SentToken, TokensAwaitingText, token_string
from kvhive.server.serving import choice_seed


def test_token_logprobs_equal_log_softmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    tokens = [3, 7, 0, 49]
    out = token_logprobs(logits, tokens, [5, None, 0, 50])
    ref = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    for i in (0, 2, 3):
        assert out[i].token_id == tokens[i]
        assert out[i].logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-6)
    values, ids = ref[0].topk(5)
    assert [t for t, _ in out[0].top] == ids.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out[2].top == ()
    assert len(out[3].top) == 50 and sum(math.exp(v) for _, v in out[3].top) == pytest.approx(1.0, abs=1e-5)
    assert token_logprobs(logits, tokens, [None] * 4) == [None] * 4


def test_sampling_params_bound_logprobs() -> None:
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS
    for bad in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


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


def lp(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -1.0, ())


def test_a_token_goes_out_with_the_start_of_its_text() -> None:
    awaiting = TokensAwaitingText()
    awaiting.add([lp(1)], "ab")
    assert awaiting.release(0) == ()             # "ab" held back (it could start a stop string)
    assert awaiting.release(1) == (SentToken(lp(1), 0),)   # "a" went out: the token goes with it
    awaiting.add([lp(2)], "")                    # first bytes of a character: no text yet
    assert awaiting.release(2) == ()
    awaiting.add([lp(3)], "日")                  # completes it
    assert awaiting.release(3) == (SentToken(lp(2), 2), SentToken(lp(3), 2))
    awaiting.add([lp(4)], "")                    # the end-of-turn token: no text at all
    assert awaiting.release(3) == ()
    assert awaiting.release_all() == (SentToken(lp(4), 3),)


def test_a_stop_string_drops_the_tokens_none_of_whose_text_went_out() -> None:
    awaiting = TokensAwaitingText()
    for token_id, text in ((1, "ab"), (2, "cd"), (3, ""), (4, "ef")):
        awaiting.add([lp(token_id)], text)
    # Cut at 3 characters: token 2 ("cd") is split by the cut, so it stays; 3 and 4 come after it.
    assert awaiting.release(3) == (SentToken(lp(1), 0), SentToken(lp(2), 2))
    awaiting = TokensAwaitingText()
    for token_id, text in ((1, "ab"), (2, ""), (3, "cd")):
        awaiting.add([lp(token_id)], text)
    assert awaiting.release(2) == (SentToken(lp(1), 0),)   # token 2 starts at the cut


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


def test_choice_seeds_are_distinct_and_stable() -> None:
    assert choice_seed(None, 3) is None
    assert choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(1, 16)]
    assert len(set(seeds)) == 15 and 7 not in seeds
    assert seeds == [choice_seed(7, i) for i in range(1, 16)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(8, 1) not in seeds
