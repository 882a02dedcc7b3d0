"""A prefill engine pushes a prompt's KV to a decode engine over a real TCP channel (one process,
tiny model): greedy tokens equal a single engine's, blocks the decode engine holds are not sent,
and a transfer that breaks or never comes is recomputed."""

from __future__ import annotations

import pytest
from support.engines import GREEDY, make_engine, make_engine_with_cpu_tier, run
from support.servers import wait_until

from kvhive.connector.disagg.params import KVTransferParams
from kvhive.connector.disagg.transfer_config import KVTransferConfig
from kvhive.request import SamplingParams

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _drive(engine, rid):
    """Step ``engine`` until ``rid`` ends; its tokens and cached-token count."""
    tokens, cached = [], None
    for _ in range(20000):
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                if out.finished:
                    cached = out.num_cached_tokens
        if not engine.has_unfinished():
            break
    return tokens, cached


def _pd(prefill, decode, rid, prompt, port=None, prefill_cached=False, salts=(None, None)):
    """Prefill ``prompt`` on one engine (first token), then decode it on the other; decode's tokens
    and cached count (told the prefill's cached count when ``prefill_cached``). ``salts``: each
    side's cache salt."""
    port = port or decode.disagg.worker.receiver.port
    prefill.add_request(rid, prompt, FIRST, cache_salt=salts[0], kv_transfer=KVTransferParams(
        rid, do_remote_decode=True, decode_endpoint=("127.0.0.1", port)))
    first, reused = _drive(prefill, rid)
    decode.add_request(rid, prompt, GREEDY, cache_salt=salts[1], kv_transfer=KVTransferParams(
        rid, do_remote_prefill=True, prefill_cached_tokens=reused if prefill_cached else 0))
    tokens, cached = _drive(decode, rid)
    assert tokens[:1] == first
    return tokens, cached


@pytest.fixture()
def engines(tokenizer):
    single = make_engine(tokenizer, budget=16)
    prefill = make_engine(tokenizer, budget=16, kv_transfer=KVTransferConfig(role="prefill", host="127.0.0.1"))
    decode = make_engine(tokenizer, budget=16, kv_transfer=KVTransferConfig(
        role="decode", host="127.0.0.1", timeout_s=5))
    yield single, prefill, decode
    for engine in (single, prefill, decode):
        engine.close()


def _blocks(prompt):
    """Blocks a transfer of ``prompt`` carries: every token but the last, the partial block too."""
    return -(-(len(prompt) - 1) // 4)


def _sent_reaches(prefill, blocks):
    """Wait for the prefill's sender thread to count ``blocks`` sent: it counts a frame after the
    send returns, so the decode side may have loaded it a moment earlier."""
    counters = prefill.disagg.worker.counters
    wait_until(lambda: counters.sent_blocks >= blocks, 10, f"{blocks} blocks counted as sent")
    return counters.sent_blocks


def _prompts(n, length=37):
    return {f"p{i}": [(7 * i + 3 * j) % 250 + 3 for j in range(length + i)] for i in range(n)}


def test_pd_tokens_equal_a_single_engine(engines):
    single, prefill, decode = engines
    prompts = _prompts(5)
    want = run(single, prompts)
    for rid, prompt in prompts.items():
        tokens, _ = _pd(prefill, decode, rid, prompt)
        assert tokens == want[rid][0], rid
    counters = decode.disagg.worker.counters
    assert counters.recomputed_blocks == 0 and counters.received_blocks == sum(map(_blocks, prompts.values()))
    assert _sent_reaches(prefill, counters.received_blocks) == counters.received_blocks
    decode.scheduler.kv.pool.check_integrity()


def test_the_decode_engine_computes_only_the_last_prompt_token(engines):
    """A prompt shorter than a block, and one ending mid-block: the partial block travels too."""
    single, prefill, decode = engines
    prompts = {"short": [17, 4, 99], "mid": [(11 * j) % 250 + 3 for j in range(14)]}
    want = run(single, prompts)
    first_rows = {}                    # each request's first scheduled chunk on the decode side
    original = decode.scheduler.schedule

    def schedule():
        plan = original()
        for seq in plan.seqs:
            first_rows.setdefault(seq.request_id, (seq.start_pos, len(seq.token_ids)))
        return plan

    decode.scheduler.schedule = schedule
    for rid, prompt in prompts.items():
        assert _pd(prefill, decode, rid, prompt)[0] == want[rid][0], rid
    assert first_rows == {rid: (len(p) - 1, 1) for rid, p in prompts.items()}   # one row each
    counters = decode.disagg.worker.counters
    assert counters.received_blocks == 1 + 4 and counters.recomputed_blocks == 0
    decode.scheduler.kv.pool.check_integrity()


def test_a_partial_first_block_carries_the_tenant_salt(engines):
    """A prompt shorter than a block travels as one partial block named with the salt: the same
    tenant's decode uses it; a decode request under another salt computes the prompt itself."""
    single, prefill, decode = engines
    prompt = [23, 5, 77]
    want = run(single, {"x": prompt})["x"][0]
    counters = decode.disagg.worker.counters
    assert _pd(prefill, decode, "same", prompt, salts=("tenant-a", "tenant-a"))[0] == want
    assert counters.received_blocks == 1 and counters.recomputed_blocks == 0
    assert _pd(prefill, decode, "other", prompt, salts=("tenant-a", "tenant-b"))[0] == want
    assert counters.received_blocks == 1 and counters.recomputed_blocks == 1     # refused, computed


def test_blocks_the_decode_engine_holds_are_not_sent(engines):
    single, prefill, decode = engines
    shared = [(5 * j) % 250 + 3 for j in range(24)]
    first, second = shared + [9, 8, 7, 6, 5, 4, 3], shared + [11, 12, 13, 14, 15, 16]
    want = run(single, {"a": first, "b": second})
    assert _pd(prefill, decode, "a", first)[0] == want["a"][0]
    sent_before = _sent_reaches(prefill, _blocks(first))
    tokens, cached = _pd(prefill, decode, "b", second)
    assert tokens == want["b"][0]
    assert cached == 6 * 4                  # its held prefix; the blocks that arrived are not reuse
    assert _sent_reaches(prefill, sent_before + _blocks(second) - 6) - sent_before == _blocks(second) - 6
    assert prefill.disagg.worker.counters.skipped_blocks == 6


def test_cached_tokens_count_what_either_side_reused(tokenizer, engines):
    _, prefill, decode = engines
    shared = [(3 * j) % 250 + 5 for j in range(20)]
    assert _pd(prefill, decode, "fresh", shared + [1, 2, 3], prefill_cached=True)[1] == 0
    # The prefill holds the shared prefix (5 blocks); a second decode engine holds nothing.
    other = make_engine(tokenizer, budget=16, kv_transfer=KVTransferConfig(role="decode", host="127.0.0.1"))
    try:
        _, cached = _pd(prefill, other, "again", shared + [4, 5, 6, 7, 8, 9], prefill_cached=True)
        assert cached == 5 * 4
        assert other.disagg.worker.counters.received_blocks == _blocks(shared + [4, 5, 6, 7, 8, 9])
    finally:
        other.close()


def test_a_transfer_that_never_comes_is_recomputed(tokenizer, engines):
    single, _, _ = engines
    decode = make_engine(tokenizer, budget=16, kv_transfer=KVTransferConfig(
        role="decode", host="127.0.0.1", timeout_s=0.3))
    try:
        prompt = _prompts(1)["p0"]
        want = run(single, {"x": prompt})["x"][0]
        decode.add_request("x", prompt, GREEDY, kv_transfer=KVTransferParams("x", do_remote_prefill=True))
        tokens, cached = _drive(decode, "x")
        assert tokens == want and cached == 0
        assert decode.disagg.worker.counters.recomputed_blocks == (len(prompt) - 1) // 4
    finally:
        decode.close()


def test_an_unreachable_decode_endpoint_fails_only_the_transfer(engines):
    single, prefill, _ = engines
    prompt = _prompts(1)["p0"]
    want = run(single, {"x": prompt})["x"][0]
    prefill.add_request("x", prompt, FIRST, kv_transfer=KVTransferParams(
        "x", do_remote_decode=True, decode_endpoint=("127.0.0.1", 1)))
    assert _drive(prefill, "x")[0] == want[:1]
    prefill.disagg.worker.close()
    assert prefill.disagg.worker.counters.send_failures == 1


def test_a_failed_transfer_falls_back_to_the_shared_tier(tokenizer, engines):
    single, _, _ = engines
    decode = make_engine_with_cpu_tier(tokenizer, 64, budget=16, kv_transfer=KVTransferConfig(
        role="decode", host="127.0.0.1", timeout_s=0.3))
    try:
        prompt = _prompts(1)["p0"]
        want = run(single, {"x": prompt})["x"][0]
        assert run(decode, {"warm": prompt})["warm"][0] == want     # its blocks go to the CPU tier
        decode.connector_worker.wait_for_save()
        decode.reset_prefix_cache()                                 # the device pool forgets them
        decode.add_request("x", prompt, GREEDY, kv_transfer=KVTransferParams("x", do_remote_prefill=True))
        tokens, cached = _drive(decode, "x")
        counters = decode.disagg.worker.counters
        assert tokens == want and cached == 0       # the tier's blocks stand in for the transfer's
        assert counters.fallback_blocks == (len(prompt) - 1) // 4 and counters.recomputed_blocks == 0
    finally:
        decode.close()


def test_the_decode_request_may_come_first(engines):
    single, prefill, decode = engines
    prompt = _prompts(2)["p1"]
    want = run(single, {"x": prompt})["x"][0]
    decode.add_request("x", prompt, GREEDY, kv_transfer=KVTransferParams("x", do_remote_prefill=True))
    for _ in range(3):
        assert decode.step() == []                          # admitted, waiting for the transfer
    prefill.add_request("x", prompt, FIRST, kv_transfer=KVTransferParams(
        "x", do_remote_decode=True, decode_endpoint=("127.0.0.1", decode.disagg.worker.receiver.port)))
    _drive(prefill, "x")
    tokens, cached = _drive(decode, "x")
    assert tokens == want and cached == 0
    assert decode.disagg.worker.counters.recomputed_blocks == 0


def test_a_transfer_of_another_prompt_is_used_only_where_they_agree(engines):
    single, prefill, decode = engines
    prompt = _prompts(1)["p0"]
    other = prompt[:8] + [(t + 1) % 250 + 3 for t in prompt[8:]]      # parts after two blocks
    want = run(single, {"x": other})["x"][0]
    prefill.add_request("x", prompt, FIRST, kv_transfer=KVTransferParams(
        "x", do_remote_decode=True, decode_endpoint=("127.0.0.1", decode.disagg.worker.receiver.port)))
    _drive(prefill, "x")
    decode.add_request("x", other, GREEDY, kv_transfer=KVTransferParams("x", do_remote_prefill=True))
    tokens, cached = _drive(decode, "x")
    assert tokens == want and cached == 0
    assert decode.disagg.worker.counters.recomputed_blocks == (len(other) - 1) // 4 - 2
