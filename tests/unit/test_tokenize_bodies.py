"""The /tokenize and /detokenize bodies over a tokenizer that adds a BOS (``kvhive.core.tokenize_bodies``),
and the gateway's field naming and model lookup (``kvhive.gateway.tokenize_api``): no server, no model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from support.tokenizer_families import family_tokenizer
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, processors

from kvhive.core.chat_template import ContinuationError
from kvhive.core.json_body import BodyError, parse_chosen_body, validation_body_error
from kvhive.core.tokenize_bodies import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_input,
    chat_text,
    chat_token_ids,
    check_detokenize_request,
    check_tokenize_request,
    detokenize_response,
    prompt_token_ids,
    tokenize_model_for,
    tokenize_response,
)
from kvhive.core.tokenizer import Tokenizer
from kvhive.gateway.tokenize_api import ModelUnknown, model_card

VOCAB = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, ":": 7}
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] | trim | replace('!', '.') }} {% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}{% if shout %}HELLO{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A word-level tokenizer whose post-processor adds a BOS, with a chat template that writes one."""
    directory: Path = tmp_path_factory.mktemp("bos-tokenizer")
    backend = BackendTokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Punctuation()])
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    return Tokenizer.from_hf_dir(str(directory))


def chat(**fields: Any) -> TokenizeChatRequest:
    return TokenizeChatRequest.model_validate({"messages": [{"role": "user", "content": "hello world"}], **fields})


def test_add_special_tokens_adds_and_drops_the_bos_of_a_prompt(tokenizer: Tokenizer) -> None:
    default = TokenizeCompletionRequest(prompt="hello world")
    assert prompt_token_ids(tokenizer, default) == [0, 3, 4]
    assert prompt_token_ids(tokenizer, TokenizeCompletionRequest(prompt="hello world", add_special_tokens=False)) \
        == [3, 4]


def test_chat_ids_are_the_template_s_and_add_special_tokens_adds_a_second_bos(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    assert chat_token_ids(tokenizer, messages, chat()) == tokenizer.encode_chat(messages) == [0, 5, 7, 3, 4, 6, 7]
    assert chat_token_ids(tokenizer, messages, chat(add_special_tokens=True)) == [0, 0, 5, 7, 3, 4, 6, 7]
    assert chat_token_ids(tokenizer, messages, chat(add_generation_prompt=False)) == [0, 5, 7, 3, 4]
    assert chat_text(tokenizer, messages, chat(chat_template_kwargs={"shout": True})).endswith("assistant:HELLO")


def test_continue_final_message_cuts_after_the_last_content(tokenizer: Tokenizer) -> None:
    body = chat(add_generation_prompt=False, continue_final_message=True)
    open_turn = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world  "}]
    # The template trims the content: the cut falls after the trimmed text, as transformers cuts.
    assert chat_text(tokenizer, open_turn, body) == "<s>user: hello assistant: world"
    assert chat_token_ids(tokenizer, open_turn, body) == [0, 5, 7, 3, 6, 7, 4]
    rewritten = [{"role": "assistant", "content": "world!"}]         # the template writes "world."
    with pytest.raises(BodyError) as missing:
        chat_text(tokenizer, rewritten, body)
    assert missing.value.param == "continue_final_message"


def test_tools_are_rendered_as_chat_completions_render_them(tokenizer: Tokenizer) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    messages = [{"role": "user", "content": "hello world"}]
    rendered, variables = chat_input(tokenizer, messages, chat(tools=[tool]))
    # This template reads no ``tools``: kvhive's own format, the definitions in a system message.
    assert variables == {} and rendered[0]["role"] == "system" and '"get_time"' in rendered[0]["content"]
    assert rendered[1:] == messages
    assert chat_input(tokenizer, messages, chat()) == (messages, {})
    with pytest.raises(BodyError) as refused:
        chat_input(tokenizer, messages, chat(tools=[{"type": "function"}]))
    assert refused.value.param == "tools[0].function"


@pytest.mark.parametrize(("fields", "param"), [
    ({"chat_template": "{{ 1 }}"}, "chat_template"),
    ({"mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {f"v{i}": i for i in range(33)}}, "chat_template_kwargs"),
    ({"messages": []}, "messages"),
])
def test_fields_kvhive_cannot_honour_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BodyError) as refused:
        check_tokenize_request(chat(**fields))
    assert refused.value.param == param


def test_a_body_is_a_prompt_or_messages_never_both() -> None:
    assert tokenize_model_for({"prompt": "x"}) is TokenizeCompletionRequest
    assert tokenize_model_for({"messages": []}) is TokenizeChatRequest
    with pytest.raises(BodyError):
        tokenize_model_for({"prompt": "x", "messages": []})


def test_token_strings_and_detokenize(tokenizer: Tokenizer) -> None:
    body = TokenizeCompletionRequest(prompt="hello world", return_token_strs=True)
    answer = tokenize_response(tokenizer, [0, 3, 4], 64, body)
    assert (answer.count, answer.max_model_len, answer.token_strs) == (3, 64, ["<s>", "hello", "world"])
    assert tokenize_response(tokenizer, [3], 64, TokenizeCompletionRequest(prompt="x")).token_strs is None
    assert detokenize_response(tokenizer, DetokenizeRequest(tokens=[0, 3, 4])).prompt == "<s> hello world"


@pytest.mark.parametrize(("tokens", "param"), [([3, -1], "tokens[1]"), ([len(VOCAB)], "tokens[0]"),
                                               ([3] * 5, "tokens")])
def test_detokenize_refuses_ids_outside_the_vocabulary_and_long_lists(tokens: list[int], param: str) -> None:
    with pytest.raises(BodyError) as refused:
        check_detokenize_request(DetokenizeRequest(tokens=tokens), len(VOCAB), max_tokens=4)
    assert refused.value.param == param


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"tokens": [1, "2"]}', "tokens[1]"),
    (b'{"tokens": [1, 2.5]}', "tokens[1]"),
    (b'{"tokens": true}', "tokens"),
    (b"{}", "tokens"),
    (b"[]", None),
    (b"", None),
    (b"{nope", None),
])
def test_the_gateway_names_the_bad_field(raw: bytes, param: str | None) -> None:
    with pytest.raises(BodyError) as refused:
        parse_chosen_body(raw, lambda _data: DetokenizeRequest)
    assert refused.value.param == param


@pytest.mark.parametrize(("message", "param"), [
    ({"role": 5}, "messages[0].role"),
    # A list given for a string-or-parts field: the error of the parts member, which names the part.
    ({"role": "user", "content": [{"text": "x"}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": 5}, "messages[0].content"),                  # no member fits: the field
    ({"role": "user", "name": ["x"]}, "messages[0].name"),
])
def test_validation_errors_name_nested_message_fields(message: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as bad:
        TokenizeChatRequest.model_validate({"messages": [message]})
    assert validation_body_error(bad.value.errors()).param == param


def test_model_card_finds_the_replicas_model() -> None:
    cards = [{"id": "a", "max_model_len": 8}, {"id": "b", "max_model_len": 16}, {"id": "c"}]
    assert model_card(cards, None)["id"] == "a"
    assert model_card(cards, "b")["max_model_len"] == 16
    for unknown in ("c", "z"):
        with pytest.raises(ModelUnknown, match="`a`, `b`"):
            model_card(cards, unknown)


def test_the_continued_message_is_cut_at_its_own_end_not_at_a_look_alike(tmp_path) -> None:
    chatml = family_tokenizer("default", tmp_path)
    user = {"role": "user", "content": "Say im"}
    for content in ("im", "Say", "end  ", ""):
        text = chatml.apply_chat_template([user, {"role": "assistant", "content": content}],
                                          continue_final_message=True)
        # Right after the content, whitespace and all (this template writes it as given).
        assert text.endswith(f"<|im_start|>assistant\n{content}")
        assert chatml.apply_chat_template([user, {"role": "assistant", "content": content}],
                                          add_generation_prompt=False).startswith(text)
    # The old way (the last place the content's text occurs) cut "im" inside "<|im_end|>".
    assert not chatml.apply_chat_template([user, {"role": "assistant", "content": "im"}],
                                          continue_final_message=True).endswith("<|im")
    with pytest.raises(ContinuationError):
        chatml.apply_chat_template([], continue_final_message=True)
