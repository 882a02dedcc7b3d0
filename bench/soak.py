#!/usr/bin/env python3
"""Soak test: N clients for T minutes of mixed traffic against a kvhive server this script starts.

    python bench/soak.py --clients 8 --minutes 2
    python bench/soak.py --clients 8 --minutes 2 --redis-url redis://127.0.0.1:6391/0 \\
        --out bench/results/soak_redis.json                  # + a Redis stall and flush
    python bench/soak.py --server-args "--dtype bfloat16 --kv-cache-gb 0.5" --out /tmp/soak_bf16.json
    python bench/soak.py --clients 32 --minutes 30 --redis-url redis://127.0.0.1:6391/0 --redis-stop-s 20 \\
        --server-args "--kv-cache-gb 0.25 --max-model-len 2048 --default-session-ttl 120" --drain-s 300

Each client loops over scenarios picked at random: chats sharing a long system prompt (streamed or
not), sessions (``POST /v1/context``, turns with ``x-session-id``, mostly deleted at the end),
``conversation_id`` chats ended with ``end_conversation``, streams the client drops after a few
chunks, and ``/v1/responses`` chains (``previous_response_id``). With ``--redis-url`` the script
starts a ``redis-server`` on that URL's port, the server uses it as its KV tier and session store,
and halfway through Redis is stopped (SIGSTOP) for ``--redis-stop-s`` seconds, then flushed.

Reports requests, answers by status (intended aborts apart), p50/p99 latency overall and per
request kind, the server's RSS (sampled every 10 s), the device block gauges
(``kvhive_kv_blocks{state}``) and live sessions before and after (``--drain-s``: after the
sessions left alive expired); writes ``--out``
(``bench/results/soak.json``). The server's log goes to ``bench/out/soak_server.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from run_info import command, machine

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = "smollm2-135m"
SHARED_SYSTEM = ("You are the help desk of a company that builds inference servers. Answer in one or two "
                 "short sentences. " + " ".join(f"Rule {i}: keep answer {i} polite, factual and brief."
                                                for i in range(30)))
TOPICS = ("caching", "sessions", "the disk tier", "Redis", "metrics", "streaming", "tokenizers", "GPUs",
          "batching", "prefix sharing", "timeouts", "API keys", "block sizes", "context length")
# How often each scenario is picked (relative weights).
SCENARIOS = {"shared_chat": 4, "session": 2, "conversation": 1, "aborted_stream": 1, "responses_chain": 2}
METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def question(rng: random.Random) -> str:
    return f"In {rng.randint(2, 40)} words, what should I know about {rng.choice(TOPICS)}? (#{rng.randint(0, 10**6)})"


@dataclass
class Record:
    """One HTTP exchange: its kind, status ("aborted" for streams dropped on purpose,
    "exception:<type>" when no answer came), latency and start time (s since the run began)."""

    kind: str
    status: str
    latency_s: float
    at_s: float


@dataclass
class Run:
    """What the clients share: the server's URL, the clock and the records."""

    base_url: str
    deadline: float
    started: float
    records: list[Record] = field(default_factory=list)

    def record(self, kind: str, status: int | str, start: float) -> None:
        now = time.monotonic()
        self.records.append(Record(kind, str(status), now - start, start - self.started))


async def call(run: Run, client: httpx.AsyncClient, kind: str, method: str, path: str,
               **kwargs: Any) -> httpx.Response | None:
    """One request; its response (None when the request itself failed: recorded as an exception)."""
    start = time.monotonic()
    try:
        response = await client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        run.record(kind, f"exception:{type(exc).__name__}", start)
        return None
    run.record(kind, response.status_code, start)
    return response


async def stream_chat(run: Run, client: httpx.AsyncClient, kind: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None, abort_after: int | None = None) -> str | None:
    """A streamed chat completion; its text, or None. ``abort_after``: drop the connection after
    that many content chunks (recorded as "aborted")."""
    start = time.monotonic()
    text, chunks = [], 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                 headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                run.record(kind, response.status_code, start)
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    run.record(kind, "stream_error", start)
                    return None
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        text.append(choice["delta"]["content"])
                        chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    run.record(kind, "aborted", start)
                    return None                    # leaving the block closes the connection
    except httpx.HTTPError as exc:
        run.record(kind, f"exception:{type(exc).__name__}", start)
        return None
    run.record(kind, 200, start)
    return "".join(text)


def chat_body(messages: list[dict[str, str]], rng: random.Random, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": rng.randint(8, 24), "temperature": 0.7, **extra}


async def shared_chat(run: Run, client: httpx.AsyncClient, rng: random.Random) -> None:
    messages = [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question(rng)}]
    if rng.random() < 0.5:
        await stream_chat(run, client, "chat_stream", chat_body(messages, rng))
    else:
        await call(run, client, "chat", "POST", "/v1/chat/completions", json=chat_body(messages, rng))


async def session(run: Run, client: httpx.AsyncClient, rng: random.Random) -> None:
    messages = [{"role": "system", "content": f"{SHARED_SYSTEM} Manual {rng.randint(0, 10**6)}."},
                {"role": "user", "content": question(rng)}]
    response = await call(run, client, "context_create", "POST", "/v1/context", json=chat_body(messages, rng),
                          headers={"x-session-ttl": "120"})
    if response is None or response.status_code != 200:
        return
    session_id = response.headers["x-session-id"]
    messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": question(rng)})
        turn = await call(run, client, "session_turn", "POST", "/v1/chat/completions",
                          json=chat_body(messages, rng), headers={"x-session-id": session_id})
        if turn is None or turn.status_code != 200:
            break
        messages.append({"role": "assistant", "content": turn.json()["choices"][0]["message"]["content"]})
    if rng.random() < 0.75:
        await call(run, client, "context_delete", "DELETE", f"/v1/context/{session_id}")


async def conversation(run: Run, client: httpx.AsyncClient, rng: random.Random) -> None:
    conversation_id = f"soak-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": question(rng)}]
    turns = rng.randint(2, 3)
    for i in range(turns):
        body = chat_body(messages, rng, conversation_id=conversation_id, end_conversation=i == turns - 1)
        response = await call(run, client, "conversation_turn", "POST", "/v1/chat/completions", json=body)
        if response is None or response.status_code != 200:
            return
        messages += [{"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": question(rng)}]


async def aborted_stream(run: Run, client: httpx.AsyncClient, rng: random.Random) -> None:
    messages = [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question(rng)}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 200, "ignore_eos": True}
    await stream_chat(run, client, "aborted_stream", body, abort_after=rng.randint(1, 4))


async def responses_chain(run: Run, client: httpx.AsyncClient, rng: random.Random) -> None:
    previous, ids = None, []
    for _ in range(rng.randint(2, 3)):
        body = {"model": MODEL, "instructions": "Be brief.", "input": question(rng),
                "max_output_tokens": rng.randint(8, 24), "previous_response_id": previous}
        response = await call(run, client, "responses", "POST", "/v1/responses", json=body)
        if response is None or response.status_code != 200:
            break
        previous = response.json()["id"]
        ids.append(previous)
    if ids and rng.random() < 0.5:
        for response_id in ids:
            await call(run, client, "responses_delete", "DELETE", f"/v1/responses/{response_id}")


SCENARIO_FUNCTIONS = {"shared_chat": shared_chat, "session": session, "conversation": conversation,
                      "aborted_stream": aborted_stream, "responses_chain": responses_chain}


async def client_loop(run: Run, index: int, seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    names, weights = list(SCENARIOS), list(SCENARIOS.values())
    async with httpx.AsyncClient(base_url=run.base_url, timeout=120) as client:
        while time.monotonic() < run.deadline:
            name = rng.choices(names, weights)[0]
            start = time.monotonic()
            try:
                await SCENARIO_FUNCTIONS[name](run, client, rng)
            except (KeyError, ValueError, TypeError) as exc:    # an answer of an unexpected shape
                run.record(name, f"bad_answer:{type(exc).__name__}", start)


# ---------------------------------------------------------------- the server and what it reports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    """Resident set size of a process in MB (/proc), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(base_url: str) -> dict[str, float]:
    """The samples soak reports, from /metrics: block states, sessions, stored responses, KV usage."""
    wanted = {"kvhive_kv_blocks", "kvhive_sessions_live", "kvhive_responses_stored", "kvhive_kv_cache_usage_perc",
              "kvhive_num_requests_running", "kvhive_num_requests_waiting", "kvhive_session_blocks",
              "kvhive_kv_tier_errors_total", "kvhive_kv_tier_usage_bytes"}
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        match = METRIC_LINE.match(line)
        if not match or match.group(1) not in wanted:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        labels.pop("model_name", None)
        suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out[f"{match.group(1)}{{{suffix}}}" if suffix else match.group(1)] = float(match.group(3))
    return out


def snapshot(base_url: str, pid: int) -> dict[str, Any]:
    return {"rss_mb": rss_mb(pid), "metrics": scrape(base_url)}


LEFT_BEHIND = ("kvhive_sessions_live", "kvhive_responses_stored", "kvhive_kv_blocks{state=used}")


def drain(base_url: str, timeout_s: float) -> float | None:
    """Seconds until no session, stored response or used block is left (their TTLs ran out and
    the sweep freed them); None when some still are after ``timeout_s`` (or nothing was waited for)."""
    start = time.monotonic()
    while timeout_s > 0:
        samples = scrape(base_url)
        if all(samples.get(name, 0.0) == 0.0 for name in LEFT_BEHIND):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(5)
    return None


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s")


class RedisServer:
    """A redis-server on the URL's port, without persistence, for the run; ``fault`` stops it
    (SIGSTOP) for a while, then flushes it."""

    def __init__(self, url: str, log_path: str) -> None:
        import redis

        parts = urlsplit(url)
        self.port = parts.port or 6379
        self.log = open(log_path, "w")            # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "",
                                         "--appendonly", "no", "--bind", "127.0.0.1"],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if self.client.ping():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def fault(self, stop_s: float, events: list[dict[str, Any]], started: float) -> None:
        events.append({"at_s": time.monotonic() - started, "event": "SIGSTOP"})
        self.process.send_signal(signal.SIGSTOP)
        time.sleep(stop_s)
        self.process.send_signal(signal.SIGCONT)
        events.append({"at_s": time.monotonic() - started, "event": "SIGCONT"})
        self.client.flushall()
        events.append({"at_s": time.monotonic() - started, "event": "FLUSHALL"})

    def stop(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(records: list[Record]) -> dict[str, Any]:
    """Counts by status, errors (neither 2xx nor an intended abort), latency percentiles per kind."""
    by_status: dict[str, int] = {}
    for r in records:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    errors = {s: n for s, n in by_status.items() if not (s.startswith("2") or s == "aborted")}
    kinds: dict[str, dict[str, Any]] = {}
    for kind in sorted({r.kind for r in records}):
        done = [r.latency_s for r in records if r.kind == kind and r.status.startswith("2")]
        statuses: dict[str, int] = {}
        for r in records:
            if r.kind == kind:
                statuses[r.status] = statuses.get(r.status, 0) + 1
        kinds[kind] = {"requests": sum(statuses.values()), "statuses": statuses,
                       "p50_s": percentile(done, 0.5), "p99_s": percentile(done, 0.99)}
    ok = [r.latency_s for r in records if r.status.startswith("2")]
    return {"requests": len(records), "by_status": dict(sorted(by_status.items())), "errors": errors,
            "num_errors": sum(errors.values()), "p50_s": percentile(ok, 0.5), "p99_s": percentile(ok, 0.99),
            "mean_s": statistics.fmean(ok) if ok else None, "kinds": kinds}


async def soak(args: argparse.Namespace, base_url: str, pid: int, redis: RedisServer | None
               ) -> tuple[Run, list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the clients (and the Redis fault); the run, the RSS/gauge timeline and the fault events."""
    started = time.monotonic()
    run = Run(base_url, deadline=started + args.minutes * 60, started=started)
    timeline: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []

    async def sample() -> None:
        while True:
            point = await asyncio.to_thread(snapshot, base_url, pid)
            timeline.append({"at_s": round(time.monotonic() - started, 1), **point})
            await asyncio.sleep(10)

    async def fault() -> None:
        await asyncio.sleep(args.minutes * 30)
        assert redis is not None
        await asyncio.to_thread(redis.fault, args.redis_stop_s, events, started)

    background = [asyncio.create_task(sample())]
    if redis is not None:
        background.append(asyncio.create_task(fault()))
    clients = [asyncio.create_task(client_loop(run, i, args.seed)) for i in range(args.clients)]
    # Past the deadline, a client finishes its scenario; one still busy after the grace is cancelled.
    done, pending = await asyncio.wait(clients, timeout=args.minutes * 60 + args.grace_s)
    for task in pending:
        task.cancel()
    for task in done:
        task.result()
    for task in background:
        if task.done():
            task.result()
        task.cancel()
    return run, timeline, events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default=None, help="start redis-server on this URL's port and fault it halfway")
    parser.add_argument("--redis-stop-s", type=float, default=10.0, help="how long Redis stays stopped")
    parser.add_argument("--server-args", default="--kv-cache-gb 0.25 --max-model-len 2048",
                        help="more 'kvhive serve' arguments")
    parser.add_argument("--grace-s", type=float, default=120.0, help="time a client may finish its scenario")
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle time before the 'after' snapshot")
    parser.add_argument("--drain-s", type=float, default=0.0,
                        help="then wait up to this long for the sessions left alive to expire (no live "
                             "session, stored response or used block) before the 'after' snapshot")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    args = parser.parse_args()

    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    redis = RedisServer(args.redis_url, os.path.join(HERE, "out", "soak_redis.log")) if args.redis_url else None
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(port), "--log-level", "warning",
           *shlex.split(args.server_args)]
    if args.redis_url:
        cmd += ["--redis-url", args.redis_url]
    print("+", shlex.join(cmd), flush=True)
    log_path = os.path.join(HERE, "out", "soak_server.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        print(f"healthy after {wait_healthy(base_url, server, 600):.0f} s", flush=True)
        before = snapshot(base_url, server.pid)
        run, timeline, events = asyncio.run(soak(args, base_url, server.pid, redis))
        time.sleep(args.idle_s)
        drained_s = drain(base_url, args.drain_s)
        after = snapshot(base_url, server.pid)
        healthy = httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    finally:
        server.terminate()
        try:
            exit_code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            exit_code = server.wait()
        if redis is not None:
            redis.stop()

    summary = summarize(run.records)
    rss = [p["rss_mb"] for p in timeline if p["rss_mb"] is not None]
    result = {
        "machine": machine(), "command": command(__file__),
        "config": {"clients": args.clients, "minutes": args.minutes, "seed": args.seed, "server": shlex.join(cmd),
                   "redis_url": args.redis_url, "redis_stop_s": args.redis_stop_s if args.redis_url else None,
                   "scenarios": SCENARIOS, "host": platform.node(), "cpus": os.cpu_count()},
        "summary": summary,
        "throughput_rps": len(run.records) / (args.minutes * 60),
        "before": before, "after": after,
        "rss_mb": {"before": before["rss_mb"], "after": after["rss_mb"], "max": max(rss, default=None)},
        "healthy_after": healthy, "server_exit_code": exit_code,
        "drained_after_s": drained_s,
        "redis_events": events, "timeline": timeline,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_report(result)
    print(f"wrote {args.out}")
    return 0 if summary["num_errors"] == 0 and healthy and exit_code == 0 else 1


def print_report(result: dict[str, Any]) -> None:
    s = result["summary"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    print(f"requests {s['requests']} ({result['throughput_rps']:.2f}/s), errors {s['num_errors']} {s['errors']}, "
          f"by status {s['by_status']}")
    print(f"latency of answered requests: p50 {ms(s['p50_s'])}, p99 {ms(s['p99_s'])}")
    for kind, k in s["kinds"].items():
        print(f"  {kind:<18} {k['requests']:>5}  p50 {ms(k['p50_s']):>8}  p99 {ms(k['p99_s']):>8}  {k['statuses']}")
    rss = {k: "-" if v is None else f"{v:.0f} MB" for k, v in result["rss_mb"].items()}
    print(f"server RSS: {rss['before']} before, {rss['after']} after, max sampled {rss['max']}")
    for when in ("before", "after"):
        m = result[when]["metrics"]
        blocks = {state: int(m.get(f"kvhive_kv_blocks{{state={state}}}", -1)) for state in ("free", "cached", "used")}
        print(f"{when}: blocks {blocks}, sessions live {int(m.get('kvhive_sessions_live', -1))}, "
              f"responses stored {int(m.get('kvhive_responses_stored', -1))}")
    if result["redis_events"]:
        print(f"redis fault: {result['redis_events']}")
    print(f"healthy after: {result['healthy_after']}, server exit code {result['server_exit_code']}")


if __name__ == "__main__":
    sys.exit(main())
