"""Tool calls read out of a model's output text as it streams, per model family (torch-free).

A parser is fed the output text in pieces of any size and answers events: content text, a call
started (its name known), a piece of a call's arguments. Fed the whole text at once it answers the
same calls and content as fed in any chunking, because both run the one character-level scanner.
Every character is looked at a bounded number of times, so a parser is linear in the output.

Formats (``docs/tool_calling.md``):

- ``hermes`` (Qwen2.5, Qwen3, and kvhive's format for templates without tool support):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text before them.
- ``llama3_json`` (Llama 3.x): the output is ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``), calls separated by ``;``; an output that starts otherwise is content.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text, or such an
  array opening the output (a special-token marker does not show in the decoded text).

A call's ``arguments`` are the JSON text the model wrote for them (an arguments value written as a
JSON string is unquoted); ``{}`` when it wrote none. A call is reported once its name is read; a
call object that ends without a string ``name`` goes back to the content, markup and all.
"""

from kvhive.core.tool_parsers.base import ToolCallParser
from kvhive.core.tool_parsers.call_events import (
    HERMES_BEGIN,
    HERMES_END,
    MISTRAL_BEGIN,
    PARSER_NAMES,
    PYTHON_TAG,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ParsedCall,
    ParsedOutput,
    ParseEvent,
    ParserName,
    collect,
)
from kvhive.core.tool_parsers.call_formats import new_parser, parse_whole

__all__ = ["HERMES_BEGIN", "HERMES_END", "MISTRAL_BEGIN", "PARSER_NAMES", "PYTHON_TAG", "ArgumentsDelta",
           "CallStarted", "ContentDelta", "ParseEvent", "ParsedCall", "ParsedOutput", "ParserName",
           "ToolCallParser", "collect", "new_parser", "parse_whole"]
