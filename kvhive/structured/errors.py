"""The error a structured-output spec that cannot be served raises (the server answers 400)."""

from __future__ import annotations


class StructuredOutputError(ValueError):
    """A spec the grammar library cannot compile, one too large, or one whose grammar admits no
    output. ``param`` names the request field it came from (``StructuredSpec.source``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
