"""Disaggregated routing (``kvhive gateway --prefill URL --decode URL,kv=HOST:PORT``).

A completion or chat request without a session is sent twice: first to the best-scoring prefill
replica with ``max_tokens`` 1 and ``kv_transfer_params`` naming the chosen decode replica's
transfer endpoint (the prefill pushes the prompt's KV there layer by layer), then, with the
params the prefill answered (plus ``prefill_cached_tokens``, the prompt tokens the prefill
reused), to that decode replica, whose answer (streamed or not) is relayed; its
``cached_tokens`` count what either side reused.
Requests in a session, with ``n`` > 1 or with their own ``kv_transfer_params`` go to the decode
replicas only (a session's holder first). When no prefill replica answers, the decode replica
computes the whole request; a prefill's 4xx (bad input) is the answer.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvhive.gateway.gateway import Gateway
from kvhive.gateway.proxy import failure_status
from kvhive.routing.dialects import openai_error
from kvhive.routing.prompts import Prompt

logger = logging.getLogger(__name__)

PD_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
_PREFILL_DROPS = ("stream", "stream_options", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
                  "prompt_logprobs")


def wants_prefill(path: str, data: dict[str, Any] | None, session_id: str | None) -> bool:
    """True for a request the prefill replicas compute: a completion or chat without a session."""
    return (path in PD_PATHS and data is not None and session_id is None
            and data.get("n", 1) == 1 and "kv_transfer_params" not in data
            and "conversation_id" not in data)


def prefill_body(data: dict[str, Any], transfer_id: str, endpoint: str) -> bytes:
    """The prefill request: the prompt, one greedy-or-not token, and where to push the KV."""
    body = {k: v for k, v in data.items() if k not in _PREFILL_DROPS}
    body["max_tokens"] = 1
    body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id,
                                  "decode_endpoint": endpoint}
    return json.dumps(body).encode()


async def route_disaggregated(gateway: Gateway, request: Request, data: dict[str, Any],
                              prompt: Prompt | None, owner: str, timeout_s: float) -> Response:
    """Prefill on the best prefill replica, then decode (and answer) on the best decode replica."""
    decode, reason = await gateway.choose(prompt, None, owner)
    if not decode:
        return openai_error(503, "No healthy decode replica", code="no_replica")
    prefill, _ = await gateway.choose(prompt, None, owner, role="prefill")
    body = data
    if prefill:
        replica, transfer_id = prefill[0], f"pd-{uuid.uuid4().hex}"
        replica.inflight += 1
        failure: str | None = None
        try:
            answer = await gateway.client.post(
                replica.name + request.url.path, content=prefill_body(data, transfer_id, decode[0].spec.kv),
                headers=_forwarded_headers(request), timeout=timeout_s or None)
            failure = "5xx" if failure_status(answer.status_code) else None
        except httpx.HTTPError as exc:
            logger.warning("prefill on %s failed (%s); the decode replica computes the prompt", replica.name, exc)
            answer, failure = None, _failure_kind(exc)
        finally:
            replica.inflight -= 1
            replica.finished += 1
        gateway.record(replica, failure)
        if answer is not None:
            gateway.metrics.decisions.labels(replica.name, "prefill").inc()
            gateway.metrics.responses.labels(replica.name, str(answer.status_code)).inc()
            if 400 <= answer.status_code < 500:
                return JSONResponse(_json_or_error(answer), status_code=answer.status_code)
            params = _decode_params(_json_or_error(answer)) if answer.status_code == 200 else None
            if params is not None:
                body = {**data, "kv_transfer_params": params}
    return await gateway.forward(request, json.dumps(body).encode(), decode[:1], reason, owner)


def _decode_params(answer: dict[str, Any]) -> dict[str, Any] | None:
    """The decode request's params from a prefill's answer, with the prompt tokens the prefill
    reused (``prefill_cached_tokens``), so the decode side reports what either side reused."""
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and cached > 0:
        params = {**params, "prefill_cached_tokens": cached}
    return params


def _failure_kind(exc: httpx.HTTPError) -> str:
    """The outlier-detection kind of a prefill request's failure."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.DecodingError):
        return "malformed"
    return "reset"


def _forwarded_headers(request: Request) -> dict[str, str]:
    """The headers a prefill request carries on: the caller's key and content type."""
    headers = {"content-type": "application/json"}
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return headers


def _json_or_error(answer: httpx.Response) -> dict[str, Any]:
    try:
        data = answer.json()
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {"error": {"message": "the prefill replica's answer is not JSON",
                                                          "type": "server_error", "param": None, "code": None}}
