"""Schemathesis fuzzes every operation of the server's own OpenAPI schema (``/openapi.json``) on a
real tiny-model server: no input may be answered with a 5xx.

Each operation gets MAX_EXAMPLES cases drawn from four strategies: positive (what the schema
accepts), positive naming the served model (so bodies get past the model check into tokenization),
those tamed (fields kvhive refuses dropped, a few tokens asked: into sessions and the engine; drawn
twice as often as the others), and negative (what the schema refuses: wrong types, missing fields, bad parameters), which must be 4xx. The server has a short context (FUZZ_MAX_MODEL_LEN), so a
generated request that runs generates a few dozen tokens at most.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from support.servers import ServerProcess, start_server, stop_server

MODEL = "smollm2-135m"
API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 30
FUZZ_MAX_MODEL_LEN = 64
# Every route the server serves, as the schema lists them (the first test checks the list is whole).
OPERATIONS = [
    ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/context"), ("GET", "/v1/context"), ("GET", "/v1/context/{session_id}"),
    ("PATCH", "/v1/context/{session_id}"), ("DELETE", "/v1/context/{session_id}"),
    ("POST", "/v1/context/{session_id}/fork"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"), ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/reset_prefix_cache"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    ("GET", "/dashboard/data"),
]
# POSTs that read no body (their input is the query string).
BODILESS = {("POST", "/reset_prefix_cache")}


@pytest.fixture(scope="module", autouse=True)
def subnormal_floats() -> Iterator[None]:
    """Hypothesis draws subnormal floats and refuses to run where they flush to zero, as they do
    once the C++ CPU kernels (built with -ffast-math) are loaded in this process by another test:
    subnormals are back for this module's tests (on this thread), flushed again after."""
    torch = sys.modules.get("torch")
    flushed = torch is not None and sys.float_info.min / 2 == 0.0
    if flushed:
        torch.set_flush_denormal(False)
    yield
    if flushed:
        torch.set_flush_denormal(True)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    server = start_server("tiny", api_keys=(API_KEY,), max_model_len=FUZZ_MAX_MODEL_LEN,
                          extra_args=("--num-blocks", "64"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def openapi(fuzz_server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def schema(openapi: dict[str, Any]) -> Any:
    return schemathesis.openapi.from_dict(openapi)


def test_the_schema_declares_every_route_and_body(openapi: dict[str, Any]) -> None:
    listed = {(method.upper(), path) for path, operations in openapi["paths"].items() for method in operations}
    assert listed == set(OPERATIONS)
    for method, path in OPERATIONS:
        operation = openapi["paths"][path][method.lower()]
        assert "422" not in operation["responses"]              # errors are OpenAI's 400s
        if method in ("POST", "PATCH") and (method, path) not in BODILESS:
            body = operation["requestBody"]["content"]["application/json"]
            assert body["schema"] and body["example"]
            assert "413" in operation["responses"]
    chat = openapi["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])


# Fields kvhive answers 400 to unless left out (or at their default): a tamed case drops them.
REFUSED_FIELDS = ("logit_bias", "truncate_prompt_tokens", "min_tokens", "tools", "tool_choice", "response_format",
                  "best_of", "suffix", "text", "reasoning", "include", "background", "truncation", "conversation",
                  "prompt_logprobs", "top_logprobs", "logprobs", "echo", "stream_options", "turn_number")
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def with_served_model(case: Any) -> Any:
    """The case with the served model's name in its body, so it gets past the model check."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def tamed(case: Any) -> Any:
    """The case naming the served model, without the fields kvhive refuses or an unknown session
    id, asking for a few tokens from one or two choices: most such requests run in the engine (in
    a session when the case names a ``conversation_id``)."""
    case = with_served_model(case)
    if case.headers:
        case.headers.pop("x-session-id", None)
    if isinstance(case.body, dict) and "model" in case.body:
        for name in REFUSED_FIELDS:
            case.body.pop(name, None)
        for name in LENGTH_FIELDS:
            if name in case.body:
                case.body[name] = 4
        if "n" in case.body:
            case.body["n"] = 1 + case.body["n"] % 2
    return case


def case_strategy(operation: Any) -> st.SearchStrategy[Any]:
    """Positive cases, positive ones naming the served model, and negative ones where the
    operation takes any input to get wrong."""
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    if operation.body:
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE).map(with_served_model))
        strategies += [operation.as_strategy(GenerationMode.POSITIVE).map(tamed)] * 2     # drawn twice as often
    if operation.body or any(True for _ in operation.iter_parameters()):
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    return st.one_of(strategies)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_generated_request_is_a_server_error(schema: Any, fuzz_server: ServerProcess,
                                                method: str, path: str) -> None:
    operation = schema[path][method]
    statuses: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=case_strategy(operation))
    def check(case: Any) -> None:
        response = case.call(base_url=fuzz_server.base_url, headers=AUTH, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (
            f"{response.status_code} for {case.as_curl_command()}\n{response.text[:1000]}\n"
            f"server log:\n{fuzz_server.log_tail(3000)}")

    check()
    print(f"{method} {path}: statuses {dict(sorted(statuses.items()))}")
    assert fuzz_server.process.poll() is None
