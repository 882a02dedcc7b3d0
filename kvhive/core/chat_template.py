"""A model's jinja2 chat template, rendered the way transformers renders it (torch-free).

Same environment as transformers' `apply_chat_template`: a sandbox with trim_blocks and
lstrip_blocks, loop controls, a `{% generation %}` tag (rendered as its body), `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, and the named special tokens as variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Content part types whose text a text-only model reads (chat completions, then the Responses API).
TEXT_PART_TYPES = ("text", "input_text", "output_text")

# Tokens that end an assistant turn in the common chat formats (ChatML, Llama 3, Gemma, Phi-3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")


# Follows the content of a message to continue while the template renders it (``render_continued``).
CONTINUE_MARK = "\x00kvhive-continue\x00"


class ChatTemplateError(ValueError):
    """A chat body the template cannot render (the template raised, or a message is malformed)."""


class ContinuationError(ChatTemplateError):
    """The last message of a chat cannot be left open to continue (``ChatTemplate.render_continued``)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers tracks assistant spans with it; we render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def flatten_content(content: Any) -> Any:
    """A message's content as the template sees it: a list of text parts becomes their texts joined by newlines."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in TEXT_PART_TYPES:
            texts.append(part.get("text") or "")
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"unsupported content part {kind!r}: this model reads text only")
    # Joined by "\n" as vLLM does for templates that expect string content.
    return "\n".join(texts)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = env.from_string(source)
        self._variables = jinja2.meta.find_undeclared_variables(env.parse(source))

    def reads(self, variable: str) -> bool:
        """Whether the template reads ``variable`` (``tools``: it renders tool definitions and calls)."""
        return variable in self._variables

    def renders_role(self, role: str) -> bool:
        """Whether a message of ``role`` shows in the prompt (its content is written, the template
        does not raise): a system message first, any other after a user and an assistant message."""
        probe = "\x00kvhive-role-probe\x00"
        message = {"role": role, "content": probe}
        chat = ([message, {"role": "user", "content": "hi"}] if role == "system" else
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, message])
        try:
            text = self.render(chat, add_generation_prompt=False)
        except ChatTemplateError:
            return False
        return probe in text

    def uses_token(self, token: str) -> bool:
        """Whether the template's source writes `token` (e.g. its end-of-turn marker)."""
        return token in self.source

    def render_continued(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> str:
        """The prompt text of `messages` left open at the end of the last message's content, so the
        model goes on with that message (an assistant prefill) instead of starting a new turn.

        The cut is found by rendering the last content with CONTINUE_MARK after it: it falls right
        after that content whatever the template writes next (its end-of-turn marker, another
        turn's opening), and no text equal to the content elsewhere (content "im" inside
        "<|im_end|>") is taken for it. Whitespace ends as transformers ends it: the content's
        trailing whitespace is kept where the template writes it and left out where the template
        trims it. ContinuationError where the template does not write the content as given."""
        if not messages:
            raise ContinuationError("there is no message to continue")
        *earlier, final = messages
        if not isinstance(final, Mapping):
            raise ChatTemplateError(f"a chat message must be a mapping with role and content, got {final!r}")
        content = flatten_content(final.get("content") or "")
        if not isinstance(content, str):
            raise ContinuationError("the message to continue must have text content")
        marked = self.render([*earlier, {**final, "content": content + CONTINUE_MARK}], add_generation_prompt=False,
                             **extra)
        end = marked.find(CONTINUE_MARK)
        if end >= 0 and marked.find(CONTINUE_MARK, end + 1) < 0 and marked[:end].endswith(content.lstrip()):
            whole = self.render(messages, add_generation_prompt=False, **extra)
            trimmed = end - (len(content) - len(content.rstrip()))
            for cut in (end, trimmed):
                if whole.startswith(marked[:cut]):
                    return marked[:cut]
        raise ContinuationError("the chat template does not write the last message's content as given, so the "
                                "message cannot be continued")

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages`; `extra` reaches the template as variables (tools, documents, ...)."""
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise ChatTemplateError(
                    f"a chat message must be a mapping with role and content, got {message!r}"
                )
            chat.append(
                {**message, "content": flatten_content(message["content"])}
                if "content" in message
                else dict(message)
            )
        variables = {"tools": None, "documents": None, **self.special_tokens, **extra}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.exceptions.TemplateError, TypeError) as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
