"""One HTTP request as the ingress hands it to a replica through a ``DeploymentHandle`` (plain,
picklable data), and what the request router reads from it: its prompt, the session it names and
the replica its prompt_cache_key was last answered by."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvhive.core.json_body import BodyError, load_json
from kvhive.core.tenancy import key_owner
from kvhive.routing.affinity import SESSION_HEADER
from kvhive.routing.prompts import Prompt, prompt_for_path

# Paths that name a session (its fork too) or a stored response: sent to its holder.
_HELD_PATH = re.compile(r"^/v1/(?:context/([^/]+)(?:/fork)?|responses/([^/]+)(?:/input_items)?)$")
# The header a replica names itself in, so the ingress learns which replica holds what.
REPLICA_HEADER = "x-kvhive-replica"


@dataclass(frozen=True)
class HTTPEnvelope:
    """An HTTP request for a replica: method, path, raw query, headers (lower-case names), body;
    ``holder``: the replica (its unique id) the ingress knows holds the session the request names;
    ``key_holder``: the replica that last answered the caller's prompt_cache_key."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[str, str], ...]
    body: bytes
    holder: str | None = None
    key_holder: str | None = None

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower-case), or None."""
        return next((v for k, v in self.headers if k == name), None)

    @property
    def owner(self) -> str:
        """The digest of the caller's API key that replicas key sessions by."""
        return key_owner(self.header("authorization"), self.header("x-api-key"))

    def json_body(self) -> dict[str, Any] | None:
        """The body as a JSON object, or None when it is none (the replica answers it)."""
        if not self.body or self.method != "POST":
            return None
        try:
            data = load_json(self.body)
        except (BodyError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def session_named(self, data: dict[str, Any] | None) -> str | None:
        """The session or stored response the request names: x-session-id, a chat
        ``conversation_id``, ``previous_response_id``, or the id in a /v1/context (a fork's parent
        too) or /v1/responses path."""
        named = self.header(SESSION_HEADER)
        if named:
            return named
        for key in ("conversation_id", "previous_response_id"):
            if data is not None and isinstance(data.get(key), str):
                return data[key]
        held = _HELD_PATH.match(self.path)
        return (held.group(1) or held.group(2)) if held else None

    @property
    def prompt(self) -> str | list[Any]:
        """The body's ``prompt``, chat ``messages`` or Responses ``input`` as sent (for a request with
        none, its method and path): what Ray's own routers (``PrefixCacheAffinityRouter``) read from
        a request's first argument, which they need non-empty."""
        data = self.json_body() or {}
        text = next((data[k] for k in ("prompt", "messages", "input") if k in data), None)
        return text if isinstance(text, (str, list)) and text else f"{self.method} {self.path}"

    def routing_prompt(self, data: dict[str, Any] | None, salt_with_key: bool) -> Prompt | None:
        """The prompt the replica will read (salted by the caller's key when replicas salt so)."""
        if data is None:
            return None
        return prompt_for_path(self.path, data, self.owner if salt_with_key else None)
