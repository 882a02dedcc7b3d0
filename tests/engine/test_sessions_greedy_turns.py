"""A 10-turn conversation on the default model gives the same greedy tokens with sessions, plain
prefix caching and no caching (engines in process)."""

from __future__ import annotations

import pytest

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.engine.llm_engine import LLMEngine
from kvhive.request import SamplingParams


@pytest.fixture(scope="module")
def default_engines():
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.model.loader import load_model

    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32", device="cpu"), Tokenizer.from_model_path(path)

    def make(prefix: bool) -> LLMEngine:
        cfg = EngineConfig(model_path=path, cache=CacheConfig(num_blocks=256, enable_prefix_caching=prefix),
                           scheduler=SchedulerConfig(max_model_len=2048))
        return LLMEngine(cfg, loaded=loaded, tokenizer=tok)

    return tok, make


def chat(engine, tok, session_id):
    """10 turns; returns the reply tokens and cached tokens of each."""
    messages, replies, cached = [], [], []
    greedy = SamplingParams(max_tokens=12, temperature=0)
    for t in range(10):
        messages.append({"role": "user", "content": f"Turn {t}: tell me one fact about the number {t * 7}."})
        engine.add_request(f"r{t}", tok.encode_chat(messages), greedy, session_id=session_id)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                if out.finished:
                    cached.append(out.num_cached_tokens)
        replies.append(tokens)
        text = tok.decode([x for x in tokens if x not in tok.eos_token_ids])
        messages.append({"role": "assistant", "content": text})
    return replies, cached


def test_ten_turns_same_greedy_tokens(default_engines):
    tok, make = default_engines
    plain, _ = chat(make(prefix=False), tok, None)
    prefix, prefix_cached = chat(make(prefix=True), tok, None)
    held, held_cached = chat(make(prefix=True), tok, "conv")
    assert held == prefix == plain
    # Both reuse every computed token of the last turn that the next prompt repeats: the session
    # from the blocks it holds, prefix caching by hash and from the partly filled last block the
    # last turn left listed. (What a session adds is that its blocks are never evicted.)
    assert held_cached == prefix_cached and sum(prefix_cached) > 0
