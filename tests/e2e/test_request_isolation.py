"""One request never takes the others down, over HTTP: sampling fields at their bounds, hostile bodies
are OpenAI-shaped 4xx that store nothing, a failed row or step fails only its requests (the shared
``--faulty`` tiny server), and a dead engine loop makes the server process exit non-zero (a server
of its own). In process: tests/unit/test_request_bounds.py, tests/engine/test_request_isolation_engine.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from support.api import DEEP, LONE, assert_error, chat_body
from support.servers import (
    LOOP_FAULT_MARKER,
    ROW_FAULT_MARKER,
    SERVED_MODEL_NAME,
    STEP_FAULT_MARKER,
    TINY_API_KEY,
    ServerProcess,
    read_sse,
    start_server,
    stop_server,
)

from kvhive.request import MIN_SEED, SEED_END
from kvhive.server.app import ENGINE_FAILURE_EXIT_S

MODEL = SERVED_MODEL_NAME

# ---------------------------------------------------------------- over HTTP: the shared faulty tiny server


def greedy_answer(client: httpx.Client) -> str:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "The same question", "max_tokens": 8,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def session_ids(client: httpx.Client) -> set[str]:
    r = client.get("/v1/context")
    assert r.status_code == 200, r.text
    return {s["id"] for s in r.json()["data"]}


def post_raw(client: httpx.Client, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST ``body`` as JSON with its lone surrogates escaped, as json.dumps writes them."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


ROUTES = {
    "/v1/completions": lambda text, **extra: {"model": MODEL, "prompt": text, "max_tokens": 2, **extra},
    "/v1/chat/completions": chat_body,
    "/v1/responses": lambda text, **extra: {"model": MODEL, "input": text, "max_output_tokens": 2,
                                            **extra},
    "/v1/context": lambda text, **extra: {"model": MODEL, "prompt": text, "max_tokens": 2, **extra},
}


def answer_text(path: str, r: httpx.Response) -> str:
    assert r.status_code == 200, (path, r.text)
    data = r.json()
    if path == "/v1/responses":
        return data["output"][0]["content"][0]["text"]
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_edge_sampling_values_answer_like_greedy_on_every_route(tiny_client: httpx.Client) -> None:
    before = session_ids(tiny_client)
    for path, body in ROUTES.items():
        greedy = answer_text(path, post_raw(tiny_client, path, body("Tell me", temperature=0)))
        for extra in ({"temperature": 1e-50}, {"top_p": 1e-50}, {"temperature": 1, "top_p": 1e-300},
                      {"temperature": 2, "top_p": 1e-6}):
            assert answer_text(path, post_raw(tiny_client, path, body("Tell me", **extra))) == greedy, extra
    for sid in session_ids(tiny_client) - before:
        assert tiny_client.delete(f"/v1/context/{sid}").status_code == 200


def test_seed_bounds_on_every_route(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/context"):
        for seed in (SEED_END, MIN_SEED - 1, 10**40):
            assert_error(post_raw(tiny_client, path, ROUTES[path]("hi", temperature=1, seed=seed)), 400, param="seed")
    before = session_ids(tiny_client)
    for seed in (SEED_END - 1, MIN_SEED, -1):
        body = ROUTES["/v1/completions"]("hi", temperature=1, seed=seed, max_tokens=6)
        first, second = (post_raw(tiny_client, "/v1/completions", body) for _ in range(2))
        assert first.status_code == 200 and first.json()["choices"] == second.json()["choices"]
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_lone_surrogates_are_400s_naming_the_field(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    before = session_ids(tiny_client)
    cases = [
        ("/v1/completions", ROUTES["/v1/completions"](LONE), "prompt"),
        ("/v1/completions", ROUTES["/v1/completions"]("hi", stop=["x", LONE]), "stop[1]"),
        ("/v1/chat/completions", chat_body(LONE), "messages[0].content"),
        ("/v1/chat/completions", chat_body([{"type": "text", "text": LONE}]), "messages[0].content[0].text"),
        ("/v1/chat/completions", chat_body("hi", conversation_id="c-1", user=LONE), "user"),
        ("/v1/responses", ROUTES["/v1/responses"](LONE), "input"),
        ("/v1/responses", ROUTES["/v1/responses"]([{"role": "user", "content": LONE}]), "input[0].content"),
        ("/v1/responses", ROUTES["/v1/responses"]("hi", instructions=LONE), "instructions"),
        ("/v1/context", ROUTES["/v1/context"](LONE), "prompt"),
        ("/v1/context", chat_body(LONE), "messages[0].content"),
    ]
    for path, body, param in cases:
        r = post_raw(tiny_client, path, body)
        assert_error(r, 400, param=param, contains=("Invalid Unicode", "lone surrogate"))
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_deep_nesting_is_a_400_on_every_post_route(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    before = session_ids(tiny_client)
    sid = post_raw(tiny_client, "/v1/context", ROUTES["/v1/context"]("hold this")).headers["x-session-id"]
    head = b'{"model": "%s", "prompt": "x", "user": ' % MODEL.encode()
    for path in ROUTES:
        for body in (DEEP, head + b"[" * 100_000, head + b"[" * 70 + b"]" * 70 + b"}"):
            assert_error(post_raw(tiny_client, path, body), 400, contains=("deeper than",))
    assert_error(tiny_client.patch(f"/v1/context/{sid}", content=DEEP), 400, contains=("deeper than",))
    assert tiny_client.delete(f"/v1/context/{sid}").status_code == 200
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_bad_session_ids_are_400s_that_create_nothing(tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    before = session_ids(tiny_client)
    for conversation_id in ("会话-1", "a\r\nb", "bad\nid", "", "x" * 129, "has space", "a/b"):
        for stream in (False, True):
            r = post_raw(tiny_client, "/v1/chat/completions", chat_body("hi", conversation_id=conversation_id,
                                                                        stream=stream))
            assert_error(r, 400, param="conversation_id")
    for header in (b"has space", b"x" * 129, "\u00e9t\u00e9".encode("latin-1"), "会话".encode()):
        r = tiny_client.post("/v1/completions", json=ROUTES["/v1/completions"]("hi"), headers={"x-session-id": header})
        assert_error(r, 400, param="x-session-id", code="invalid_session_id")
    assert session_ids(tiny_client) == before
    assert greedy_answer(tiny_client) == reference


def test_a_faulted_row_fails_only_its_request(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    long = {"model": MODEL, "prompt": "Keep going", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    faulted = {"model": MODEL, "prompt": f"A {ROW_FAULT_MARKER} here", "max_tokens": 4}
    with tiny_client.stream("POST", "/v1/completions", json=long) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        r = tiny_client.post("/v1/completions", json=faulted)
        assert_error(r, 500, error_type="server_error", code="internal_server_error",
                     contains=("injected row failure",))
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["usage"]["completion_tokens"] == 300
    assert "retrying row by row" in tiny_server.log_tail(200_000)       # they were sampled in one batch
    # Streamed, the failure is an error event; chat and responses fail the same way.
    with tiny_client.stream("POST", "/v1/completions", json={**faulted, "stream": True}) as r:
        events = read_sse(r)
    assert events[-1] == "[DONE]" and "injected row failure" in events[-2]["error"]["message"]
    chat = tiny_client.post("/v1/chat/completions", json=chat_body(ROW_FAULT_MARKER))
    assert_error(chat, 500, error_type="server_error", code="internal_server_error")
    response = tiny_client.post("/v1/responses", json=ROUTES["/v1/responses"](ROW_FAULT_MARKER))
    assert_error(response, 500, error_type="server_error", code="internal_server_error")
    assert greedy_answer(tiny_client) == reference


def test_a_failed_step_is_a_500_and_the_server_goes_on(tiny_server: ServerProcess, tiny_client: httpx.Client) -> None:
    reference = greedy_answer(tiny_client)
    for _ in range(4):                           # more than MAX_FAILED_STEPS_IN_ROW, each step apart
        r = tiny_client.post("/v1/completions", json={"model": MODEL, "prompt": STEP_FAULT_MARKER, "max_tokens": 2})
        assert_error(r, 500, error_type="server_error", code="internal_server_error",
                     contains=("injected step failure",))
        assert greedy_answer(tiny_client) == reference
    assert httpx.get(f"{tiny_server.base_url}/health").status_code == 200


# ---------------------------------------------------------------- a dead engine loop


def test_a_dead_engine_loop_exits_the_process_non_zero() -> None:
    server = start_server("tiny", api_keys=(TINY_API_KEY,), max_model_len=256, faulty=True)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {TINY_API_KEY}"}) as client:
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": LOOP_FAULT_MARKER, "max_tokens": 2})
            died = time.monotonic()
            assert_error(r, 500, error_type="server_error", code="internal_server_error",
                         contains=("injected engine loop failure",))
            try:
                health = client.get("/health", timeout=2)
                assert health.status_code == 503, health.text
            except httpx.TransportError:
                pass                             # the HTTP server has already stopped
        code = server.process.wait(timeout=ENGINE_FAILURE_EXIT_S + 5)
        assert code == 1, server.log_tail()
        assert time.monotonic() - died < ENGINE_FAILURE_EXIT_S + 1, server.log_tail()
    finally:
        stop_server(server)
