"""The engine end to end on a tiny random model: prefix caching, sharing while running, preemption,
KV events. Token ids go in directly; the tokenizer is the real one of the default GGUF."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from support.engines import make_engine, run, turn

from kvhive.core.blocks import hash_blocks, root_hash
from kvhive.model import cpu
from kvhive.request import SamplingParams


def prompts_with_shared_prefix(n=4, prefix_len=40) -> dict[str, list[int]]:
    system = [(7 * i + 3) % 250 + 3 for i in range(prefix_len)]
    return {f"r{j}": system + [(11 * j + k) % 250 + 3 for k in range(5 + j)] for j in range(n)}


def test_cached_and_uncached_generation_agree(tokenizer):
    prompts = prompts_with_shared_prefix()
    uncached = run(make_engine(tokenizer, prefix=False), prompts)
    engine = make_engine(tokenizer)
    first = run(engine, prompts, stagger=True)
    again = run(engine, {f"{k}-again": v for k, v in prompts.items()})
    for rid in prompts:
        assert first[rid][0] == uncached[rid][0]
        assert again[f"{rid}-again"][0] == uncached[rid][0]
        assert uncached[rid][1] == 0
        # every prompt token but the last comes from the cache: the full blocks by hash, the
        # leading tokens of the last prompt block copied from the first run's (its reply followed)
        n = len(prompts[rid])
        assert again[f"{rid}-again"][1] == n - 1
    assert engine.stats().prefix_cache_hits_tokens > 0


# The kernel levels this host runs (an AVX2-only or portable host's included), and torch attention.
KERNELS = [*dict.fromkeys([cpu.detect().best] + [lvl for lvl in ("avx2", "portable") if cpu.detect().supports(lvl)]),
           "torch"]


def test_a_compute_step_budget_chunks_long_contexts_finer_and_gives_the_same_tokens(tokenizer):
    prompts = prompts_with_shared_prefix(n=4, prefix_len=300)
    by_tokens = run(make_engine(tokenizer, num_blocks=400, budget=48), prompts, stagger=True)
    engine = make_engine(tokenizer, num_blocks=400, budget=48, step_budget="compute")
    # the tiny model's attention costs its projections at 288 keys: a token at 300 counts ~2
    assert engine.config.scheduler.attention_context == 288
    assert run(engine, prompts, stagger=True) == by_tokens


@pytest.mark.parametrize("kernels", KERNELS)
def test_chat_turns_copy_the_last_prompt_block_and_match_an_uncached_run(tokenizer, kernels):
    # Each turn's prompt is the last prompt, a canned reply (not the model's own) and a new user
    # message, as chat clients send. The block holding the end of the last prompt also holds the
    # model's reply, so no hash matches it; its leading tokens are copied instead of computed.
    native = kernels != "torch"
    forced = {"native_attention": native, "cpu_isa": kernels if native else "auto"}
    engine = make_engine(tokenizer, **forced)
    uncached = make_engine(tokenizer, prefix=False, **forced)
    if native:
        assert kernels in engine.paths["decode_attention"], engine.paths
    prompt, last = [(5 * i + 1) % 250 + 3 for i in range(22)], []
    for t in range(4):
        got = turn(engine, f"t{t}", prompt)
        want = turn(uncached, f"t{t}", prompt)
        assert got[0] == want[0]
        assert got[1] == len(last)            # every token of the last prompt, none after it
        last = prompt
        prompt = prompt + [(3 * t + j) % 250 + 3 for j in range(5 + t)] + [(7 * t + j) % 250 + 3 for j in range(6)]
    assert engine.stats().prefix_cache_hits_tokens == 22 + 33 + 45


def test_a_prompt_sent_again_after_a_one_token_answer_computes_only_its_last_token(tokenizer):
    # The first request stops after one token, inside the block after its 11 full ones, so that
    # block never gets a hash; freed, it is listed under its parent, and the same prompt again
    # copies its first token's KV instead of computing it.
    prompt = prompts_with_shared_prefix(n=2)["r1"]            # 46 tokens: 11 blocks of 4 and 2
    engine = make_engine(tokenizer)
    run(engine, {"short": prompt}, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    again = run(engine, {"again": prompt})["again"]
    assert again == (run(make_engine(tokenizer, prefix=False), {"u": prompt})["u"][0], len(prompt) - 1)


def test_blocks_are_shared_while_the_first_request_still_runs(tokenizer):
    # Budget 16 tokens/step: the 40-token shared prefix of r0 takes 3 steps. r1 arrives one step
    # later and must reuse the blocks r0 has already computed, long before r0 finishes.
    engine = make_engine(tokenizer, budget=16)
    prompts = prompts_with_shared_prefix(n=2)
    out = run(engine, prompts, sampling=SamplingParams(max_tokens=40, temperature=0.0,
                                                       ignore_eos=True), stagger=True)
    assert out["r1"][1] >= 8


def test_concurrent_arrivals_compute_a_shared_prefix_once(tokenizer):
    # All four arrive together: the first computes the 40-token prefix, the others wait for it
    # one step and then hit it instead of computing it again in the same step.
    engine = make_engine(tokenizer, budget=256)
    prompts = prompts_with_shared_prefix(n=4)
    out = run(engine, prompts)
    assert out["r0"][1] == 0
    assert all(out[f"r{j}"][1] == 40 for j in (1, 2, 3))
    uncached = run(make_engine(tokenizer, prefix=False), prompts)
    assert {k: v[0] for k, v in out.items()} == {k: v[0] for k, v in uncached.items()}


def test_preemption_gives_the_same_tokens(tokenizer):
    prompts = prompts_with_shared_prefix(n=4, prefix_len=30)
    roomy = run(make_engine(tokenizer, num_blocks=128), prompts)
    engine = make_engine(tokenizer, num_blocks=22, prefix=False)
    tight = run(engine, prompts)
    assert engine.stats().num_preemptions > 0
    assert {k: v[0] for k, v in tight.items()} == {k: v[0] for k, v in roomy.items()}


def test_kv_events_name_blocks_with_the_spec_hash(tokenizer):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    engine = make_engine(tokenizer, num_blocks=16, kv_events=f"tcp://127.0.0.1:{port}")
    try:
        # PUB drops what it sends before the SUB has joined: warm up until an event arrives.
        for i in range(50):
            run(engine, {f"warm{i}": [200 + i % 50] * 5})
            if sub.poll(200):
                break
        while sub.poll(300):
            sub.recv_multipart()
        prompt = list(range(10, 30))                 # 20 tokens: 4 full blocks of 4 after a step
        run(engine, {"a": prompt}, sampling=SamplingParams(max_tokens=2, temperature=0.0,
                                                            ignore_eos=True))
        # fill the pool with other prompts so that "a"'s blocks get evicted
        run(engine, {f"b{i}": [100 + i] * 17 for i in range(3)})
        stored, removed = [], []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        while poller.poll(timeout=1500):
            topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            for ev in msgpack.unpackb(payload, raw=False)["events"]:       # the map encoding
                (stored if ev["type"] == "BlockStored" else removed).append(ev)
    finally:
        engine.close()
        sub.close(0)
        ctx.term()
    expected = hash_blocks(prompt, 4, root_hash(0, "tiny-engine-test"))
    first = next(ev for ev in stored if bytes(ev["block_hashes"][0]) == expected[0])
    assert [bytes(h) for h in first["block_hashes"]] == expected[:len(first["block_hashes"])]
    assert first["parent_block_hash"] is None and first["block_size"] == 4
    assert first["token_ids"] == prompt[:4 * len(first["block_hashes"])]
    all_stored = [bytes(h) for ev in stored for h in ev["block_hashes"]]
    assert set(expected) <= set(all_stored)
    assert set(expected) & {bytes(h) for ev in removed if ev["type"] == "BlockRemoved" for h in ev["block_hashes"]}
