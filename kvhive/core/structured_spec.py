"""What a request's output must match (torch-free plain data): the one type the server, the grammar
backend (``kvhive.structured``) and the engine share about constrained decoding.

A spec is hashable, so compiled grammars are cached by it. The server builds specs from
``response_format``, vLLM's ``guided_*``/``structured_outputs`` fields, the Responses API's
``text.format`` and ``tool_choice``; the engine decodes under the grammar compiled from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpecKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "tool_calls"]


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's tool-call text, for ``kind="tool_calls"``: between ``min_calls`` and
    ``max_calls`` (None: no limit) calls, each ``begin`` + a JSON value matching ``schema`` + ``end``,
    calls separated by ``separator``. Hermes (Qwen2.5, Qwen3): begin ``"<tool_call>\\n"``, end
    ``"\\n</tool_call>"``; Llama 3.x: a bare JSON object; Mistral: begin ``"[TOOL_CALLS]"`` and an
    array schema with ``max_calls=1``."""

    begin: str
    end: str
    separator: str = "\n"
    min_calls: int = 1
    max_calls: int | None = None


@dataclass(frozen=True)
class StructuredSpec:
    """One output constraint.

    - ``json_object``: any JSON object.
    - ``json_schema``: JSON matching ``schema`` (its canonical JSON text: sorted keys, no spaces).
    - ``regex``: text matching ``pattern`` in full.
    - ``choice``: exactly one of ``choices``.
    - ``grammar``: text in ``grammar`` (a Lark or EBNF grammar, as the backend reads it).
    - ``tool_calls``: ``tool_format``'s calls, each JSON matching ``schema``.
    """

    kind: SpecKind
    schema: str | None = None
    pattern: str | None = None
    choices: tuple[str, ...] = ()
    grammar: str | None = None
    tool_format: ToolCallFormat | None = None
    # Where the constraint came from, for error messages: the request field ("response_format",
    # "guided_json", "tool_choice", ...).
    source: str = "response_format"

    def __post_init__(self) -> None:
        needs = {"json_schema": self.schema, "regex": self.pattern, "grammar": self.grammar,
                 "choice": self.choices, "tool_calls": self.schema}
        if self.kind in needs and not needs[self.kind]:
            raise ValueError(f"a {self.kind} spec needs its text")
        if self.kind == "tool_calls" and self.tool_format is None:
            raise ValueError("a tool_calls spec needs its tool_format")
