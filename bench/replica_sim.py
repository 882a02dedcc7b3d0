"""Simulated replicas for routing benchmarks: kvhive's HTTP API and real KV events, no model.

``python bench/replica_sim.py --replicas 32 --port 9000 --events-port 19000`` serves N
replicas from one process (one asyncio loop). Replica i answers HTTP on ``port + i`` and publishes
KV events (``KVEventPublisher``, vLLM's wire format) on ``events-port + 2i`` with replay on
``events-port + 2i + 1``. The routes are those a gateway uses: ``/v1/completions`` and
``/v1/chat/completions`` (SSE or not, ``usage.prompt_tokens_details.cached_tokens``), ``/v1/models``
(with ``kvhive_fingerprint``, ``kvhive_block_size``, ``kvhive_hash_seed``), ``/metrics`` (running,
waiting, KV usage, prefix-cache counters) and ``/health``.

The model is a cost model (``SimConfig``):

- Prompts become token ids exactly as the gateway computes them (``PromptTokenizer`` over the real
  kvhive tokenizer, or the ids of a token-id prompt), then kvhive block keys (``hash_blocks``), so a
  block the replica announces is the block the gateway looks up.
- KV: ``capacity_blocks`` blocks, LRU. The longest cached prefix of the prompt's blocks is a hit.
  After its prefill the prompt's full blocks are stored (BlockStored for new ones, BlockRemoved for
  the LRU blocks they evict). Blocks in use are not pinned: capacity should exceed what runs at once.
- Time: at most ``max_running`` requests hold a slot; prefills run one at a time per replica (the
  accelerator is busy), costing ``prefill_overhead_ms + prefill_ms_per_token * uncached tokens``;
  decoding runs in parallel at ``decode_ms_per_token`` per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvhive.core.blocks import ExtraKeys, hash_blocks, root_hash  # noqa: E402
from kvhive.core.kv_events import BlockRemoved, BlockStored, KVEvent  # noqa: E402
from kvhive.kv.event_publisher import KVEventPublisher  # noqa: E402
from kvhive.routing.prompts import Prompt, PromptTokenizer, prompt_from_body  # noqa: E402


@dataclass(frozen=True)
class SimConfig:
    """One simulated replica's capacity and cost model."""

    capacity_blocks: int = 8192
    block_size: int = 16
    prefill_ms_per_token: float = 0.05
    prefill_overhead_ms: float = 5.0
    decode_ms_per_token: float = 10.0
    max_running: int = 16
    fingerprint: str = "simulated-model"
    hash_seed: int = 0
    served_model_name: str = "smollm2-135m"

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1 or self.block_size < 1 or self.max_running < 1:
            raise ValueError("capacity_blocks, block_size and max_running must be >= 1")
        if min(self.prefill_ms_per_token, self.prefill_overhead_ms, self.decode_ms_per_token) < 0:
            raise ValueError("costs must be >= 0")


class SimKVCache:
    """Block keys held by one replica, least recently used first (``capacity`` at most)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are held; those become most recently used."""
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        self._touch(keys[:n])
        return n

    def store(self, keys: Sequence[bytes], token_ids: Sequence[int], start: int) -> list[KVEvent]:
        """Hold ``keys[start:]`` (``token_ids`` are the prompt's tokens); evict LRU blocks beyond
        capacity. Returns the events: BlockRemoved for the evicted, one BlockStored per run of new
        blocks (each run continues the chain from the block before it)."""
        events: list[KVEvent] = []
        size = self.block_size
        run: list[int] = []
        for i in range(start, len(keys) + 1):
            if i < len(keys) and keys[i] not in self._blocks:
                run.append(i)
                continue
            if run:
                first, last = run[0], run[-1] + 1
                events.append(BlockStored([keys[j] for j in run], keys[first - 1] if first else None,
                                          list(token_ids[first * size:last * size]), size))
                run = []
        self._touch(keys)
        evicted: list[bytes] = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            events.insert(0, BlockRemoved(evicted))
        return events

    def _touch(self, keys: Sequence[bytes]) -> None:
        # Tail first, so the head of a chain is the most recent and its end is evicted first.
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)


class SimReplica:
    """One replica: KV cache, slots, a serial prefill lane, counters, and its event publisher."""

    def __init__(self, config: SimConfig, prompts: PromptTokenizer,
                 publisher: KVEventPublisher | None) -> None:
        self.config = config
        self.prompts = prompts
        self.publisher = publisher
        self.cache = SimKVCache(config.capacity_blocks, config.block_size)
        self.root = root_hash(config.hash_seed, config.fingerprint)
        self._slots = asyncio.Semaphore(config.max_running)
        self._prefill = asyncio.Lock()          # FIFO: one prefill at a time
        self.running = 0
        self.waiting = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    async def generate(self, prompt: Prompt, max_tokens: int) -> AsyncIterator[tuple[int, int, int]]:
        """Yield (prompt tokens, cached tokens, tokens so far) once per output token."""
        ids = self.prompts.token_ids(prompt)
        keys = hash_blocks(ids, self.config.block_size, self.root, ExtraKeys(cache_salt=prompt.cache_salt))
        self.waiting += 1
        admitted = False        # waiting counts it until its prefill starts, running after
        try:
            await self._slots.acquire()
            try:
                async with self._prefill:
                    self.waiting, self.running, admitted = self.waiting - 1, self.running + 1, True
                    # Like an engine, leave at least one token to compute.
                    hit = min(self.cache.match(keys), (len(ids) - 1) // self.config.block_size)
                    cached = hit * self.config.block_size
                    cost = (self.config.prefill_overhead_ms
                            + self.config.prefill_ms_per_token * (len(ids) - cached))
                    await asyncio.sleep(cost / 1000)
                    events = self.cache.store(keys, ids, hit)
                    if self.publisher is not None and events:
                        self.publisher.publish(events)
                self.query_tokens += len(ids)
                self.hit_tokens += cached
                for n in range(1, max_tokens + 1):
                    if n > 1:
                        await asyncio.sleep(self.config.decode_ms_per_token / 1000)
                    yield len(ids), cached, n
            finally:
                self._slots.release()
        finally:
            if admitted:
                self.running -= 1
            else:
                self.waiting -= 1

    def metrics_text(self) -> str:
        """Prometheus text of the figures a gateway polls."""
        name = f'{{model_name="{self.config.served_model_name}"}}'
        usage = len(self.cache) / self.config.capacity_blocks
        return (f"kvhive_num_requests_running{name} {self.running}\n"
                f"kvhive_num_requests_waiting{name} {self.waiting}\n"
                f"kvhive_kv_cache_usage_perc{name} {usage}\n"
                f"kvhive_prefix_cache_queries_total{name} {self.query_tokens}\n"
                f"kvhive_prefix_cache_hits_total{name} {self.hit_tokens}\n")


def _error(status: int, message: str, param: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": "invalid_request_error", "param": param, "code": None}})


def create_sim_app(replica: SimReplica) -> Any:
    """The replica's Starlette app (the routes listed in the module docstring)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    config = replica.config

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(replica.metrics_text())

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "owned_by": "kvhive-sim",
            "kvhive_fingerprint": config.fingerprint, "kvhive_block_size": config.block_size,
            "kvhive_hash_seed": config.hash_seed}]})

    async def complete(request: Request) -> Any:
        chat = request.url.path.endswith("/chat/completions")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        prompt = prompt_from_body(body) if isinstance(body, dict) else None
        if prompt is None:
            return _error(400, "no prompt or messages", "messages" if chat else "prompt")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        max_tokens = 16 if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer", "max_tokens")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

        def usage(prompt_tokens: int, cached: int, n: int) -> dict[str, Any]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                    "total_tokens": prompt_tokens + n, "prompt_tokens_details": {"cached_tokens": cached}}

        outputs = replica.generate(prompt, max_tokens)
        if not body.get("stream"):
            last = (0, 0, 0)
            async for out in outputs:
                last = out
            return JSONResponse({"id": rid, "object": kind, "created": int(time.time()),
                                 "model": config.served_model_name,
                                 "choices": [choice(" tok" * last[2], "length", False)],
                                 "usage": usage(*last)})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse() -> AsyncIterator[bytes]:
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            last = (0, 0, 0)
            async for last in outputs:
                finish = "length" if last[2] == max_tokens else None
                chunk = {"id": rid, "object": chunk_kind, "created": int(time.time()),
                         "model": config.served_model_name, "choices": [choice(" tok", finish, True)]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if include_usage:
                chunk = {"id": rid, "object": chunk_kind, "created": int(time.time()),
                         "model": config.served_model_name, "choices": [], "usage": usage(*last)}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
    ])


async def serve_replicas(num_replicas: int, host: str, port: int, events_port: int | None,
                         config: SimConfig, prompts: PromptTokenizer) -> None:
    """Serve ``num_replicas`` replicas on consecutive ports until cancelled."""
    import uvicorn

    servers, publishers = [], []
    for i in range(num_replicas):
        publisher = None
        if events_port is not None:
            publisher = KVEventPublisher(f"tcp://*:{events_port + 2 * i}",
                                         f"tcp://*:{events_port + 2 * i + 1}")
            publishers.append(publisher)
        app = create_sim_app(SimReplica(config, prompts, publisher))
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port + i, log_level="warning",
                                               access_log=False, lifespan="off"))
        server.install_signal_handlers = lambda: None   # type: ignore[method-assign]
        servers.append(server)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        for publisher in publishers:
            publisher.close()


def replica_specs(num_replicas: int, port: int, events_port: int | None,
                  host: str = "127.0.0.1") -> list[str]:
    """The ``--replica`` values of the gateway for these replicas."""
    specs = []
    for i in range(num_replicas):
        spec = f"http://{host}:{port + i}"
        if events_port is not None:
            spec += (f",events=tcp://{host}:{events_port + 2 * i},"
                     f"replay=tcp://{host}:{events_port + 2 * i + 1}")
        specs.append(spec)
    return specs


def main(argv: list[str] | None = None) -> int:
    """``python bench/replica_sim.py``: serve simulated replicas until interrupted."""
    p = argparse.ArgumentParser(prog="replica_sim.py", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000, help="HTTP port of replica 0 (replica i: port + i)")
    p.add_argument("--events-port", type=int, default=19000,
                   help="KV-event PUB port of replica 0 (replica i: +2i, its replay: +2i+1); 0: no events")
    p.add_argument("--model", default=None, help="tokenizer source (default: the embedded GGUF)")
    p.add_argument("--capacity-blocks", type=int, default=SimConfig.capacity_blocks)
    p.add_argument("--block-size", type=int, default=SimConfig.block_size)
    p.add_argument("--prefill-ms-per-token", type=float, default=SimConfig.prefill_ms_per_token)
    p.add_argument("--prefill-overhead-ms", type=float, default=SimConfig.prefill_overhead_ms)
    p.add_argument("--decode-ms-per-token", type=float, default=SimConfig.decode_ms_per_token)
    p.add_argument("--max-running", type=int, default=SimConfig.max_running)
    p.add_argument("--fingerprint", default=SimConfig.fingerprint)
    p.add_argument("--hash-seed", type=int, default=0)
    args = p.parse_args(argv)
    config = SimConfig(args.capacity_blocks, args.block_size, args.prefill_ms_per_token,
                       args.prefill_overhead_ms, args.decode_ms_per_token, args.max_running,
                       args.fingerprint, args.hash_seed)
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer

    prompts = PromptTokenizer(Tokenizer.from_model_path(args.model or default_model_path()), workers=1)
    events_port = args.events_port or None
    print("\n".join(replica_specs(args.replicas, args.port, events_port, args.host)), flush=True)
    try:
        asyncio.run(serve_replicas(args.replicas, args.host, args.port, events_port, config, prompts))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
