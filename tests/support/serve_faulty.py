"""The test server process: ``python -m support.serve_faulty --model tiny|default --port N [--api-key K]
[--max-model-len N] [--faulty] [--served-model-name NAME] [--http-* limits] [CORS flags]
[--enable-tokenizer-info-endpoint] [--admin-key K] [--no-dashboard]`` (``support.servers.start_server`` runs it).

``tiny`` is a random-weight Llama (``support/tiny.py``) behind the real tokenizer of the default GGUF;
``default`` is the real default model. ``--faulty`` makes prompts that start with
``FAULT_TOKEN_IDS`` fail inside the engine, and prompts whose text contains ``FAULT_MARKER`` (which
a chat-templated prompt can carry) fail after ``FAULT_AFTER_OUTPUTS`` outputs, so tests can see how
engine errors reach clients, also in the middle of a stream. Inside the engine itself: sampling a
row of a prompt holding ``ROW_FAULT_MARKER`` raises (in a batch too), the forward of every step
computing a prompt holding ``STEP_FAULT_MARKER`` raises, and a prompt holding ``LOOP_FAULT_MARKER``
kills the engine loop (the server then exits with status 1).

``--fault-mode`` makes the whole replica sick while its ``/health`` stays 200 (as a replica behind
a broken proxy, or with a wedged engine, is): every POST is answered with ``garbage`` (a 200 whose
body is not the JSON it announces), ``500`` (OpenAI's server error), or ``hang`` (read, never
answered); ``none`` serves normally. ``PUT /fault-mode`` with one of these as its body switches
mode while the server runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from support.servers import (
    FAULT_AFTER_OUTPUTS,
    FAULT_MARKER,
    FAULT_TOKEN_IDS,
    LOOP_FAULT_MARKER,
    ROW_FAULT_MARKER,
    SERVED_MODEL_NAME,
    SLOW_MARKER,
    STEP_FAULT_MARKER,
    TEST_DEVICE,
)


def build_test_replica(args: argparse.Namespace):  # -> Replica (kvhive imports stay inside)
    """The replica ``args`` (this script's flags) describe, built as ``kvhive serve`` builds its own
    (``build_replica``); its engine loop not started yet."""
    from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig, SessionConfig, StoreConfig
    from kvhive.core.cors import cors_from_args
    from kvhive.core.model_files import default_model_path
    from kvhive.engine.async_engine import AsyncEngine
    from kvhive.launch.replica import build_replica
    from kvhive.server.app import AppOptions

    scheduler = SchedulerConfig(max_model_len=args.max_model_len or 8192, scheduling_policy=args.scheduling_policy)
    store = StoreConfig(cpu_offload_gb=args.cpu_offload_gb, disk_cache_dir=args.disk_cache_dir,
                        redis_url=args.redis_url)
    sessions = SessionConfig(default_ttl_s=args.default_session_ttl, max_ttl_s=args.max_session_ttl,
                             max_sessions_per_key=args.max_sessions_per_key, max_pinned_gb=args.max_pinned_gb,
                             share_prefix_cache=args.share_prefix_cache,
                             enable_conversation_caching=args.enable_conversation_caching,
                             max_active_conversations=args.max_active_conversations)
    api_keys = tuple(args.api_key) + ((args.admin_key,) if args.admin_key else ())
    options = AppOptions(api_keys=api_keys, max_request_bytes=args.max_request_bytes,
                         cors=cors_from_args(args), tokenizer_info=args.enable_tokenizer_info_endpoint,
                         dashboard=args.dashboard, admin_key=args.admin_key)
    engine_class = faulty_engine_class(AsyncEngine) if args.faulty else AsyncEngine
    prefix = not args.no_prefix_caching
    if args.model == "default":
        config = EngineConfig(model_path=default_model_path(), served_model_name=args.served_model_name,
                              device=TEST_DEVICE,
                              cache=CacheConfig(kv_cache_gb=args.kv_cache_gb, num_blocks=args.num_blocks,
                                                enable_prefix_caching=prefix),
                              scheduler=scheduler, store=store, sessions=sessions)
        return build_replica(config, options, engine_class=engine_class)
    from support import tiny

    from kvhive.core.tokenizer import Tokenizer
    from kvhive.model.loader import LoadedModel

    tokenizer = Tokenizer.from_model_path(default_model_path())
    model_config = tiny.tiny_config(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_ids=tokenizer.eos_token_ids)
    loaded = LoadedModel(model_config, tiny.tiny_model(model_config, device=TEST_DEVICE), "tiny-server-test")
    config = EngineConfig(model_path=default_model_path(), served_model_name=args.served_model_name,
                          device=TEST_DEVICE,
                          cache=CacheConfig(num_blocks=args.num_blocks or 256, enable_prefix_caching=prefix),
                          scheduler=scheduler, store=store, sessions=sessions)
    return build_replica(config, options, model=loaded, tokenizer=tokenizer, engine_class=engine_class)


def faulty_engine_class(async_engine_class: type) -> type:
    """The ``--faulty`` AsyncEngine class: see this module's docstring for the markers."""
    faulty_rows: set[str] = set()           # engine request ids whose sampling raises
    faulty_steps: set[str] = set()          # engine request ids whose steps' forward raises

    def make_runner_faulty(runner) -> None:
        sample_rows, execute = runner.sample_rows, runner.execute

        def faulty_sample_rows(logits, seqs):
            if any(s.request_id in faulty_rows for s in seqs):
                raise RuntimeError("injected row failure")
            return sample_rows(logits, seqs)

        def faulty_execute(plan):
            if any(s.request_id in faulty_steps for s in plan.seqs):
                raise RuntimeError("injected step failure")
            return execute(plan)

        runner.sample_rows, runner.execute = faulty_sample_rows, faulty_execute

    class FaultyAsyncEngine(async_engine_class):
        """Fails requests whose prompt starts with FAULT_TOKEN_IDS at once, and those whose text
        holds FAULT_MARKER after FAULT_AFTER_OUTPUTS outputs (or at their last), as a broken engine
        would; fails rows, steps and the loop itself for the other markers."""

        kill_loop = False

        def __init__(self, engine) -> None:
            make_runner_faulty(engine.runner)
            super().__init__(engine)

        def _apply_commands(self):
            if self.kill_loop:
                raise RuntimeError("injected engine loop failure")
            super()._apply_commands()

        async def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None, **session):
            if list(prompt_token_ids[:len(FAULT_TOKEN_IDS)]) == FAULT_TOKEN_IDS:
                raise RuntimeError("injected engine failure")
            text = self.engine.tokenizer.decode(prompt_token_ids)
            fails_mid_way = FAULT_MARKER in text
            slow = SLOW_MARKER in text
            if ROW_FAULT_MARKER in text:
                faulty_rows.add(request_id)
            if STEP_FAULT_MARKER in text:
                faulty_steps.add(request_id)
            if LOOP_FAULT_MARKER in text:
                self.kill_loop = True
            outputs = super().generate(request_id, prompt_token_ids, sampling, cache_salt, **session)
            async with contextlib.aclosing(outputs):
                num_sent = 0
                async for out in outputs:
                    if fails_mid_way and (num_sent == FAULT_AFTER_OUTPUTS or out.finished):
                        raise RuntimeError("injected engine failure mid-way")
                    num_sent += 1
                    if slow:
                        await asyncio.sleep(0.02)
                    yield out

    return FaultyAsyncEngine


FAULT_MODES = ("none", "garbage", "500", "hang")


class FaultModes:
    """ASGI middleware: POSTs answered as the current mode says (``FAULT_MODES``); ``PUT
    /fault-mode`` sets the mode. Everything else goes to the app."""

    def __init__(self, app, mode: str) -> None:
        self.app = app
        self.mode = mode

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/fault-mode" and scope["method"] == "PUT":
            mode = (await _body(receive)).decode().strip()
            ok = mode in FAULT_MODES
            if ok:
                self.mode = mode
            await _answer(send, 200 if ok else 400, b"application/json", b'{"mode": "%s"}' % self.mode.encode())
        elif scope["method"] != "POST" or self.mode == "none":
            await self.app(scope, receive, send)
        elif self.mode == "garbage":
            await _answer(send, 200, b"application/json", b"\x00\x01 <html>not json")
        elif self.mode == "500":
            await _answer(send, 500, b"application/json", b'{"error": {"message": "injected replica failure", '
                          b'"type": "server_error", "param": null, "code": "internal_server_error"}}')
        else:
            await asyncio.Event().wait()            # hang: the request is read, never answered


async def _body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def _answer(send, status: int, content_type: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def arg_parser() -> argparse.ArgumentParser:
    """This script's flags (tests that build its engine in process parse theirs with it)."""
    from kvhive.config import PINNED_AUTO
    from kvhive.serve_args import pinned_gib

    parser = argparse.ArgumentParser(description="kvhive test server")
    parser.add_argument("--model", choices=["tiny", "default"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", action="append", default=[])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--faulty", action="store_true")
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)     # the default model's pool
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--cpu-offload-gb", type=float, default=0.0)
    parser.add_argument("--disk-cache-dir", default=None)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--default-session-ttl", type=int, default=600)
    parser.add_argument("--max-session-ttl", type=int, default=86400)
    parser.add_argument("--max-sessions-per-key", type=int, default=None)
    parser.add_argument("--max-pinned-gb", type=pinned_gib, default=PINNED_AUTO)
    parser.add_argument("--share-prefix-cache", action="store_true")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    parser.add_argument("--enable-conversation-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-active-conversations", type=int, default=None)
    parser.add_argument("--served-model-name", default=SERVED_MODEL_NAME)
    parser.add_argument("--fault-mode", choices=FAULT_MODES, default=None)
    parser.add_argument("--max-request-bytes", type=int, default=None)
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true")
    parser.add_argument("--admin-key", default=None)            # also an API key, as kvhive serve's
    parser.add_argument("--no-dashboard", dest="dashboard", action="store_false")
    from kvhive.core.cors import add_cors_args
    from kvhive.core.http_limits import add_http_limit_args

    add_http_limit_args(parser)              # kvhive serve's --http-* flags
    add_cors_args(parser)                    # and its CORS flags
    return parser


def main() -> None:
    """Parse the flags, build the engine and serve it until SIGTERM."""
    args = arg_parser().parse_args()
    import torch

    from kvhive.core.http_limits import http_limits_from_args

    torch.set_num_threads(2)
    from kvhive.server.app import run_server

    replica = build_test_replica(args)
    if args.fault_mode is not None:
        replica.app.add_middleware(FaultModes, mode=args.fault_mode)
    served = run_server(replica.app, replica.engine, host="127.0.0.1", port=args.port, log_level="warning",
                        http_limits=http_limits_from_args(args))
    sys.exit(0 if served else 1)           # as ``kvhive serve``: 1 when the engine loop died


if __name__ == "__main__":
    main()
