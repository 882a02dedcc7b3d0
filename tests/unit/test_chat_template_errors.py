"""A chat template that fails to render raises ChatTemplateError (a template's own raise_exception
too); strftime_now is there for templates that print the date."""

from __future__ import annotations

import pytest

from kvhive.core.chat_template import ChatTemplate, ChatTemplateError


def test_template_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
    assert ChatTemplate("{{ strftime_now('%Y') | length }}").render([]) == "4"
