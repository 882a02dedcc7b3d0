"""Speculative method "history" on the default model (SmolLM2 GGUF, float32): a request that
continues an earlier request's output gets drafts from the server's history, accepted, and the
same greedy tokens as plain decoding; a tenant (prefix-cache salt) never gets a draft from another
tenant's text, in either direction (engines in process, one model load)."""

from __future__ import annotations

import pytest

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.llm_engine import LLMEngine
from kvhive.request import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0)
TOPICS = {"a": "Tell me one fact about the moon.", "b": "Describe how bread is baked, step by step."}


@pytest.fixture(scope="module")
def engines():
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.model.loader import load_model

    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32", device="cpu"), Tokenizer.from_model_path(path)

    def make(speculative: SpeculativeConfig | None) -> LLMEngine:
        cfg = EngineConfig(model_path=path, cache=CacheConfig(num_blocks=256, block_size=16),
                           scheduler=SchedulerConfig(max_model_len=2048), speculative=speculative)
        return LLMEngine(cfg, loaded=loaded, tokenizer=tok)

    prompts = {name: tok.encode_chat([{"role": "user", "content": text}]) for name, text in TOPICS.items()}
    return make, prompts


def history_config() -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=4, method="history", prompt_lookup_min=3, prompt_lookup_max=5,
                             history_max_tokens=10_000, history_tenant_max_tokens=5_000, draft_sizing="per_request")


def run(engine: LLMEngine, rid: str, prompt: list[int], salt: str | None,
        sampling: SamplingParams = GREEDY) -> list[int]:
    """One request to the end; its output tokens."""
    engine.add_request(rid, prompt, sampling, cache_salt=salt)
    out: list[int] = []
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        out += [t for o in engine.step() for t in o.new_token_ids]
    engine.scheduler.kv.pool.check_integrity()
    return out


def history_counts(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.stats().spec_decode
    return stats.num_history_draft_tokens, stats.num_history_accepted_tokens


def test_a_continuation_drafts_from_its_own_tenants_history_only(engines) -> None:
    make, prompts = engines
    plain, spec = make(None), make(history_config())
    first = {name: run(plain, f"p-{name}", prompt, None) for name, prompt in prompts.items()}
    for name, prompt in prompts.items():
        assert run(spec, f"s-{name}", prompt, f"key:{name}") == first[name]
    assert spec.scheduler.speculation.proposer.history_stats().num_tenants == 2
    for owner, other in (("a", "b"), ("b", "a")):
        # The first 8 output tokens of ``owner``'s request, as a prompt whose continuation only
        # ``owner``'s history holds.
        continued = prompts[owner] + first[owner][:8]
        expected = run(plain, f"p-{owner}-again", continued, None)
        before = history_counts(spec)
        assert run(spec, f"s-{owner}-by-{other}", continued, f"key:{other}") == expected
        assert history_counts(spec) == before, f"tenant {other} drafted from {owner}'s text"
        assert run(spec, f"s-{owner}-by-{owner}", continued, f"key:{owner}") == expected
        drafted, accepted = history_counts(spec)
        assert drafted > before[0] and accepted > before[1], f"tenant {owner} drafted nothing from its history"
    # The anonymous tenant (no key, no salt) shares with no key either.
    before = history_counts(spec)
    assert run(spec, "s-anon", prompts["a"] + first["a"][:8], None) == run(plain, "p-anon", prompts["a"] + first["a"][:8], None)
    assert history_counts(spec) == before


def test_history_drafts_leave_greedy_output_as_plain_over_a_batch(engines) -> None:
    make, prompts = engines
    plain, spec = make(None), make(history_config())
    longer = SamplingParams(max_tokens=48, temperature=0)
    for name, prompt in prompts.items():
        run(spec, f"warm-{name}", prompt, None, longer)
    # Both continuations at once, from the anonymous tenant's history: drafted, accepted, and equal.
    requests = {name: prompt + run(plain, f"p-{name}", prompt, None, longer)[:5] for name, prompt in prompts.items()}
    expected = {name: run(plain, f"p2-{name}", prompt, None, longer) for name, prompt in requests.items()}
    for name, prompt in requests.items():
        spec.add_request(f"s-{name}", prompt, longer)
    got: dict[str, list[int]] = {f"s-{name}": [] for name in requests}
    while spec.has_unfinished():
        for out in spec.step():
            got[out.request_id] += out.new_token_ids
    assert {name: got[f"s-{name}"] for name in requests} == expected
    assert history_counts(spec)[1] > 0


def run_behind(engine: LLMEngine, leader: tuple[str, list[int], str], follower: tuple[str, list[int], str],
               lead_steps: int) -> tuple[dict[str, list[int]], tuple[int, int]]:
    """Start ``leader``, step it ``lead_steps`` times, add ``follower``; run both to the end. Their
    outputs and the history draft counts taken while no request had finished."""
    engine.add_request(leader[0], leader[1], GREEDY, cache_salt=leader[2])
    got: dict[str, list[int]] = {leader[0]: [], follower[0]: []}
    for _ in range(lead_steps):
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    engine.add_request(follower[0], follower[1], GREEDY, cache_salt=follower[2])
    live_counts = (0, 0)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if engine.scheduler.speculation.proposer.history_stats().num_sequences == 0:
            live_counts = history_counts(engine)
    engine.scheduler.kv.pool.check_integrity()
    return got, live_counts


@pytest.mark.parametrize("same_tenant", [True, False])
def test_a_request_drafts_from_its_tenants_running_requests_only(engines, same_tenant: bool) -> None:
    make, prompts = engines
    plain = make(None)
    first = run(plain, "p-a", prompts["a"], None)
    continued = prompts["a"] + first[:4]
    expected = run(plain, "p-a-again", continued, None)
    spec = make(history_config())
    follower_salt = "key:a" if same_tenant else "key:b"
    got, (drafted, accepted) = run_behind(spec, ("lead", prompts["a"], "key:a"),
                                          ("follow", continued, follower_salt), lead_steps=14)
    assert got == {"lead": first, "follow": expected}
    if same_tenant:
        assert drafted > 0 and accepted > 0, "nothing drafted from the running request's tokens"
    else:
        assert (drafted, accepted) == (0, 0), "a tenant drafted from another tenant's running request"
