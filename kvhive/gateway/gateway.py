"""The routing decision and the forwarding of one request (the app's routes call these)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvhive.gateway.metrics import GatewayMetrics
from kvhive.gateway.outlier import OutlierPolicy
from kvhive.gateway.proxy import (
    RelayResponse,
    answer_problem,
    failed_answer,
    failure_status,
    open_upstream,
    whole_answer,
)
from kvhive.gateway.replicas import Replica, ReplicaSet
from kvhive.gateway.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamMalformed,
    UpstreamResponse,
    UpstreamUnanswered,
)
from kvhive.routing.affinity import RESPONSE_ID_HEADER, SESSION_HEADER, SessionAffinity, SharedAffinity
from kvhive.routing.dialects import gateway_error
from kvhive.routing.indexer import KVCacheIndexer, KVScores
from kvhive.routing.prompts import Prompt
from kvhive.routing.scorer import RoutingWeights, pick_replica

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvhive-replica"
REASON_HEADER = "x-kvhive-route-reason"
# Failures sent once more to another replica: nothing reached the client yet, and the replica either
# never saw the request or answered it with an error or garbage (a timed-out request may still be
# running there; a cut answer was being generated).
_RETRIED = frozenset(("connect", "connect_timeout", "reset", "malformed"))


class SentRequest(NamedTuple):
    """A request sent to a replica: its answer, and the answer's body when read whole (None: streamed)."""

    upstream: UpstreamResponse
    whole: bytes | None


class Gateway:
    """Picks a replica for each request (session, then KV score and load) and forwards to it."""

    def __init__(self, replicas: ReplicaSet, indexer: KVCacheIndexer, sessions: SessionAffinity | SharedAffinity,
                 weights: RoutingWeights, metrics: GatewayMetrics, client: httpx.AsyncClient,
                 policy: str = "kv", seed: int = 0, upstream: UpstreamClient | None = None,
                 serve_role: str | None = None, outliers: OutlierPolicy | None = None,
                 cache_keys: SessionAffinity | SharedAffinity | None = None) -> None:
        """``serve_role``: answers come from replicas of this role only (``decode`` with --pd);
        ``outliers``: when replicas whose requests fail are ejected; ``cache_keys``: the replica
        that last answered each (owner, prompt_cache_key)."""
        self.replicas = replicas
        self.cache_keys = cache_keys if cache_keys is not None else SessionAffinity()
        self.outliers = outliers if outliers is not None else OutlierPolicy()
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
                     owner: str, role: str | None = None, cache_key: str | None = None) -> tuple[list[Replica], str]:
        """Healthy replicas in order of preference, and why the first is first.

        The replica holding ``owner``'s session ``session_id`` comes first while it is healthy (an
        id only another owner used counts as unknown); otherwise replicas are ranked by
        ``pick_replica`` (KV score of the prompt, the replica that last answered ``owner``'s
        ``cache_key``, then load) under the "kv" policy, by load alone under "least_load", in turn
        under "round_robin", and at random under "random". Only replicas of ``role`` (default:
        ``serve_role``; None: any) that are not ejected (``routable``) are candidates.
        """
        role = role or self.serve_role
        healthy = self.routable([r for r in self.replicas.healthy() if role is None or r.spec.role == role])
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
        kv, key_holder = KVScores(), None
        held = any(r.name == holder for r in healthy)
        if self.policy == "kv" and prompt is not None and not held:
            try:
                kv = await self.indexer.score(prompt)
                self.metrics.tokenize_seconds.observe(kv.tokenize_s)
            except Exception as exc:  # noqa: BLE001 - a body the replica will reject: route by load
                logger.debug("no KV score for this request: %s", exc)
        if self.policy == "kv" and cache_key and not held:
            key_holder = await self.cache_keys.aget(owner, cache_key)
        loads = {r.name: r.routing_load() for r in healthy}
        pick = pick_replica([r.name for r in healthy], kv.scores, kv.num_blocks, loads, self.weights,
                            self._turn, key_holder)
        ranking, reason = pick.ranking, pick.reason
        if holder in ranking:
            ranking, reason = [holder, *[n for n in ranking if n != holder]], "session"
        if reason == "kv":
            self.metrics.routed_cached_blocks.labels(pick.replica).inc(pick.kv_blocks)
        return self._ordered(ranking), reason

    def routable(self, replicas: list[Replica]) -> list[Replica]:
        """``replicas`` less the ejected ones; all of them when every one is ejected (routing to
        a sick replica beats refusing every request), counted in kvhive_gateway_outlier_panic_total."""
        now = time.monotonic()
        kept = [r for r in replicas if not r.outlier.ejected(now)]
        if replicas and not kept:
            self.metrics.outlier_panic.inc()
            return replicas
        return kept

    def _ordered(self, names: Sequence[str]) -> list[Replica]:
        return [r for r in (self.replicas.get(n) for n in names) if r is not None]

    async def forward(self, request: Request, body: bytes, candidates: Sequence[Replica], reason: str,
                      owner: str, path: str | None = None, find_session: str | None = None,
                      session_id: str | None = None, cache_key: str | None = None) -> Response:
        """Send the request to the first candidate and relay its answer.

        An answer of known length (and any error answer) is read whole before the client gets a
        byte of it; a streamed one is relayed as it comes (``RelayResponse``). A request that failed
        before any byte reached the client goes to the next candidate, once per request, counted in
        kvhive_gateway_retries_total{reason}, when no byte of an answer came back (connection
        refused, connect timeout, closed or reset before the status line), the replica answered
        5xx, or its answer was not HTTP or not the JSON expected. A request that timed out
        (--request-timeout: the replica may still be working on it) or whose answer was cut
        part-way is not sent again: 504 or 502. A refused connection also marks that replica down.
        Every request's outcome feeds outlier ejection (``record``). With ``find_session``, a 404
        also moves on to the next candidate: the first replica that knows the session answers. A
        successful answer is relayed by ``_answered``."""
        last_404: Response | None = None
        retried = False
        target = path or request.scope["path"]
        # Each pass either returns or moves on after a 404 (find_session) or a first retried failure.
        for attempt, replica in enumerate(candidates):
            more = attempt + 1 < len(candidates)
            label = reason if attempt == 0 else "retry"
            headers = {REPLICA_HEADER: replica.name, REASON_HEADER: label}
            try:
                upstream, whole = await self._send(replica, label, request, body, path, target)
            except UpstreamError as exc:
                await self._failed(replica, exc)
                if not retried and more and exc.kind in _RETRIED:
                    retried = self._retrying(exc.kind, "%s failed (%s)", replica.name, exc)
                    continue
                return last_404 if last_404 is not None else self._failure_answer(replica, exc, target)
            if failure_status(upstream.status_code):
                self._done(replica, "5xx")
                if not retried and more:
                    retried = self._retrying("5xx", "%s answered %d", replica.name, upstream.status_code)
                    continue
                return whole_answer(upstream, whole or b"", headers, target)
            if find_session is not None and upstream.status_code == 404 and more:
                self._done(replica, None)
                last_404 = whole_answer(upstream, whole or b"", headers, target)
                continue
            named = find_session or session_id
            return await self._answered(upstream, whole, replica, headers, target, owner, named, cache_key)
        if last_404 is not None:
            return last_404
        return gateway_error(target, 503, "No replica could be reached", code="no_replica")

    async def _send(self, replica: Replica, label: str, request: Request, body: bytes, path: str | None,
                    target: str) -> SentRequest:
        """Send the request to ``replica`` (now in flight there) and read its answer's body when it
        is not streamed (``_read_whole``)."""
        replica.inflight += 1
        replica.routed(time.monotonic())
        upstream = await open_upstream(self.upstream, replica.name, request, body, path)
        self.metrics.decisions.labels(replica.name, label).inc()
        self.metrics.responses.labels(replica.name, str(upstream.status_code)).inc()
        return SentRequest(upstream, await self._read_whole(upstream, target))

    def _retrying(self, kind: str, why: str, *args: object) -> bool:
        """Count and log a retry on another replica after a failure of ``kind``; True (retried)."""
        self.metrics.retries.labels(kind).inc()
        logger.info("retrying on another replica: " + why, *args)
        return True

    async def _answered(self, upstream: UpstreamResponse, whole: bytes | None, replica: Replica,
                        headers: dict[str, str], target: str, owner: str, named: str | None,
                        cache_key: str | None) -> Response:
        """Relay a successful (non-5xx) answer of ``replica``: read whole (``whole``) or streamed.

        A replica that answers a request naming ``named`` (a session, or the response a request
        continues) is remembered as the holder of ``owner``'s id, and as the holder of a response it
        names in ``x-kvhive-response-id``; one that answers a request with ``cache_key`` (its
        prompt_cache_key), as the replica of ``owner``'s key."""
        await self._remember_holder(upstream, replica, owner, named)
        if cache_key and upstream.status_code < 400:
            await self.cache_keys.aremember(owner, cache_key, replica.name)
        if whole is not None:
            self._done(replica, None)
            return whole_answer(upstream, whole, headers, target)
        return RelayResponse(upstream, headers, lambda failure, r=replica: self._done(r, failure),
                             replica.name)

    @staticmethod
    async def _read_whole(upstream: UpstreamResponse, path: str) -> bytes | None:
        """The body of an error answer or of one of known length, read now (None: a streamed
        answer, left to stream); UpstreamMalformed for a 2xx answer that is not what ``path``
        expects. The answer is closed once read."""
        if upstream.streamed and upstream.status_code < 400:
            problem = answer_problem(path, upstream, None)
            if problem is not None:
                upstream.close()
                raise UpstreamMalformed(problem)
            return None
        try:
            body = await upstream.read()
        except UpstreamError:
            if upstream.status_code < 400:
                raise
            body = b""                  # an error answer cut short: its status still says it
        finally:
            upstream.close()
        problem = answer_problem(path, upstream, body)
        if problem is not None:
            raise UpstreamMalformed(problem)
        return body

    async def _failed(self, replica: Replica, failure: UpstreamError) -> None:
        """Count a request that failed on ``replica`` (no longer in flight there); a refused
        connection marks it down."""
        self.metrics.upstream_errors.labels(replica.name).inc()
        if isinstance(failure, UpstreamUnanswered):
            replica.inflight -= 1
            self.record(replica, failure.kind)
        else:
            self._done(replica, failure.kind)
        if isinstance(failure, UpstreamConnectError):
            await self.replicas.mark_down(replica, f"connection failed: {failure}")

    @staticmethod
    def _failure_answer(replica: Replica, failure: UpstreamError, path: str) -> Response:
        """503 when the replica could not be connected to; else its failure's 502 or 504 (in the
        dialect of ``path``)."""
        if isinstance(failure, UpstreamConnectError):
            return gateway_error(path, 503, "No replica could be reached", code="no_replica")
        return failed_answer(replica.name, failure, {REPLICA_HEADER: replica.name}, path)

    def record(self, replica: Replica, failure: str | None) -> None:
        """Feed one request's outcome on ``replica`` (None: success; else the kind of failure) to
        its outlier state: count the failure, log and count an ejection, log a return."""
        now = time.monotonic()
        if failure is None:
            if replica.outlier.succeeded(now):
                logger.warning("replica %s is routed to again: a request succeeded after its ejection",
                               replica.name)
            return
        self.metrics.upstream_failures.labels(replica.name, failure).inc()
        if failure == "timeout":
            self.metrics.timeouts.labels(replica.name).inc()
        ejected_s = replica.outlier.failed(now, self.outliers)
        if ejected_s is not None:
            self.metrics.ejections.labels(replica.name).inc()
            logger.warning("replica %s is ejected for %.1f s (ejection %d in a row; last failure: %s); "
                           "requests go to the other replicas meanwhile", replica.name, ejected_s,
                           replica.outlier.ejections, failure)

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

    async def fan_out(self, request: Request, path: str, method: str = "GET",
                      timeout_s: float = 10.0) -> list[tuple[Replica, int, Any]]:
        """``method`` ``path`` (no body, the request's query) on every healthy replica: (replica,
        status, parsed JSON or None) for each answer."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key", "accept")}

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

    def _done(self, replica: Replica, failure: str | None) -> None:
        """A request the replica received is over (``failure``: None, or why it failed)."""
        replica.inflight -= 1
        replica.finished += 1
        if failure == "cut":
            self.metrics.stream_errors.labels(replica.name).inc()
        self.record(replica, failure)
