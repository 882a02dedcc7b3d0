"""The well-behaved clients of a soak drill: mixed traffic on one replica with one API key, and
greedy probes whose answers must never change.

Each client loops over scenarios picked at random: chats sharing a long system prompt (streamed or
not), sessions (``POST /v1/context``, turns with ``x-session-id``, mostly deleted at the end; the
ones left alive must still exist when the run ends), ``conversation_id`` chats ended with
``end_conversation``, streams dropped after a few chunks, ``/v1/responses`` chains
(``previous_response_id``), and probes: fixed prompts at temperature 0 asked plainly, streamed,
with a fresh ``cache_salt`` (nothing cached) or as a session and a turn on it, whose answers must
equal the ones the quiet replica gave at the start.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from soak_figures import Ledger, Record, Windows

MODEL = "smollm2-135m"
SHARED_SYSTEM = ("You are the help desk of a company that builds inference servers. Answer in one or two "
                 "short sentences. " + " ".join(f"Rule {i}: keep answer {i} polite, factual and brief."
                                                for i in range(30)))
TOPICS = ("caching", "sessions", "the disk tier", "Redis", "metrics", "streaming", "tokenizers", "GPUs",
          "batching", "prefix sharing", "timeouts", "API keys", "block sizes", "context length")
PROBES = ("What is the capital of France?", "Name three primary colors.", "Count from one to ten in words.",
          "Write one sentence about the sea.", "What does a cache do?", "Give me a word that rhymes with light.")
FOLLOW_UP = "Now say it again in other words."
PROBE_TOKENS = 24
# How often each scenario is picked (relative weights).
SCENARIOS = {"shared_chat": 4, "session": 2, "conversation": 1, "aborted_stream": 1, "responses_chain": 2, "probe": 2}


def question(rng: random.Random) -> str:
    return f"In {rng.randint(2, 40)} words, what should I know about {rng.choice(TOPICS)}? (#{rng.randint(0, 10**6)})"


def probe_messages(probe: int, first_answer: str | None = None) -> list[dict[str, str]]:
    """A probe's chat: its question, and with ``first_answer`` the follow-up turn too."""
    messages = [{"role": "user", "content": PROBES[probe]}]
    if first_answer is not None:
        messages += [{"role": "assistant", "content": first_answer}, {"role": "user", "content": FOLLOW_UP}]
    return messages


def probe_body(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": PROBE_TOKENS, "temperature": 0, **extra}


@dataclass
class Run:
    """What the clients share: the clock, the records, the sessions to account for, the fault
    windows and the probes' reference answers per replica."""

    started: float
    duration_s: float
    session_ttl_s: int
    references: dict[str, list[tuple[str, str]]]     # replica -> per probe (answer, follow-up answer)
    records: list[Record] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    windows: Windows = field(default_factory=Windows)
    probes: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)     # session lookups: when -> statuses

    @property
    def deadline(self) -> float:
        return self.started + self.duration_s

    def now_s(self) -> float:
        return time.monotonic() - self.started

    def note(self, event: str) -> None:
        self.events.append({"at_s": round(self.now_s(), 1), "event": event})
        print(f"[{self.now_s():6.0f} s] {event}", flush=True)

    def record(self, kind: str, status: int | str, start: float, client: str, replica: str) -> None:
        self.records.append(Record(kind, str(status), time.monotonic() - start, start - self.started, client, replica))


@dataclass
class Client:
    """One well-behaved client: its replica, its HTTP client (carrying its API key) and its dice."""

    run: Run
    replica: str
    key: str
    http: httpx.AsyncClient
    rng: random.Random

    async def call(self, kind: str, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        """One request; its response (None when no answer came: recorded as an exception)."""
        start = time.monotonic()
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.run.record(kind, f"exception:{type(exc).__name__}", start, "good", self.replica)
            await asyncio.sleep(1)             # a replica restarting refuses connections at once
            return None
        self.run.record(kind, response.status_code, start, "good", self.replica)
        return response

    async def stream(self, kind: str, body: dict[str, Any], abort_after: int | None = None) -> str | None:
        """A streamed chat completion; its text, or None. ``abort_after``: drop the connection after
        that many content chunks (recorded as "aborted")."""
        start, text = time.monotonic(), []
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    await response.aread()
                    self.run.record(kind, response.status_code, start, "good", self.replica)
                    return None
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.run.record(kind, "stream_error", start, "good", self.replica)
                        return None
                    text += [c["delta"]["content"] for c in event.get("choices", []) if c["delta"].get("content")]
                    if abort_after is not None and len(text) >= abort_after:
                        self.run.record(kind, "aborted", start, "good", self.replica)
                        return None              # leaving the block closes the connection
        except httpx.HTTPError as exc:
            self.run.record(kind, f"exception:{type(exc).__name__}", start, "good", self.replica)
            await asyncio.sleep(1)
            return None
        self.run.record(kind, 200, start, "good", self.replica)
        return "".join(text)

    def body(self, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": messages, "max_tokens": self.rng.randint(8, 24), "temperature": 0.7,
                **extra}

    async def shared_chat(self) -> None:
        messages = [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question(self.rng)}]
        if self.rng.random() < 0.5:
            await self.stream("chat_stream", self.body(messages))
        else:
            await self.call("chat", "POST", "/v1/chat/completions", json=self.body(messages))

    async def open_session(self, kind: str, body: dict[str, Any]) -> tuple[str, str] | None:
        """POST /v1/context; (session id, answer) once it answered 200 (then tracked)."""
        response = await self.call(kind, "POST", "/v1/context", json=body,
                                   headers={"x-session-ttl": str(self.run.session_ttl_s)})
        if response is None or response.status_code != 200:
            return None
        session_id = response.headers["x-session-id"]
        self.run.ledger.created(session_id, self.replica, self.key, self.run.session_ttl_s, self.run.now_s())
        return session_id, response.json()["choices"][0]["message"]["content"]

    async def turn(self, kind: str, session_id: str, body: dict[str, Any]) -> str | None:
        """A turn on a tracked session; its answer, or None (a 404 on a session that must exist is a loss)."""
        response = await self.call(kind, "POST", "/v1/chat/completions", json=body,
                                   headers={"x-session-id": session_id})
        if response is not None and response.status_code == 404:
            self.run.ledger.missing(session_id, self.run.now_s(), "turn answered 404")
        if response is None or response.status_code != 200:
            return None
        self.run.ledger.answered(session_id, self.run.now_s())
        return response.json()["choices"][0]["message"]["content"]

    async def close_session(self, session_id: str) -> None:
        self.run.ledger.deleting(session_id)
        response = await self.call("context_delete", "DELETE", f"/v1/context/{session_id}")
        self.run.ledger.deleting(session_id, False)
        if response is not None and response.status_code == 404:
            self.run.ledger.missing(session_id, self.run.now_s(), "delete answered 404")
        if response is not None and response.status_code == 200:
            self.run.ledger.deleted(session_id)

    async def session(self) -> None:
        messages = [{"role": "system", "content": f"{SHARED_SYSTEM} Manual {self.rng.randint(0, 10**6)}."},
                    {"role": "user", "content": question(self.rng)}]
        opened = await self.open_session("context_create", self.body(messages))
        if opened is None:
            return
        session_id, answer = opened
        for _ in range(self.rng.randint(1, 3)):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question(self.rng)}]
            answer = await self.turn("session_turn", session_id, self.body(messages))
            if answer is None:
                break
        if self.rng.random() < 0.75:
            await self.close_session(session_id)

    async def conversation(self) -> None:
        conversation_id = f"soak-{uuid.uuid4().hex}"
        messages = [{"role": "user", "content": question(self.rng)}]
        turns = self.rng.randint(2, 3)
        for i in range(turns):
            body = self.body(messages, conversation_id=conversation_id, end_conversation=i == turns - 1)
            response = await self.call("conversation_turn", "POST", "/v1/chat/completions", json=body)
            if response is None or response.status_code != 200:
                return
            messages += [{"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": question(self.rng)}]

    async def aborted_stream(self) -> None:
        messages = [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question(self.rng)}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 200, "ignore_eos": True}
        await self.stream("aborted_stream", body, abort_after=self.rng.randint(1, 4))

    async def responses_chain(self) -> None:
        previous, ids = None, []
        for _ in range(self.rng.randint(2, 3)):
            body = {"model": MODEL, "instructions": "Be brief.", "input": question(self.rng),
                    "max_output_tokens": self.rng.randint(8, 24), "previous_response_id": previous}
            response = await self.call("responses", "POST", "/v1/responses", json=body)
            if response is None or response.status_code != 200:
                break
            previous = response.json()["id"]
            ids.append(previous)
        if ids and self.rng.random() < 0.5:
            for response_id in ids:
                await self.call("responses_delete", "DELETE", f"/v1/responses/{response_id}")

    def check(self, probe: int, mode: str, expected: str, got: str | None) -> None:
        if got is not None:
            self.run.probes.append({"probe": probe, "mode": mode, "replica": self.replica, "at_s": self.run.now_s(),
                                    "ok": got == expected, **({} if got == expected else
                                                              {"expected": expected, "got": got})})

    async def probe(self) -> None:
        """One probe, asked one of four ways; its answer checked against the reference."""
        index = self.rng.randrange(len(PROBES))
        first, second = self.run.references[self.replica][index]
        mode = self.rng.choice(("cached", "stream", "uncached", "session"))
        if mode == "stream":
            self.check(index, mode, first, await self.stream("probe", probe_body(probe_messages(index))))
        elif mode in ("cached", "uncached"):
            extra = {"cache_salt": uuid.uuid4().hex} if mode == "uncached" else {}
            response = await self.call("probe", "POST", "/v1/chat/completions",
                                       json=probe_body(probe_messages(index), **extra))
            if response is not None and response.status_code == 200:
                self.check(index, mode, first, response.json()["choices"][0]["message"]["content"])
        else:
            opened = await self.open_session("probe_session", probe_body(probe_messages(index)))
            if opened is None:
                return
            session_id, answer = opened
            self.check(index, "session", first, answer)
            self.check(index, "session turn", second,
                       await self.turn("probe_session", session_id, probe_body(probe_messages(index, first))))
            await self.close_session(session_id)

    async def loop(self) -> None:
        names, weights = list(SCENARIOS), list(SCENARIOS.values())
        while time.monotonic() < self.run.deadline:
            name = self.rng.choices(names, weights)[0]
            start = time.monotonic()
            try:
                await getattr(self, name)()
            except (KeyError, ValueError, TypeError) as exc:    # an answer of an unexpected shape
                self.run.record(name, f"bad_answer:{type(exc).__name__}", start, "good", self.replica)


async def reference_answers(base_url: str, key: str) -> list[tuple[str, str]]:
    """Each probe's greedy answer and follow-up answer, asked once on the quiet replica."""
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as http:
        for index in range(len(PROBES)):
            r1 = await http.post("/v1/chat/completions", json=probe_body(probe_messages(index)))
            r1.raise_for_status()
            a1 = r1.json()["choices"][0]["message"]["content"]
            r2 = await http.post("/v1/chat/completions", json=probe_body(probe_messages(index, a1)))
            r2.raise_for_status()
            out.append((a1, r2.json()["choices"][0]["message"]["content"]))
    return out
