"""Constrained decoding in the engine (in process): greedy outputs under each constraint kind parse
and validate; unconstrained neighbours in the same steps get exactly their own greedy tokens;
n > 1, max_tokens inside a constrained output, logprobs, seeds, preemption and the synchronous mask
fallback. Most tests run the tiny random model with the default model's full vocabulary (so only
the grammar makes its output valid); json_object runs on the default model itself."""

from __future__ import annotations

import json
import re

import pytest
from support.engines import make_engine, run_engine

from kvhive.core.structured_spec import StructuredSpec, ToolCallFormat
from kvhive.request import FinishReason, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "color": {"enum": ["red", "green"]}},
    "required": ["name", "ok", "n", "color"], "additionalProperties": False}
CALL = {"type": "object", "properties": {
    "name": {"enum": ["get_weather"]},
    "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                  "required": ["city"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
HERMES = ToolCallFormat(begin="<tool_call>\n", end="\n</tool_call>", max_calls=2)
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(20)]
SPECS = {
    "json_schema": StructuredSpec("json_schema", schema=json.dumps(SCHEMA)),
    "regex": StructuredSpec("regex", pattern=r"[a-z]{3}-[0-9]{2}"),
    "choice": StructuredSpec("choice", choices=("alpha", "beta", "gamma")),
    "tool_calls": StructuredSpec("tool_calls", schema=json.dumps(CALL), tool_format=HERMES),
}


def valid(kind: str, text: str) -> bool:
    """True when ``text`` is a complete output of SPECS[kind]."""
    if kind == "json_schema":
        value = json.loads(text)
        return (set(value) == set(SCHEMA["required"]) and len(value["name"]) <= 8 and isinstance(value["ok"], bool)
                and 0 <= value["n"] <= 99 and value["color"] in ("red", "green"))
    if kind == "regex":
        return re.fullmatch(r"[a-z]{3}-[0-9]{2}", text) is not None
    if kind == "choice":
        return text in ("alpha", "beta", "gamma")
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, flags=re.S)
    return 1 <= len(calls) <= 2 and all(json.loads(c)["name"] == "get_weather" for c in calls)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = make_engine(tokenizer, num_blocks=128, max_seqs=8, budget=128, vocab_size=tokenizer.vocab_size)
    yield engine
    engine.close()


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def greedy(spec=None, max_tokens=80, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=spec, **extra)


def test_each_kind_gives_a_valid_complete_output_alongside_unconstrained_requests(engine, tokenizer) -> None:
    free = {f"free{i}": (PROMPT[i:] + [5 + i], greedy(max_tokens=16)) for i in range(3)}
    alone = {rid: tokens_of(run_engine(engine, {rid: req})[rid]) for rid, req in free.items()}
    requests = {kind: (PROMPT, greedy(spec)) for kind, spec in SPECS.items()} | free
    outputs = run_engine(engine, requests)
    for kind in SPECS:
        last = outputs[kind][-1]
        text = tokenizer.decode(tokens_of(outputs[kind]))
        assert (last.finish_reason, last.error) == (FinishReason.STOP, None), kind
        assert valid(kind, text), (kind, text)
    for rid in free:
        assert tokens_of(outputs[rid]) == alone[rid]


def test_the_synchronous_mask_fallback_gives_the_same_tokens(engine, tokenizer) -> None:
    requests = {kind: (PROMPT, greedy(spec)) for kind, spec in SPECS.items()}
    requests["sampled"] = (PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=7,
                                                  structured=SPECS["json_schema"]))
    overlapped = run_engine(engine, requests)
    assert engine.runner.grammar_rows.times.wait_seconds >= 0
    sync = make_engine(tokenizer, num_blocks=128, max_seqs=8, budget=128, vocab_size=tokenizer.vocab_size,
                       grammar_mask_overlap=False)
    try:
        inline = run_engine(sync, requests)
        times = sync.runner.grammar_rows.times
        assert times.inline_seconds > 0 and times.wait_seconds == 0
    finally:
        sync.close()
    for rid in requests:
        assert tokens_of(inline[rid]) == tokens_of(overlapped[rid]), rid


def test_n_choices_each_follow_their_own_grammar(engine, tokenizer) -> None:
    sampling = SamplingParams(max_tokens=80, temperature=1.0, seed=3, structured=SPECS["tool_calls"])
    outputs = run_engine(engine, {f"c{i}": (PROMPT, sampling) for i in range(3)})
    texts = [tokenizer.decode(tokens_of(outputs[f"c{i}"])) for i in range(3)]
    for i, text in enumerate(texts):
        assert outputs[f"c{i}"][-1].finish_reason is FinishReason.STOP
        assert valid("tool_calls", text), text


def test_max_tokens_inside_the_output_ends_with_length_and_the_partial_text(engine, tokenizer) -> None:
    outputs = run_engine(engine, {"cut": (PROMPT, greedy(SPECS["json_schema"], max_tokens=5))})["cut"]
    text = tokenizer.decode(tokens_of(outputs))
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert len(tokens_of(outputs)) == 5 and text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_logprobs_are_the_raw_model_s(engine) -> None:
    outputs = run_engine(engine, {"lp": (PROMPT, greedy(SPECS["choice"], logprobs=2))})["lp"]
    entries = [lp for out in outputs for lp in out.logprobs]
    assert entries and all(e.logprob <= 0 for e in entries)
    # The first token is forced into the choices; the raw top alternatives are not.
    first = entries[0]
    assert first.top[0][1] >= first.logprob


def test_a_spec_that_does_not_compile_fails_its_request_alone(engine) -> None:
    bad = StructuredSpec("regex", pattern="(unclosed")
    outputs = run_engine(engine, {"bad": (PROMPT, greedy(bad)), "ok": (PROMPT, greedy(max_tokens=4))})
    assert outputs["bad"][-1].finish_reason is FinishReason.ERROR
    assert "regex" in outputs["bad"][-1].error
    assert outputs["ok"][-1].finish_reason is FinishReason.LENGTH


def test_preempted_constrained_requests_keep_their_grammar(tokenizer) -> None:
    # A pool too small for all of them at once: some are preempted and recomputed mid-output.
    small = make_engine(tokenizer, num_blocks=40, block_size=4, max_seqs=8, budget=64, vocab_size=tokenizer.vocab_size)
    try:
        requests = {f"p{i}": (PROMPT + [10 + i], greedy(SPECS["json_schema"])) for i in range(6)}
        outputs = run_engine(small, requests)
        assert small.scheduler.stats().num_preemptions > 0
    finally:
        small.close()
    for rid in requests:
        assert outputs[rid][-1].finish_reason is FinishReason.STOP, outputs[rid][-1].error
        assert valid("json_schema", tokenizer.decode(tokens_of(outputs[rid])))


def test_json_object_on_the_default_model(tokenizer) -> None:
    from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvhive.core.model_files import default_model_path
    from kvhive.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model_path=default_model_path(), cache=CacheConfig(num_blocks=64),
                                    scheduler=SchedulerConfig(max_model_len=1024)), tokenizer=tokenizer)
    try:
        prompt = tokenizer.encode_chat([{"role": "user", "content": "Describe a cat as a JSON object with its name and age."}])
        outputs = run_engine(engine, {"obj": (prompt, greedy(StructuredSpec("json_object"), max_tokens=60))})["obj"]
    finally:
        engine.close()
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert isinstance(json.loads(tokenizer.decode(tokens_of(outputs))), dict)


def test_a_failing_mask_worker_falls_back_to_inline_masks(engine, tokenizer, monkeypatch) -> None:
    import threading

    requests = {"js": (PROMPT, greedy(SPECS["json_schema"]))}
    want = tokens_of(run_engine(engine, requests)["js"])
    rows = engine.runner.grammar_rows
    compute = rows._masks

    def broken_on_worker(matchers):
        if threading.current_thread().name.startswith("kvhive-grammar"):
            raise RuntimeError("worker broke")
        return compute(matchers)

    monkeypatch.setattr(rows, "_masks", broken_on_worker)
    before = rows.times.inline_seconds
    assert tokens_of(run_engine(engine, requests)["js"]) == want
    assert rows.times.inline_seconds > before


def test_constrained_turns_in_a_session(engine, tokenizer) -> None:
    prompt, texts = list(PROMPT), []
    for t in range(2):
        engine.add_request(f"s{t}", prompt, greedy(SPECS["json_schema"]), session_id="sess", end_session=t == 1)
        got = []
        while engine.has_unfinished():
            for out in engine.step():
                got += out.new_token_ids
                if out.finished:
                    assert out.finish_reason is FinishReason.STOP, out.error
                    cached = out.num_cached_tokens
        texts.append(tokenizer.decode(got))
        prompt = prompt + got + [11, 12, 13]
    assert all(valid("json_schema", text) for text in texts)
    assert cached > 0                   # the second turn continued the session's blocks


def test_min_tokens_does_not_hold_a_completed_grammar_open(engine, tokenizer) -> None:
    """A grammar that completes before ``min_tokens`` ends the request there: the constraint wins
    over the EOS suppression (no token past a complete output could match it), and the output is
    the same complete, valid choice as without ``min_tokens``."""
    spec = SPECS["choice"]
    plain = SamplingParams(max_tokens=24, temperature=0.0, structured=spec)
    held = SamplingParams(max_tokens=24, temperature=0.0, structured=spec, min_tokens=20)
    outs = run_engine(engine, {"plain": (PROMPT, plain), "held": (PROMPT, held)})
    texts = {rid: tokenizer.decode(tokens_of(o)) for rid, o in outs.items()}
    assert valid("choice", texts["held"]), texts
    assert texts["held"] == texts["plain"]
    assert outs["held"][-1].finish_reason is FinishReason.STOP
    assert outs["held"][-1].num_output_tokens < 20
