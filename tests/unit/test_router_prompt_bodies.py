"""What the gateway reads from a request body without tokenizing: bodies it cannot read give no prompt,
chat messages flatten as the server flattens them, and the body's salt joins the API key's digest."""

from __future__ import annotations

import pytest

from kvhive.core.tenancy import cache_salt, key_owner
from kvhive.routing.prompts import chat_messages, prompt_from_body


@pytest.mark.parametrize("body", [{}, {"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": 5},
                                  {"prompt": [1, "x"]}, {"messages": []}, {"messages": "hi"},
                                  {"messages": [{"content": "no role"}]},
                                  {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                  {"messages": [{"role": "user", "content": 5}]},
                                  {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
                                  {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": "no"}])
def test_bodies_the_gateway_cannot_read_give_no_prompt(body: dict) -> None:
    assert prompt_from_body(body) is None


def test_chat_messages_flatten_as_the_server_does() -> None:
    raw = [{"role": "developer", "content": None, "name": "sys"},
           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat_messages(raw) == ({"role": "system", "content": "", "name": "sys"},
                                  {"role": "user", "content": "a\nb"})


def test_the_body_salt_joins_the_key_digest_as_on_the_replica() -> None:
    owner = key_owner("Bearer key-alpha")
    assert prompt_from_body({"prompt": "hi"}).cache_salt is None
    assert prompt_from_body({"prompt": "hi"}, owner).cache_salt == cache_salt(owner, None, False)
    assert prompt_from_body({"prompt": "hi", "cache_salt": "s"}, owner).cache_salt == f"key:{owner}:s"
    assert key_owner("Bearer key-beta") != owner


def test_the_chat_opening_fields_reach_the_prompt_as_the_replica_reads_them() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    plain = prompt_from_body({"messages": messages})
    assert (plain.add_generation_prompt, plain.continue_final_message) == (True, False)
    opened = prompt_from_body({"messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert (opened.add_generation_prompt, opened.continue_final_message) == (False, True)
