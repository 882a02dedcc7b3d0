"""Sessions survive SIGKILL + restart with a disk cache dir, and a 10-turn conversation on the
default model gives the same greedy tokens with sessions, plain prefix caching and no caching."""

from __future__ import annotations

import httpx
import pytest
from conftest import SERVED_MODEL_NAME, start_server, stop_server

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.engine import LLMEngine
from kvhive.model_files import default_model_path
from kvhive.request import SamplingParams

KEY = "restart-key"
PROMPT = [(i * 13) % 200 + 3 for i in range(70)]


def test_sessions_survive_sigkill_and_restart(tmp_path):
    args = ("--disk-cache-dir", str(tmp_path), "--max-session-ttl", "3600")
    server = start_server("tiny", api_keys=(KEY,), max_model_len=512, extra_args=args)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
            body = {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            r = c.post("/v1/context", json=body, headers={"x-session-ttl": "900"})
            sid = r.headers["x-session-id"]
            before = c.get(f"/v1/context/{sid}").json()
            assert before["blocks"]["disk"] == len(PROMPT + [0] * 4) // 16
    finally:
        server.process.kill()                       # SIGKILL: no graceful shutdown
        server.process.wait()
    server = start_server("tiny", api_keys=(KEY,), max_model_len=512, extra_args=args)
    try:
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
            after = c.get(f"/v1/context/{sid}").json()
            assert (after["tokens"], after["expires_at"], after["ttl"]) == \
                (before["tokens"], before["expires_at"], before["ttl"])
            assert after["blocks"]["disk"] == before["blocks"]["disk"]
            r = c.post("/v1/completions", json={**body, "prompt": PROMPT + [1, 2]},
                       headers={"x-session-id": sid})
            assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64   # loaded from disk
            assert c.delete(f"/v1/context/{sid}").status_code == 200
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def default_engines():
    from kvhive.model.loader import load_model
    from kvhive.tokenizer import Tokenizer

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
    # The session path reuses at least what prefix caching does, every turn.
    assert all(h >= p for h, p in zip(held_cached, prefix_cached, strict=True))
    assert sum(held_cached) > sum(prefix_cached)
