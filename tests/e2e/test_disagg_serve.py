"""Two real ``kvhive serve`` processes, ``--kv-role prefill`` and ``--kv-role decode``, on the default
model: the prefill computes each prompt and its first token and pushes the KV over TCP; the decode
continues it. Greedy text equals a whole request on one instance, in a session too, and when the
prefill process is SIGKILLed in the middle of a transfer the decode side recomputes (no wrong
token, no hang). The decode instance speculates (``--speculative-config``), so every continuation
here is also a drafted one; the prefill instance decodes plain and gives the reference text."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading

import httpx
import pytest
from support.cluster import start_gateway, stop_gateway
from support.kvhive_serve import LONG_PROMPT, ServeProcess
from support.servers import free_port, metric_samples, read_sse, wait_until

MODEL = "smollm2-135m"
ONE = ("--num-threads", "1", "--dtype", "float32")
PROMPTS = [f"Question {i}: in a village of {i * 13 % 97} houses, each with {i % 5 + 2} windows, a painter "
           f"named {['Ada', 'Bo', 'Cy', 'Di'][i % 4]} wants to know how many windows there are. Answer:"
           for i in range(10)]
# Prompts no other test sends (the decode replica holds those: their blocks are not sent again).
FRESH = [f"Riddle {i}: " + p for i, p in enumerate(PROMPTS[:4])]
SPEC = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


@pytest.fixture(scope="module")
def pair():
    port = free_port()
    decode = ServeProcess(*ONE, "--kv-role", "decode", "--kv-transfer-port", str(port), "--speculative-config", SPEC)
    try:
        prefill = ServeProcess(*ONE, "--kv-role", "prefill", "--max-num-batched-tokens", "64")
    except RuntimeError:
        decode.stop()
        raise
    yield prefill, decode, f"127.0.0.1:{port}"
    prefill.stop()
    decode.stop()


def _complete(server, prompt, max_tokens, kv=None, headers=None, path="/v1/completions"):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = httpx.post(server.url + path, json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _pd(prefill, decode, endpoint, tid, prompt, max_tokens=8, headers=None, path="/v1/completions"):
    """Prefill then decode one prompt; the decode's text."""
    first = _complete(prefill, prompt, 1, {"do_remote_decode": True, "transfer_id": tid,
                                           "decode_endpoint": endpoint}).json()
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["transfer_id"] == tid
    r = _complete(decode, prompt, max_tokens, params, headers, path)
    text = r.json()["choices"][0]["text"]
    assert text.startswith(first["choices"][0]["text"])
    return r


def _decode_metric(decode, name, direction=None):
    labels = {"role": "decode"} | ({"direction": direction} if direction else {})
    return sum(metric_samples(httpx.get(decode.url + "/metrics", timeout=10).text, name, labels))


def test_ten_prompts_equal_a_single_instance(pair):
    prefill, decode, endpoint = pair
    for i, prompt in enumerate(PROMPTS):
        want = prefill.complete(prompt, 8)[0]               # a whole request on one instance
        assert _pd(prefill, decode, endpoint, f"ten-{i}", prompt).json()["choices"][0]["text"] == want
    assert _decode_metric(decode, "kvhive_kv_transfer_blocks_total", "received") > 0
    assert _decode_metric(decode, "kvhive_kv_transfer_recomputed_blocks_total") == 0


def test_the_decode_side_drafts_a_quoting_continuation(pair):
    """A transferred prompt that the answer quotes: the decode instance drafts from it and accepts
    drafts, and the text is the plain single instance's."""
    prefill, decode, endpoint = pair
    notice = "The ferry to Brindle leaves Carrow pier at seven, calls at Dunmore and returns by noon. "
    prompt = f"Notice: {notice * 3}\nCopy the notice exactly:\n"
    want = prefill.complete(prompt, 48)[0]

    def accepted() -> float:
        return sum(metric_samples(httpx.get(decode.url + "/metrics", timeout=10).text,
                                  "kvhive_spec_decode_num_accepted_tokens_total"))

    before = accepted()
    assert _pd(prefill, decode, endpoint, "quote-1", prompt, 48).json()["choices"][0]["text"] == want
    assert accepted() - before >= 8


def test_a_session_on_the_decode_side(pair):
    prefill, decode, endpoint = pair
    opening = "A short story about a lighthouse keeper who counts ships every night. " * 3
    r = _pd(prefill, decode, endpoint, "ctx-1", opening, path="/v1/context")
    session = r.headers["x-session-id"]
    second = opening + r.json()["choices"][0]["text"] + " The next morning"
    want = prefill.complete(second, 8)[0]
    r2 = _pd(prefill, decode, endpoint, "ctx-2", second, headers={"x-session-id": session})
    assert r2.json()["choices"][0]["text"] == want


def test_prefill_killed_mid_transfer(pair):
    _, decode, endpoint = pair
    victim = ServeProcess(*ONE, "--kv-role", "prefill", "--max-num-batched-tokens", "32")
    prompt = LONG_PROMPT
    before = _decode_metric(decode, "kvhive_kv_transfer_bytes_total", "received")
    params = {"do_remote_decode": True, "transfer_id": "killed", "decode_endpoint": endpoint}

    def prefill_until_killed() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(victim.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})

    threading.Thread(target=prefill_until_killed, daemon=True).start()
    wait_until(lambda: _decode_metric(decode, "kvhive_kv_transfer_bytes_total", "received") > before, 60,
               "the first layer frames to land")
    victim.kill()
    r = _complete(decode, prompt, 8, {"do_remote_prefill": True, "transfer_id": "killed"})
    text = r.json()["choices"][0]["text"]
    reference = ServeProcess(*ONE)
    try:
        assert text == reference.complete(prompt, 8)[0]
    finally:
        reference.stop()
    assert _decode_metric(decode, "kvhive_kv_transfer_recomputed_blocks_total") > 0


def test_transfer_params_for_the_other_role_answer_400(pair):
    prefill, _, _ = pair
    r = httpx.post(prefill.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "x"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params.do_remote_prefill"


def test_a_constrained_output_is_not_split_between_instances(pair):
    prefill, _, endpoint = pair
    for path, body in (("/v1/completions", {"prompt": "hi", "guided_choice": ["yes", "no"]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "response_format": {"type": "json_object"}})):
        r = httpx.post(prefill.url + path, timeout=30, json={
            "model": MODEL, "max_tokens": 1, **body,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "c", "decode_endpoint": endpoint}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "kv_transfer_params"


@pytest.mark.parametrize("flags, named", [
    (("--kv-transfer-config", '{"kv_rol": "decode"}'), "kv_rol"),
    (("--kv-transfer-config", '{"timeout_s": 0}'), "timeout_s"),
    (("--kv-role", "decode", "--kv-transfer-port", "70000"), "port"),
])
def test_bad_transfer_flags_stop_startup(flags, named):
    done = subprocess.run([sys.executable, "-m", "kvhive.cli", "serve", *flags], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr


@pytest.fixture(scope="module")
def gateway(pair):
    prefill, decode, endpoint = pair
    cluster = start_gateway((), "--prefill", prefill.url, "--decode", f"{decode.url},kv={endpoint}",
                            until_all_up=False)
    wait_until(lambda: set(cluster.replica_states().values()) == {"up"}, 60, "both replicas up")
    yield cluster
    stop_gateway(cluster)


def test_gateway_prefills_on_one_replica_and_decodes_on_the_other(pair, gateway):
    prefill, decode, _ = pair
    before = _decode_metric(decode, "kvhive_kv_transfer_blocks_total", "received")
    for prompt in FRESH[:3]:
        want = prefill.complete(prompt, 8)[0]
        r = httpx.post(gateway.gateway_url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvhive-replica"] == decode.url
        assert r.json()["choices"][0]["text"] == want
    assert _decode_metric(decode, "kvhive_kv_transfer_blocks_total", "received") > before
    with httpx.stream("POST", gateway.gateway_url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": FRESH[3], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        events = read_sse(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == prefill.complete(FRESH[3], 8)[0]


def _cached_through(gateway, prompt):
    """Complete ``prompt`` through the gateway; its (prompt_tokens, cached_tokens)."""
    r = httpx.post(gateway.gateway_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_gateway_cached_tokens_count_what_either_side_reused(pair, gateway):
    prefill, decode, _ = pair
    prompt = "An inventory of the harbour warehouse, shelf by shelf, lists ropes, lanterns, nets. " * 4
    before = _decode_metric(decode, "kvhive_kv_transfer_blocks_total", "received")
    num_tokens, cached = _cached_through(gateway, prompt)
    assert cached == 0                               # transferred, not reused
    assert _decode_metric(decode, "kvhive_kv_transfer_blocks_total", "received") > before
    assert _cached_through(gateway, prompt) == (num_tokens, (num_tokens - 1) // 16 * 16)
    # A prefix only the prefill replica holds: the prefill's hit is reported.
    opening = "The lighthouse log of a stormy autumn records winds, tides and ships sighted. " * 3
    _, opening_tokens, _ = prefill.complete(opening, 1)
    _, cached = _cached_through(gateway, opening + " The keeper then wrote")
    # Its whole blocks by hash, and the rest copied from the block the first request left partly filled.
    assert cached == opening_tokens > 16


def test_gateway_keeps_sessions_on_the_decode_replica(pair, gateway):
    _, decode, _ = pair
    r = httpx.post(gateway.gateway_url + "/v1/context", timeout=120, json={
        "model": MODEL, "prompt": "Remember the number 42.", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvhive-replica"] == decode.url
    r2 = httpx.post(gateway.gateway_url + "/v1/completions", timeout=120, headers={
        "x-session-id": r.headers["x-session-id"]}, json={
        "model": MODEL, "prompt": "Remember the number 42. What was it?", "max_tokens": 4, "temperature": 0})
    assert r2.status_code == 200 and r2.headers["x-kvhive-replica"] == decode.url


def test_gateway_flags_name_what_is_missing():
    done = subprocess.run([sys.executable, "-m", "kvhive.cli", "gateway", "--prefill", "http://127.0.0.1:1",
                           "--decode", "http://127.0.0.1:2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "kv=host:port" in done.stderr
