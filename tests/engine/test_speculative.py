"""Speculative decoding on the default model (SmolLM2 GGUF, float32): the same tokens as plain
decoding, token for token, for prompts that quote themselves (drafts accepted) and ones that do
not, batched, after a prefix-cache hit, with stops and max_tokens landing mid-draft; the target
model's logprobs; the same cached block hashes as a plain run; seeded sampling; and the requests
that decode without drafts (engines in process, one model load)."""

from __future__ import annotations

import pytest

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.llm_engine import LLMEngine, RequestOutput
from kvhive.request import FinishReason, SamplingParams

QUOTED = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
          "def add(a, b):\n    return a + b\n")
MESSAGES = {
    "quote": f"Repeat this text exactly, twice: {QUOTED}",
    "code": "Rewrite this function with the name plus: def add(a, b):\n    return a + b\n# add two numbers\n",
    "open": "Tell me one fact about the moon.",
}


@pytest.fixture(scope="module")
def engines():
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.model.loader import load_model

    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32", device="cpu"), Tokenizer.from_model_path(path)

    def make(k: int | None, block_size: int = 16, sizing: str = "per_request") -> LLMEngine:
        spec = None if k is None else SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                                                        prompt_lookup_max=4, draft_sizing=sizing)
        cfg = EngineConfig(model_path=path, cache=CacheConfig(num_blocks=256, block_size=block_size),
                           scheduler=SchedulerConfig(max_model_len=2048), speculative=spec)
        return LLMEngine(cfg, loaded=loaded, tokenizer=tok)

    prompts = {name: tok.encode_chat([{"role": "user", "content": text}]) for name, text in MESSAGES.items()}
    return make, prompts


def generate(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
             ) -> dict[str, list[RequestOutput]]:
    """Every request to the end, added together; each request's outputs in order."""
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    engine.scheduler.kv.pool.check_integrity()
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def logprobs(outputs: list[RequestOutput]) -> list:
    return [lp for out in outputs for lp in (out.logprobs or ())]


@pytest.mark.parametrize("k", [4, 10])     # 5 and 11 rows, decode rows either way
def test_greedy_tokens_and_logprobs_equal_plain_decodings(engines, k: int) -> None:
    make, prompts = engines
    greedy = SamplingParams(max_tokens=48, temperature=0, logprobs=3)
    requests = {name: (prompt, greedy) for name, prompt in prompts.items()}
    plain, spec_engine = generate(make(None), requests), make(k)
    drafted = generate(spec_engine, requests)
    stats = spec_engine.stats().spec_decode
    assert stats.num_accepted_tokens > 10 and stats.num_draft_tokens > stats.num_accepted_tokens
    for rid in requests:
        assert tokens(drafted[rid]) == tokens(plain[rid]), rid
        assert drafted[rid][-1].finish_reason == plain[rid][-1].finish_reason
        assert drafted[rid][-1].num_output_tokens == plain[rid][-1].num_output_tokens
        mine, theirs = logprobs(drafted[rid]), logprobs(plain[rid])
        assert len(mine) == len(theirs) == len(tokens(plain[rid]))
        for a, b in zip(mine, theirs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # The quoting request emits several tokens in some steps; fewer outputs than tokens.
    assert len(drafted["quote"]) < len(tokens(drafted["quote"]))
    assert all(len(out.new_token_ids) == 1 for out in plain["quote"])


def test_a_prefix_cache_hit_and_stops_mid_draft_give_the_plain_tokens(engines) -> None:
    make, prompts = engines
    quote = prompts["quote"]
    full = tokens(generate(make(None), {"r": (quote, SamplingParams(max_tokens=40, temperature=0))})["r"])
    stop = full[17]
    cases = {f"max{n}": SamplingParams(max_tokens=n, temperature=0) for n in (2, 7, 13, 22)}
    cases["stop"] = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop,))
    plain_engine, spec_engine = make(None), make(6)
    for rid, sampling in cases.items():          # one after another: each after the first is a cache hit
        plain = generate(plain_engine, {rid: (quote, sampling)})[rid]
        drafted = generate(spec_engine, {rid: (quote, sampling)})[rid]
        assert tokens(drafted) == tokens(plain), rid
        assert drafted[-1].finish_reason == plain[-1].finish_reason
        assert drafted[-1].num_output_tokens == plain[-1].num_output_tokens == len(tokens(plain))
        if rid != "max2":
            assert drafted[-1].num_cached_tokens > 0
    assert tokens(generate(make(6), {"s": (quote, cases["stop"])})["s"]) == full[:full.index(stop) + 1]
    assert spec_engine.stats().spec_decode.num_accepted_tokens > 0


def test_the_cached_blocks_after_a_drafted_run_are_those_of_a_plain_run(engines) -> None:
    make, prompts = engines
    requests = {name: (prompt, SamplingParams(max_tokens=40, temperature=0)) for name, prompt in prompts.items()}
    plain_engine, spec_engine = make(None, block_size=4), make(7, block_size=4)
    generate(plain_engine, requests)
    generate(spec_engine, requests)
    assert spec_engine.stats().spec_decode.num_accepted_tokens > 0
    plain_pool, spec_pool = plain_engine.scheduler.kv.pool, spec_engine.scheduler.kv.pool
    assert set(spec_pool.cached) == set(plain_pool.cached)
    for block_hash, block in spec_pool.cached.items():
        assert block.token_ids == plain_pool.cached[block_hash].token_ids


def test_seeded_sampling_draws_the_plain_tokens(engines) -> None:
    make, prompts = engines
    requests = {f"s{seed}": (prompts["quote"], SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95,
                                                              seed=seed, logprobs=1)) for seed in range(6)}
    plain, spec_engine = generate(make(None), requests), make(4)
    drafted = generate(spec_engine, requests)
    assert spec_engine.stats().spec_decode.num_accepted_tokens > 0
    for rid in requests:
        assert tokens(drafted[rid]) == tokens(plain[rid]), rid


def test_requests_with_penalties_or_min_tokens_draft_and_give_the_plain_tokens(engines) -> None:
    make, prompts = engines
    requests = {"penalty": (prompts["quote"], SamplingParams(max_tokens=32, temperature=0, repetition_penalty=1.1,
                                                             frequency_penalty=0.2, logprobs=1)),
                "min": (prompts["quote"], SamplingParams(max_tokens=32, temperature=0, min_tokens=24)),
                "seeded": (prompts["quote"], SamplingParams(max_tokens=32, temperature=0.6, seed=3,
                                                            presence_penalty=0.3))}
    plain, spec_engine = generate(make(None), requests), make(4)
    drafted = generate(spec_engine, requests)
    assert spec_engine.stats().spec_decode.num_accepted_tokens > 0
    for rid in requests:
        assert tokens(drafted[rid]) == tokens(plain[rid]), rid
    for a, b in zip(logprobs(drafted["penalty"]), logprobs(plain["penalty"]), strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_structured_requests_draft_under_their_grammar_and_give_the_plain_tokens(engines) -> None:
    from kvhive.core.structured_spec import StructuredSpec

    make, prompts = engines
    schema = ('{"properties":{"text":{"type":"string"},"times":{"type":"integer"}},"required":["text","times"],'
              '"type":"object"}')
    quoting = prompts["quote"]
    requests = {"json": (quoting, SamplingParams(max_tokens=60, temperature=0, logprobs=2,
                                                 structured=StructuredSpec("json_schema", schema=schema))),
                "regex": (quoting, SamplingParams(max_tokens=24, temperature=0.8, seed=5,
                                                  structured=StructuredSpec("regex", pattern=r"[A-Za-z .]{5,60}"))),
                "choice": (quoting, SamplingParams(max_tokens=8, temperature=0, structured=StructuredSpec(
                    "choice", choices=("The quick brown fox jumps over the lazy dog", "no")))),
                "quote": (quoting, SamplingParams(max_tokens=40, temperature=0, logprobs=2))}
    plain, spec_engine = generate(make(None), requests), make(5)
    drafted = generate(spec_engine, requests)
    assert spec_engine.stats().spec_decode.num_accepted_tokens > 0
    for rid in requests:
        assert tokens(drafted[rid]) == tokens(plain[rid]), rid
        assert drafted[rid][-1].finish_reason == plain[rid][-1].finish_reason, rid
        assert [lp.token_id for lp in logprobs(drafted[rid])] == [lp.token_id for lp in logprobs(plain[rid])]
    assert any(len(out.new_token_ids) > 1 for rid in ("json", "regex", "choice") for out in drafted[rid])


def test_a_drafted_request_whose_verification_fails_ends_alone(engines, monkeypatch) -> None:
    from kvhive.engine import runner as runner_module

    make, prompts = engines
    verify = runner_module.verify_drafts

    def failing(logits, seq, *args):
        if seq.request_id == "bad":
            raise RuntimeError("broken row")
        return verify(logits, seq, *args)

    greedy = SamplingParams(max_tokens=30, temperature=0)
    plain = generate(make(None), {"good": (prompts["quote"], greedy)})
    monkeypatch.setattr(runner_module, "verify_drafts", failing)
    spec_engine = make(4)
    drafted = generate(spec_engine, {"bad": (prompts["quote"], greedy), "good": (prompts["quote"], greedy)})
    assert drafted["bad"][-1].finish_reason is FinishReason.ERROR and "broken row" in drafted["bad"][-1].error
    assert tokens(drafted["good"]) == tokens(plain["good"])
    assert spec_engine.scheduler.kv.pool.stats().num_used == 0


def test_a_session_turn_with_drafts_continues_like_a_plain_one(engines) -> None:
    make, prompts = engines
    greedy = SamplingParams(max_tokens=30, temperature=0)
    replies = {}
    for k in (None, 5):
        engine, turns = make(k, block_size=4), []
        prompt = prompts["quote"]
        for t in range(2):
            engine.add_request(f"t{t}", prompt, greedy, session_id="conv")
            outs = []
            for _ in range(200):
                if not engine.has_unfinished():
                    break
                outs += engine.step()
            turns.append((tokens(outs), outs[-1].num_cached_tokens, outs[-1].finish_reason))
            prompt = prompt + tokens(outs) + prompts["open"][-8:]
        engine.scheduler.kv.pool.check_integrity()
        replies[k] = turns
    assert replies[5] == replies[None]
    assert replies[5][1][1] > 0 and replies[5][0][2] in (FinishReason.LENGTH, FinishReason.STOP)


def test_drafts_sized_by_the_measured_step_cost_give_the_plain_tokens(engines) -> None:
    """The default sizing: the engine times each step into the cost the drafts are sized by; a
    batch of eight (quoting and open prompts) still decodes the plain tokens."""
    make, prompts = engines
    greedy = SamplingParams(max_tokens=32, temperature=0)
    requests = {f"{name}{i}": (prompt, greedy) for name, prompt in prompts.items() for i in range(3)}
    plain, spec_engine = generate(make(None), requests), make(4, sizing="step_cost")
    drafted = generate(spec_engine, requests)
    cost = spec_engine.scheduler.speculation.cost
    assert cost is not None and cost.seconds(9) is not None      # steps of several sizes were timed
    for rid in requests:
        assert tokens(drafted[rid]) == tokens(plain[rid]), rid
