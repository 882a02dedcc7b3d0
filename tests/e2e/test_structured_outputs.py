"""Structured outputs over real HTTP, driven by the clients agents are written in: the ``openai`` SDK
(``chat.completions.parse`` with a pydantic model, ``response_format`` json_object / json_schema,
streamed, ``n`` = 2, completions with vLLM's fields, ``responses.create`` / ``responses.parse``)
and LangChain's ``with_structured_output``; on the default model and on tiny random Qwen3 and Llama 3
chat models, whose answers are noise: the grammar, not the model, makes every answer valid, and
every one is validated against its schema. Then the bad inputs: each a 400 naming the field, the
server serving on."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field
from support.api import assert_error
from support.chat_models import tiny_chat_model
from support.kvhive_serve import ServeProcess
from support.servers import DEFAULT_API_KEY, SERVED_MODEL_NAME, ServerProcess

MAX_TOKENS = 160                # room for every bounded answer below, in any tokenizer
QUESTION = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


class Forecast(BaseModel):
    """An answer whose every string is bounded: the grammar closes it within MAX_TOKENS."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]
    raining: bool
    days: list[Literal["mon", "tue", "wed"]] = Field(max_length=3)


SCHEMA = Forecast.model_json_schema()
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
CHOICES = ["sunny", "cloudy", "rain"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
LARK = 'start: /[a-c]{1,3}/ "-" ("x" | "y")'
GBNF = 'root ::= [a-c] [a-c]? "-" ("x" | "y")'
GRAMMAR_TEXT = r"[a-c]{1,3}-[xy]"           # what both grammars accept


@dataclass(frozen=True)
class Served:
    """A server, its model's name and an ``openai`` client for it."""

    name: str                       # "default", "qwen3" or "llama3"
    base_url: str
    model: str
    api_key: str

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module", params=["default", "qwen3", "llama3"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The default model's test server, or ``kvhive serve`` on a tiny random chat model of the family."""
    if request.param == "default":
        server: ServerProcess = request.getfixturevalue("default_server")
        yield Served("default", server.base_url, SERVED_MODEL_NAME, DEFAULT_API_KEY)
        return
    directory = tiny_chat_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))
    model = f"tiny-{request.param}"
    process = ServeProcess("--model", directory, "--served-model-name", model, "--max-model-len", "1024",
                           "--kv-cache-gb", "0.05")
    try:
        yield Served(request.param, process.url, model, "none")
    finally:
        process.stop()


def valid(text: str, schema: dict[str, Any] = SCHEMA) -> Any:
    """The JSON ``text`` holds, which must match ``schema``."""
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


# ---------------------------------------------------------------- chat completions


def test_parse_returns_the_pydantic_object(served: Served) -> None:
    completion = served.client().chat.completions.parse(model=served.model, messages=QUESTION,
                                                        response_format=Forecast, max_tokens=MAX_TOKENS,
                                                        temperature=0)
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert choice.message.parsed == Forecast.model_validate(valid(choice.message.content))


def test_json_schema_streamed_and_whole_agree(served: Served) -> None:
    client = served.client()
    whole = client.chat.completions.create(model=served.model, messages=QUESTION, response_format=JSON_SCHEMA_FORMAT,
                                           max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(model=served.model, messages=QUESTION, stream=True,
                                                 response_format=JSON_SCHEMA_FORMAT, max_tokens=MAX_TOKENS,
                                                 temperature=0))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"] == [whole.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    valid(text)


def test_n_choices_each_decode_under_the_schema(served: Served) -> None:
    completion = served.client().chat.completions.create(
        model=served.model, messages=QUESTION, response_format=JSON_SCHEMA_FORMAT, max_tokens=MAX_TOKENS,
        temperature=1.0, seed=7, n=2)
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content)


def test_json_object(served: Served) -> None:
    completion = served.client().chat.completions.create(
        model=served.model, messages=QUESTION, response_format={"type": "json_object"}, max_tokens=MAX_TOKENS,
        temperature=0)
    (choice,) = completion.choices
    if served.name == "default" or choice.finish_reason == "stop":
        # Any object: a random model may nest until max_tokens; then it must not claim to be done.
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_max_tokens_inside_the_output_is_length_with_the_partial_text(served: Served) -> None:
    client = served.client()
    cut = client.chat.completions.create(model=served.model, messages=QUESTION, response_format=JSON_SCHEMA_FORMAT,
                                         max_tokens=4, temperature=0)
    (choice,) = cut.choices
    assert choice.finish_reason == "length" and cut.usage.completion_tokens == 4
    assert choice.message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    whole = client.chat.completions.create(model=served.model, messages=QUESTION, response_format=JSON_SCHEMA_FORMAT,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content.startswith(choice.message.content)


def test_prefix_cache_and_conversation_turns_stay_valid(served: Served) -> None:
    client = served.client()
    system = {"role": "system", "content": "You report the weather as JSON. " * 20}
    for _ in range(2):
        completion = client.chat.completions.create(model=served.model, messages=[system, *QUESTION],
                                                    response_format=JSON_SCHEMA_FORMAT, max_tokens=MAX_TOKENS,
                                                    temperature=0)
        valid(completion.choices[0].message.content)
    assert completion.usage.prompt_tokens_details.cached_tokens > 0
    conversation = f"weather-{served.name}"
    history = [system, *QUESTION]
    for turn in range(2):
        completion = client.chat.completions.create(
            model=served.model, messages=history, response_format=JSON_SCHEMA_FORMAT, max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"conversation_id": conversation, "end_conversation": turn == 1})
        answer = completion.choices[0].message.content
        valid(answer)
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And tomorrow?"}]


def test_vllm_fields_on_chat(served: Served) -> None:
    client = served.client()
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        completion = client.chat.completions.create(model=served.model, messages=QUESTION, max_tokens=MAX_TOKENS,
                                                    temperature=0, extra_body=extra)
        valid(completion.choices[0].message.content)


# ---------------------------------------------------------------- completions


def test_completions_with_vllm_fields(served: Served) -> None:
    client = served.client()
    for extra in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        completion = client.completions.create(model=served.model, prompt="The weather today is", max_tokens=20,
                                               temperature=1.0, seed=3, n=2, extra_body=extra)
        assert all(c.text in CHOICES and c.finish_reason == "stop" for c in completion.choices)
    for extra in ({"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}):
        completion = client.completions.create(model=served.model, prompt="Code:", max_tokens=20, temperature=0,
                                               extra_body=extra)
        assert re.fullmatch(REGEX, completion.choices[0].text)
    for extra in ({"guided_grammar": LARK}, {"structured_outputs": {"grammar": GBNF}}):
        completion = client.completions.create(model=served.model, prompt="Tag:", max_tokens=20, temperature=0,
                                               extra_body=extra)
        assert re.fullmatch(GRAMMAR_TEXT, completion.choices[0].text)
    completion = client.completions.create(model=served.model, prompt="Weather as JSON:", max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"response_format": JSON_SCHEMA_FORMAT})
    valid(completion.choices[0].text)
    chunks = list(client.completions.create(model=served.model, prompt="Weather as JSON:", max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"guided_json": SCHEMA}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text


# ---------------------------------------------------------------- responses


def test_responses_text_format(served: Served) -> None:
    client = served.client()
    fmt = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    response = client.responses.create(model=served.model, input="Weather in Paris?", text={"format": fmt},
                                       max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    valid(response.output_text)
    parsed = client.responses.parse(model=served.model, input="Weather in Paris?", text_format=Forecast,
                                    max_output_tokens=MAX_TOKENS, temperature=0, store=False)
    assert isinstance(parsed.output_parsed, Forecast)
    again = client.responses.create(model=served.model, input="And in Rome?", previous_response_id=response.id,
                                    text={"format": {"type": "json_object"}}, max_output_tokens=MAX_TOKENS,
                                    temperature=0)
    if again.status == "completed":
        assert isinstance(json.loads(again.output_text), dict)
    cut = client.responses.create(model=served.model, input="Weather?", text={"format": fmt}, max_output_tokens=4,
                                  store=False)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


# ---------------------------------------------------------------- LangChain


def test_langchain_with_structured_output(served: Served) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=served.model, base_url=f"{served.base_url}/v1", api_key=served.api_key,
                     max_tokens=MAX_TOKENS, temperature=0, max_retries=0, timeout=300)
    answer = llm.with_structured_output(Forecast, method="json_schema").invoke("What is the weather in Paris?")
    assert isinstance(answer, Forecast)
    raw = llm.with_structured_output(SCHEMA, method="json_schema").invoke("What is the weather in Paris?")
    jsonschema.validate(raw, SCHEMA)


# ---------------------------------------------------------------- bad input: 400s, the server serving on

CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# About 1 MB of schema: under the default server's 1 MiB body limit, so the schema bound answers.
MEGABYTE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 980}
                                                    for i in range(1000)}}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


BAD_CHAT_FIELDS = [
    ({"response_format": schema_format({"type": "object", "not": {"required": ["a"]}})},
     "response_format.json_schema.schema"),
    ({"response_format": schema_format(CYCLE)}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
    ({"response_format": schema_format({"type": "integer", "minimum": 5, "maximum": 1})},
     "response_format.json_schema.schema"),
    ({"response_format": schema_format(MEGABYTE_SCHEMA)}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_regex": "(?<=a)b"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
]


def test_bad_structured_fields_are_400s_naming_the_field(default_server: ServerProcess) -> None:
    headers = {"authorization": f"Bearer {DEFAULT_API_KEY}"}
    with httpx.Client(base_url=default_server.base_url, headers=headers, timeout=120) as client:
        neighbour: dict[str, Any] = {}

        def run_neighbour() -> None:
            neighbour["response"] = client.post("/v1/chat/completions", json={
                "model": SERVED_MODEL_NAME, "messages": QUESTION, "max_tokens": 48, "temperature": 0,
                "ignore_eos": True})

        thread = threading.Thread(target=run_neighbour)
        thread.start()
        for fields, param in BAD_CHAT_FIELDS:
            r = client.post("/v1/chat/completions", json={"model": SERVED_MODEL_NAME, "messages": QUESTION,
                                                          "max_tokens": 8, **fields})
            assert_error(r, 400, param=param)
        r = client.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "x", "max_tokens": 8,
                                                 "structured_outputs": {"json": json.dumps(CYCLE)}})
        assert_error(r, 400, param="structured_outputs.json")
        r = client.post("/v1/responses", json={"model": SERVED_MODEL_NAME, "input": "x", "max_output_tokens": 8,
                                               "text": {"format": {"type": "json_schema", "name": "x",
                                                                   "schema": CYCLE}}})
        assert_error(r, 400, param="text.format.schema")
        thread.join()
        assert neighbour["response"].status_code == 200
        assert neighbour["response"].json()["usage"]["completion_tokens"] == 48
        r = client.post("/v1/chat/completions", json={"model": SERVED_MODEL_NAME, "messages": QUESTION,
                                                      "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "response_format": JSON_SCHEMA_FORMAT})
        assert r.status_code == 200, r.text
        valid(r.json()["choices"][0]["message"]["content"])


def test_a_constraint_no_token_can_continue_is_a_400_not_a_server_error(default_server: ServerProcess) -> None:
    """A regex whose next character no token of the vocabulary spells (a control character after
    "0"): the output starts, then no token fits. The client's constraint, not a server fault: a 400
    naming it (in the stream, a 400's error body), and the server serves the next request."""
    headers = {"authorization": f"Bearer {DEFAULT_API_KEY}"}
    body = {"model": SERVED_MODEL_NAME, "prompt": "0", "guided_regex": "0\u0016", "max_tokens": 8}
    with httpx.Client(base_url=default_server.base_url, headers=headers, timeout=120) as client:
        r = client.post("/v1/completions", json=body)
        assert_error(r, 400, code="constraint_dead_end", contains=("cannot be completed",))
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["error"]["type"] == "invalid_request_error"
        assert events[-1]["error"]["code"] == "constraint_dead_end"
        r = client.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "0", "max_tokens": 4})
        assert r.status_code == 200, r.text


# Constraints whose first token is fine and that then reach the grammar engine's limits: a grammar
# of 5,000 alternatives (Earley items in a row) and a regex repeated a million times (lexer).
PAST_LIMITS = [{"guided_grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(5000))},
               {"guided_regex": "a{1000000}"}]


@pytest.mark.parametrize("constraint", PAST_LIMITS, ids=["grammar", "regex"])
def test_a_constraint_past_the_grammar_limits_mid_output_is_a_400(default_server: ServerProcess,
                                                                  constraint: dict) -> None:
    """The client's constraint outgrew the grammar engine's limits partway through the output: a
    400 (code constraint_too_complex, the engine's words), streamed or not, never a 500; the
    server serves the next request."""
    headers = {"authorization": f"Bearer {DEFAULT_API_KEY}"}
    body = {"model": SERVED_MODEL_NAME, "prompt": "x", "max_tokens": 8, **constraint}
    with httpx.Client(base_url=default_server.base_url, headers=headers, timeout=120) as client:
        r = client.post("/v1/completions", json=body)
        assert_error(r, 400, code="constraint_too_complex", contains=("limits",))
        assert "<non-verbose/>" not in r.json()["error"]["message"]
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["error"]["code"] == "constraint_too_complex"
        r = client.post("/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 200, r.text
