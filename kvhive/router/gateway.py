"""The routing decision and the forwarding of one request (the app's routes call these)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvhive.router.indexer import KVCacheIndexer, KVScores
from kvhive.router.metrics import GatewayMetrics
from kvhive.router.proxy import open_upstream, openai_error, relay
from kvhive.router.replicas import Replica, ReplicaSet
from kvhive.router.scorer import RoutingWeights, pick_replica
from kvhive.router.sessions import RESPONSE_ID_HEADER, SESSION_HEADER, SessionAffinity, SharedAffinity
from kvhive.router.tokenize import Prompt
from kvhive.router.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamUnanswered,
)

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvhive-replica"
REASON_HEADER = "x-kvhive-route-reason"


class Gateway:
    """Picks a replica for each request (session, then KV score and load) and forwards to it."""

    def __init__(self, replicas: ReplicaSet, indexer: KVCacheIndexer, sessions: SessionAffinity | SharedAffinity,
                 weights: RoutingWeights, metrics: GatewayMetrics, client: httpx.AsyncClient,
                 policy: str = "kv", seed: int = 0, upstream: UpstreamClient | None = None,
                 serve_role: str | None = None) -> None:
        """``serve_role``: answers come from replicas of this role only (``decode`` with --pd)."""
        self.replicas = replicas
        self.serve_role = serve_role
        self.policy = policy
        self._random = random.Random(seed)
        self.indexer = indexer
        self.sessions = sessions
        self.weights = weights
        self.metrics = metrics
        self.client = client            # fan-out GETs
        # Forwarded requests (the hot path) go through the lean client, not httpx.
        self.upstream = upstream if upstream is not None else UpstreamClient()
        self._turn = 0          # rotates the order in which equal scores are broken

    async def choose(self, prompt: Prompt | None, session_id: str | None,
                     owner: str, role: str | None = None) -> tuple[list[Replica], str]:
        """Healthy replicas in order of preference, and why the first is first.

        The replica holding ``owner``'s session ``session_id`` comes first while it is healthy (an
        id only another owner used counts as unknown); otherwise replicas are ranked by
        ``pick_replica`` (KV score of the prompt, then load) under the "kv" policy, by load alone
        under "least_load", in turn under "round_robin", and at random under "random". Only
        replicas of ``role`` (default: ``serve_role``; None: any) are candidates.
        """
        role = role or self.serve_role
        healthy = [r for r in self.replicas.healthy() if role is None or r.spec.role == role]
        if not healthy:
            return [], "none"
        holder = await self.sessions.aget(owner, session_id) if session_id else None
        self._turn += 1
        if self.policy in ("round_robin", "random"):
            names = [r.name for r in healthy]
            if self.policy == "random":
                self._random.shuffle(names)
            else:
                start = self._turn % len(names)
                names = names[start:] + names[:start]
            if holder in names:
                return self._ordered([holder, *[n for n in names if n != holder]]), "session"
            return self._ordered(names), self.policy
        kv = KVScores()
        if self.policy == "kv" and prompt is not None and not any(r.name == holder for r in healthy):
            try:
                kv = await self.indexer.score(prompt)
                self.metrics.tokenize_seconds.observe(kv.tokenize_s)
            except Exception as exc:  # noqa: BLE001 - a body the replica will reject: route by load
                logger.debug("no KV score for this request: %s", exc)
        loads = {r.name: r.routing_load() for r in healthy}
        pick = pick_replica([r.name for r in healthy], kv.scores, kv.num_blocks, loads, self.weights,
                            self._turn)
        ranking, reason = pick.ranking, "kv" if pick.kv_blocks > 0 else "load"
        if holder in ranking:
            ranking, reason = [holder, *[n for n in ranking if n != holder]], "session"
        if reason == "kv":
            self.metrics.routed_cached_blocks.labels(pick.replica).inc(pick.kv_blocks)
        return self._ordered(ranking), reason

    def _ordered(self, names: Sequence[str]) -> list[Replica]:
        return [r for r in (self.replicas.get(n) for n in names) if r is not None]

    async def forward(self, request: Request, body: bytes, candidates: Sequence[Replica], reason: str,
                      owner: str, path: str | None = None, find_session: str | None = None,
                      session_id: str | None = None) -> Response:
        """Send the request to the first candidate and relay its answer.

        A request that no byte of an answer came back for (connection refused, connect timeout,
        closed or reset before the status line) goes to the next candidate, once per request,
        counted in kvhive_gateway_retries_total{reason}; a refused connection also marks that
        replica down. Any other upstream failure is a 502. With ``find_session``, a 404 also moves
        on to the next candidate: the first replica that knows the session answers. A replica that
        answers a request naming ``session_id`` (a session, or the response a request continues)
        is remembered as the holder of ``owner``'s id, and as the holder of a response it names in
        ``x-kvhive-response-id``."""
        last_404: Response | None = None
        unanswered: UpstreamUnanswered | None = None
        # Each pass either returns or moves on after a 404 (find_session) or a first unanswered try.
        for attempt, replica in enumerate(candidates):
            replica.inflight += 1
            try:
                upstream = await open_upstream(self.upstream, replica.name, request, body, path)
            except UpstreamUnanswered as exc:
                await self._unanswered(replica, exc)
                if unanswered is not None:
                    return self._unreachable(exc)       # retried once already
                unanswered = exc
                if attempt + 1 < len(candidates):
                    self.metrics.retries.labels(exc.reason).inc()
                    logger.info("retrying on another replica: %s did not answer (%s)", replica.name, exc)
                continue
            except UpstreamError as exc:
                return self._failed(replica, exc)
            label = reason if attempt == 0 else "retry"
            self.metrics.decisions.labels(replica.name, label).inc()
            self.metrics.responses.labels(replica.name, str(upstream.status_code)).inc()
            headers = {REPLICA_HEADER: replica.name, REASON_HEADER: label}
            if find_session is not None and upstream.status_code == 404 and attempt + 1 < len(candidates):
                last_404 = await relay(upstream, headers, lambda r=replica: self._done(r))
                continue
            await self._remember_holder(upstream, replica, owner, find_session or session_id)
            return await relay(upstream, headers, lambda r=replica: self._done(r), replica.name,
                               lambda r=replica: self.metrics.stream_errors.labels(r.name).inc())
        if last_404 is not None:
            return last_404
        return self._unreachable(unanswered)

    async def _unanswered(self, replica: Replica, failure: UpstreamUnanswered) -> None:
        """Count a request ``replica`` sent no byte of an answer to (no longer in flight there); a
        refused connection marks it down."""
        replica.inflight -= 1
        self.metrics.upstream_errors.labels(replica.name).inc()
        if isinstance(failure, UpstreamConnectError):
            await self.replicas.mark_down(replica, f"connection failed: {failure}")

    def _failed(self, replica: Replica, failure: UpstreamError) -> Response:
        """Count a request ``replica`` failed in any other way (no longer in flight there); its 502."""
        replica.inflight -= 1
        self.metrics.upstream_errors.labels(replica.name).inc()
        return openai_error(502, f"replica {replica.name} failed: {type(failure).__name__}: {failure}",
                            code="bad_gateway", headers={REPLICA_HEADER: replica.name})

    async def _remember_holder(self, upstream: UpstreamResponse, replica: Replica, owner: str,
                         named: str | None) -> None:
        """After a successful answer, remember ``replica`` as the holder of ``owner``'s session (the
        one it echoes in x-session-id, else ``named``) and of the response it names in
        x-kvhive-response-id. A replica that answers a request naming a session holds it (it
        creates unknown ones implicitly), whether or not it echoes the header."""
        if upstream.status_code >= 400:
            return
        echoed = upstream.header(SESSION_HEADER.encode())
        stored = upstream.header(RESPONSE_ID_HEADER.encode())
        held = (echoed.decode("latin-1") if echoed else None) or named
        for key in (held, stored.decode("latin-1") if stored else None):
            if key:
                await self.sessions.aremember(owner, key, replica.name)

    @staticmethod
    def _unreachable(failure: UpstreamUnanswered | None) -> Response:
        """503 when no candidate could be connected to; 502 when one dropped the request."""
        if failure is None or isinstance(failure, UpstreamConnectError):
            return openai_error(503, "No replica could be reached", code="no_replica")
        return openai_error(502, f"no replica answered: {failure}", code="bad_gateway")

    async def fan_out(self, request: Request, path: str, method: str = "GET",
                      timeout_s: float = 10.0) -> list[tuple[Replica, int, Any]]:
        """``method`` ``path`` (no body, the request's query) on every healthy replica: (replica,
        status, parsed JSON or None) for each answer."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "accept")}

        async def get(replica: Replica) -> tuple[Replica, int, Any] | None:
            try:
                response = await self.client.request(method, replica.name + path, headers=headers,
                                                      params=request.url.query or None, timeout=timeout_s)
            except httpx.HTTPError:
                return None
            try:
                return replica, response.status_code, response.json()
            except ValueError:
                return replica, response.status_code, None

        answers = await asyncio.gather(*(get(r) for r in self.replicas.healthy()))
        return [a for a in answers if a is not None]

    @staticmethod
    def _done(replica: Replica) -> None:
        replica.inflight -= 1
        replica.finished += 1
