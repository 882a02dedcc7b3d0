"""The hostile client of a soak drill: one API key sending bad bodies, endless and slow headers
over raw sockets, and bursts of session creates, only while the schedule says hostile.

Every hostile request should be refused with a 4xx (400, 408, 413, 429, 431) or a closed
connection; a spam session under the limits may also be answered 200 (it is then tracked like any
other session). Bodies stay under the server's body limit (``size``) unless they are meant to
exceed it, so the parser really reads them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from soak_clients import MODEL, Run
from soak_figures import HOSTILE_PHASES, phase_at

CHAT = "/v1/chat/completions"
HEAD_TIMEOUT_S = 30.0          # how long an endless-header socket waits for an answer once it stops


def bodies(size: int) -> dict[str, bytes]:
    """Bad JSON bodies of about ``size`` bytes (the oversize one twice the server's limit is built apart)."""
    prefix = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "'.encode()
    nest = size // 2
    return {
        "unterminated_string": prefix + b'\\"' * (size // 2),
        "deep_nesting": f'{{"model": "{MODEL}", "messages": '.encode() + b"[" * nest + b"]" * nest + b"}",
        "huge_number": prefix + b'hi"}], "max_tokens": ' + b"9" * size + b"}",
        "huge_float": prefix + b'hi"}], "temperature": 1' + b"0" * size + b"e999999}",
        "invalid_utf8": prefix + b"\xff\xfe\xc3\x28\xed\xa0\x80" * (size // 7) + b'"}]}',
        "long_key": f'{{"model": "{MODEL}", "'.encode() + b"k" * size + b'": 1}',
    }


def status_line(data: bytes) -> str:
    """'431' from b'HTTP/1.1 431 ...', 'closed' for no data."""
    if not data:
        return "closed"
    parts = data.split(b" ", 2)
    return parts[1].decode("ascii", "replace") if len(parts) > 1 and data.startswith(b"HTTP/") else "garbage"


@dataclass
class Hostile:
    """One hostile client: its target, key, body size, and how long a slow or endless header may last."""

    run: Run
    replicas: dict[str, str]            # name -> base URL
    key: str
    body_bytes: int
    limit_bytes: int
    slow_header_s: float
    spam_burst: int
    spam_ttl_s: int
    rng: random.Random

    def record(self, kind: str, status: str, start: float, replica: str) -> None:
        self.run.record(kind, status, start, "hostile", replica)

    async def post_body(self, http: httpx.AsyncClient, replica: str, kind: str, content: bytes | AsyncIterator[bytes]
                        ) -> None:
        start = time.monotonic()
        try:
            response = await http.post(CHAT, content=content, headers={"Content-Type": "application/json"})
            status = str(response.status_code)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            status = "closed"
        except httpx.HTTPError as exc:
            status = f"exception:{type(exc).__name__}"
        self.record(kind, status, start, replica)
        await self.pause_after(status)

    @staticmethod
    async def pause_after(status: str) -> None:
        """After a refused connection (a replica restarting), wait before the next try."""
        if status.startswith("exception:"):
            await asyncio.sleep(1)

    async def bad_body(self, http: httpx.AsyncClient, replica: str) -> None:
        kind, body = self.rng.choice(list(bodies(self.body_bytes).items()))
        await self.post_body(http, replica, kind, body)

    async def oversize(self, http: httpx.AsyncClient, replica: str) -> None:
        size = 2 * self.limit_bytes + 1
        if self.rng.random() < 0.5:
            await self.post_body(http, replica, "oversize_body", b"[" + b"1," * (size // 2) + b"1]")
            return

        async def chunks() -> AsyncIterator[bytes]:            # no Content-Length: counted as it arrives
            for _ in range(size // 65536 + 1):
                yield b" " * 65536
        await self.post_body(http, replica, "oversize_chunked", chunks())

    async def spam_sessions(self, http: httpx.AsyncClient, replica: str) -> None:
        """A burst of session creates from this key, 8 at a time; the 200s are tracked."""
        gate = asyncio.Semaphore(8)

        async def create(n: int) -> None:
            async with gate:
                start = time.monotonic()
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"spam {n} {self.rng.random()}"}],
                        "max_tokens": 1}
                try:
                    response = await http.post("/v1/context", json=body, headers={"x-session-ttl": str(self.spam_ttl_s)})
                    status = str(response.status_code)
                except httpx.HTTPError as exc:
                    response, status = None, f"exception:{type(exc).__name__}"
                self.record("spam_session", status, start, replica)
                if response is not None and response.status_code == 200:
                    self.run.ledger.created(response.headers["x-session-id"], replica, self.key, self.spam_ttl_s,
                                            self.run.now_s())
        await asyncio.gather(*(create(n) for n in range(self.spam_burst)))
        await self.pause_after(self.run.records[-1].status)

    async def raw_head(self, replica: str, kind: str, piece: Callable[[int], bytes]) -> None:
        """Headers that never end: ``piece(i)`` sent again and again until the server answers or
        closes, or ``limit_bytes`` x 4 went out (then the head is ended, and the answer, whatever it
        is, is recorded as ``unlimited:<status>``)."""
        start, port = time.monotonic(), int(self.replicas[replica].rsplit(":", 1)[1])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            self.record(kind, f"exception:{type(exc).__name__}", start, replica)
            await self.pause_after("exception:")
            return
        reading = asyncio.ensure_future(reader.read(4096))
        status = "held_open"
        try:
            writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: soak\r\nAuthorization: Bearer {self.key}\r\n".encode())
            sent, i = 0, 0
            while sent < 4 * self.limit_bytes and not reading.done():
                chunk = piece(i)
                writer.write(chunk)
                sent, i = sent + len(chunk), i + 1
                await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_S)
            if reading.done():
                status = status_line(reading.result())
            else:                               # every byte taken: the head ends, the answer shows no limit
                writer.write(b"\r\nContent-Length: 0\r\n\r\n")
                await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_S)
                status = f"unlimited:{status_line(await asyncio.wait_for(reading, HEAD_TIMEOUT_S))}"
        except ConnectionError:                  # the server closed it, maybe after answering
            answered = reading.done() and not reading.cancelled() and reading.exception() is None
            status = status_line(reading.result()) if answered else "closed"
        except TimeoutError:
            status = "held_open"
        finally:
            reading.cancel()
            writer.close()
        self.record(kind, status, start, replica)

    async def slow_head(self, replica: str) -> None:
        """A header sent one byte a second on 8 sockets: each must be cut off (408 or closed)
        within ``slow_header_s``, else it counts as held open."""
        port = int(self.replicas[replica].rsplit(":", 1)[1])

        async def one() -> None:
            start = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError as exc:
                self.record("slow_headers", f"exception:{type(exc).__name__}", start, replica)
                await self.pause_after("exception:")
                return
            reading = asyncio.ensure_future(reader.read(4096))
            status = "held_open"
            try:
                writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: soak\r\n".encode())
                while time.monotonic() - start < self.slow_header_s and not reading.done():
                    writer.write(b"X")
                    await writer.drain()
                    await asyncio.wait([reading], timeout=1.0)
                if reading.done():
                    status = status_line(reading.result())
            except ConnectionError:
                status = "closed"
            finally:
                reading.cancel()
                writer.close()
            self.record("slow_headers", status, start, replica)
        await asyncio.gather(*(one() for _ in range(8)))

    async def loop(self) -> None:
        pad = b"a" * 1000
        actions = {
            "bad_body": (6, lambda http, r: self.bad_body(http, r)),
            "oversize": (2, lambda http, r: self.oversize(http, r)),
            "spam": (2, lambda http, r: self.spam_sessions(http, r)),
            "endless_line": (1, lambda http, r: self.raw_head(r, "endless_header_line", lambda i: b"X-Long: " + pad
                                                             if i == 0 else pad)),
            "many_headers": (1, lambda http, r: self.raw_head(r, "many_headers",
                                                              lambda i: f"X-Pad-{i}: ".encode() + pad + b"\r\n")),
            "slow": (1, lambda http, r: self.slow_head(r)),
        }
        names, weights = list(actions), [w for w, _ in actions.values()]
        clients = {name: httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": f"Bearer {self.key}"})
                   for name, url in self.replicas.items()}
        try:
            while time.monotonic() < self.run.deadline:
                if phase_at(self.run.now_s(), self.run.duration_s) not in HOSTILE_PHASES:
                    await asyncio.sleep(1)
                    continue
                replica = self.rng.choice(list(self.replicas))
                await actions[self.rng.choices(names, weights)[0]][1](clients[replica], replica)
        finally:
            for http in clients.values():
                await http.aclose()
