"""Where stored responses persist: per conversation, in a disk directory or Redis.

A conversation record is ``{"id", "owner", "expires", "responses": [StoredResponse.to_json()...]}``
(``Conversation.to_json()``), a record of ``kvhive.sessions.expiring``. Both backends write one
response at a time (``save_response``: a turn costs one record, whatever the length of its
conversation) and keep the conversation's expiry beside its responses.

- ``FileResponseBackend`` (``--disk-cache-dir`` without ``--redis-url``; local to one replica): one
  directory per conversation under ``responses/``, holding ``conversation.json`` (id, owner,
  expires) and one file per response, each replaced atomically; a save that fails (a full disk)
  removes what it wrote, and the temp files a kill leaves are removed at start. Loaded whole at start.
- ``RedisResponseBackend`` (``--redis-url``; shared by replicas): one hash per conversation,
  ``{prefix}:{owner}:{id}`` (``kvhive:{model}:responses:{owner}:{id}``, named by
  ``kvhive.sessions.durable``), with a field per response and a ``conversation`` field, whose Redis
  expiry is the conversation's, so Redis drops dead conversations itself. ``shared``: read again
  on each use, never loaded whole. Calls go through the URL's ``RedisGuard`` as the session
  backend's do (record thread, writes queued, ``RedisUnavailable`` while Redis is unreachable).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from typing import Any, Protocol

from kvhive.core.atomic_file import atomic_write
from kvhive.sessions.backends import RedisRecords, record_digest, remove_temp_files
from kvhive.sessions.expiring import RecordBackend

logger = logging.getLogger(__name__)

RESPONSES_DIR = "responses"
CONVERSATION_FILE = "conversation.json"
CONVERSATION_FIELD = "conversation"


class ResponseBackend(RecordBackend, Protocol):
    """Conversation records keyed by (owner, conversation id): ``save`` adds or replaces the
    responses of a record (and sets the conversation's expiry), ``delete`` forgets all of them."""

    def save_response(self, owner: str | None, conversation_id: str, expires: float,
                      response: dict[str, Any]) -> None:
        """Add or replace one response of the conversation, whose expiry becomes ``expires``."""

    def delete_response(self, owner: str | None, conversation_id: str, response_id: str) -> None:
        """Forget one response (no error if there is none)."""


def _header(owner: str | None, conversation_id: str, expires: float) -> dict[str, Any]:
    return {"id": conversation_id, "owner": owner, "expires": expires}


class FileResponseBackend:
    """A directory per conversation in ``{directory}/responses``; every file replaced atomically."""

    shared = False

    def __init__(self, directory: str) -> None:
        self.directory = os.path.join(directory, RESPONSES_DIR)
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if os.path.isdir(path):
                remove_temp_files(path)

    def _dir(self, owner: str | None, conversation_id: str) -> str:
        return os.path.join(self.directory, record_digest(owner, conversation_id))

    def load_all(self) -> list[dict[str, Any]]:
        """Every conversation in the directory (an unreadable one is logged and skipped)."""
        records = []
        for name in sorted(os.listdir(self.directory)):
            record = self._read(os.path.join(self.directory, name))
            if record is not None:
                records.append(record)
        return records

    def load(self, owner: str | None, conversation_id: str) -> dict[str, Any] | None:
        """The conversation's record, or None."""
        return self._read(self._dir(owner, conversation_id))

    def _read(self, path: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(path, CONVERSATION_FILE), "rb") as f:
                record = json.loads(f.read())
            record["responses"] = []
            for name in sorted(os.listdir(path)):
                if name.endswith(".json") and name != CONVERSATION_FILE:
                    with open(os.path.join(path, name), "rb") as f:
                        record["responses"].append(json.loads(f.read()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            logger.exception("skipping unreadable stored responses in %s", path)
            return None
        return record

    def save_response(self, owner: str | None, conversation_id: str, expires: float,
                      response: dict[str, Any]) -> None:
        """Write the response's file, then the conversation's new expiry. On OSError (a full disk)
        a new response's file goes again and the conversation stays as it was."""
        path = self._dir(owner, conversation_id)
        response_path = os.path.join(path, f"{response['response']['id']}.json")
        header = _header(owner, conversation_id, expires)
        existed = os.path.exists(response_path)
        try:
            os.makedirs(path, exist_ok=True)
            atomic_write(response_path, json.dumps(response).encode())
            atomic_write(os.path.join(path, CONVERSATION_FILE), json.dumps(header).encode())
        except OSError:
            if not existed:
                with contextlib.suppress(OSError):
                    os.unlink(response_path)
            with contextlib.suppress(OSError):
                os.rmdir(path)                  # only when empty: a new conversation's directory
            raise

    def save(self, record: dict[str, Any]) -> None:
        """Write each response's file, then the conversation's expiry."""
        for response in record["responses"]:
            self.save_response(record["owner"], record["id"], record["expires"], response)

    def delete_response(self, owner: str | None, conversation_id: str, response_id: str) -> None:
        """Remove the response's file."""
        try:
            os.unlink(os.path.join(self._dir(owner, conversation_id), f"{response_id}.json"))
        except FileNotFoundError:
            pass

    def delete(self, owner: str | None, conversation_id: str) -> None:
        """Remove the conversation's directory."""
        shutil.rmtree(self._dir(owner, conversation_id), ignore_errors=True)


class RedisResponseBackend(RedisRecords):
    """One Redis hash per conversation under ``prefix``, expiring when the conversation does."""

    noun = "conversation"

    def load(self, owner: str | None, conversation_id: str) -> dict[str, Any] | None:
        """The conversation's record, or None (Redis drops it at its expiry); blocks until read
        (RedisUnavailable while Redis is unreachable)."""
        fields = self.guard.read(lambda: self.client.hgetall(self.key(owner, conversation_id)))
        header = fields.pop(CONVERSATION_FIELD.encode(), None)
        if header is None:
            return None
        record = json.loads(header)
        record["responses"] = [json.loads(value) for value in fields.values()]
        return record

    def save_response(self, owner: str | None, conversation_id: str, expires: float,
                      response: dict[str, Any]) -> None:
        """Queue one transaction: the response's field, the conversation's field, the key's expiry."""
        self.save({**_header(owner, conversation_id, expires), "responses": [response]})

    def save(self, record: dict[str, Any]) -> None:
        """Queue one transaction: the responses' fields, the conversation's field, the key's
        expiry (PEXPIREAT)."""
        owner, conversation_id, expires = record["owner"], record["id"], record["expires"]
        responses: list[dict[str, Any]] = record["responses"]
        key = self.key(owner, conversation_id)
        fields = {CONVERSATION_FIELD: json.dumps(_header(owner, conversation_id, expires))}
        fields.update({response["response"]["id"]: json.dumps(response) for response in responses})

        def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(key, mapping=fields)
            pipe.pexpireat(key, max(1, int(expires * 1000)))
            pipe.execute()

        self.guard.write(write, f"conversation {conversation_id}")

    def delete_response(self, owner: str | None, conversation_id: str, response_id: str) -> None:
        """Queue the deletion of the response's field."""
        key = self.key(owner, conversation_id)
        self.guard.write(lambda: self.client.hdel(key, response_id), f"the deletion of {response_id}")
