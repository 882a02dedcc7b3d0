"""Why the engine ended one request with an error, as the server tells its client.

``RequestFailed`` is the engine's own fault (a row that computed NaN, a failed step): the route's
500. Its ``ConstraintRefused`` kinds are the request's structured-output constraint ending it: a
400 naming the constraint. The engine reports a request's failure as a message (it crosses to the
server's event loop in a ``RequestOutput``); ``request_failure`` turns the message back into its
kind by the prefix ``grammar_failure`` wrote:

- the constraint hit one of the grammar engine's limits at this point of the output (Earley items
  per row, lexer states or fuel: ``kvhive.structured.compiler.LIMITS``), a grammar far larger or
  more ambiguous than its first token showed: ``ConstraintTooComplex``;
- the constraint allows no token of the model's vocabulary here (a regex character no token
  spells): ``ConstraintDeadEnd``;
- a token the mask allowed that the matcher then refused for any other reason is a server fault.

Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvhive.structured.compiler import GrammarMatcher

TOO_COMPLEX = "the output's grammar exceeded its limits:"
DEAD_END = ("the output's grammar failed:", "the output's grammar allows no token")
NO_TOKEN = "the output's grammar allows no token of this model's vocabulary here"


class RequestFailed(RuntimeError):
    """Computing one request failed (its row, or the step it ran in); the engine runs on."""


class ConstraintRefused(RequestFailed):
    """The request's structured-output constraint ended it (the server answers 400); ``code`` is
    the error's code."""

    code = "constraint_refused"
    summary = "the structured-output constraint ended the output"

    @property
    def detail(self) -> str:
        """What the grammar engine said, without the engine's own prefix and markup."""
        text = str(self)
        for prefix in (TOO_COMPLEX, DEAD_END[0]):
            text = text.removeprefix(prefix)
        return " ".join(word for word in text.split() if word != "<non-verbose/>")


class ConstraintDeadEnd(ConstraintRefused):
    """The constraint cannot be continued with this model's tokens."""

    code = "constraint_dead_end"
    summary = "the structured-output constraint cannot be completed with this model's vocabulary"


class ConstraintTooComplex(ConstraintRefused):
    """The constraint hit the grammar engine's limits partway through the output."""

    code = "constraint_too_complex"
    summary = ("the structured-output constraint is too large or too ambiguous for the grammar engine's "
               "limits at this point of the output")


def grammar_failure(matcher: GrammarMatcher, token: int | None = None) -> str:
    """The failure message of a request whose ``matcher`` is in its error state: while masking
    (``token`` None) or on accepting ``token``."""
    if matcher.hit_limit:
        return f"{TOO_COMPLEX} {matcher.error}"
    if token is None:
        return f"{DEAD_END[0]} {matcher.error}"
    return f"the output's grammar rejected token {token}: {matcher.error}"


def request_failure(message: str) -> RequestFailed:
    """The exception of a request the engine ended with ``message``."""
    if message.startswith(TOO_COMPLEX):
        return ConstraintTooComplex(message)
    if message.startswith(DEAD_END):
        return ConstraintDeadEnd(message)
    return RequestFailed(message)
