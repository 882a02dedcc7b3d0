"""Gateway configuration: frozen dataclasses validated once (``ValueError`` names the flag)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvhive.core.http_limits import HttpLimits
from kvhive.gateway.outlier import OutlierPolicy
from kvhive.routing.scorer import SCORERS, RoutingWeights, TierWeights

REPLICA_KINDS = ("kvhive", "vllm")
# How the gateway picks a replica for a request without a session: by KV score and load (kvhive's
# routing), or one of the baselines it is measured against.
ROUTING_POLICIES = ("kv", "least_load", "round_robin", "random")


@dataclass(frozen=True)
class ReplicaSpec:
    """One backend: its base URL, where it publishes KV events, and which engine it is."""

    url: str
    events: str | None = None
    replay: str | None = None
    kind: str = "kvhive"
    role: str = "both"              # --prefill / --decode replicas of disaggregated serving
    kv: str | None = None           # a decode replica's KV transfer endpoint, host:port

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"replica {self.url}: role must be both, prefill or decode, got {self.role!r}")
        if self.role == "decode" and not self.kv:
            raise ValueError(f"--decode {self.url}: give its KV transfer endpoint, kv=host:port "
                             "(its --kv-transfer-port)")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--replica: {self.url!r} is not an http(s) URL")
        if self.kind not in REPLICA_KINDS:
            raise ValueError(f"--replica {self.url}: kind must be one of {REPLICA_KINDS}, got {self.kind!r}")
        if self.replay is not None and self.events is None:
            raise ValueError(f"--replica {self.url}: replay= needs events= too")

    @property
    def name(self) -> str:
        """The replica's name in the index, metrics and headers: its URL."""
        return self.url

    @classmethod
    def parse(cls, text: str, role: str = "both") -> ReplicaSpec:
        """``URL[,events=tcp://host:port][,replay=tcp://host:port][,kind=kvhive|vllm]``, and for a
        ``decode`` replica ``kv=host:port`` (its KV transfer endpoint)."""
        url, *options = [part.strip() for part in text.split(",")]
        values: dict[str, str] = {}
        known = ("events", "replay", "kind") + (("kv",) if role == "decode" else ())
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in known:
                raise ValueError(f"--{'replica' if role == 'both' else role} {text!r}: unknown option "
                                 f"{option!r} (expected {', '.join(k + '=' for k in known)})")
            values[key] = value
        return cls(url.rstrip("/"), values.get("events"), values.get("replay"),
                   values.get("kind", "kvhive"), role, values.get("kv"))


# The longest poll interval (--health-interval, --discover-interval) and affinity entry lifetime
# (ten years: within Redis's expiry range) the gateway takes, in seconds.
MAX_INTERVAL_S = 3600
MAX_AFFINITY_TTL_S = 10 * 365 * 86400


@dataclass(frozen=True)
class GatewayConfig:
    """Everything ``kvhive gateway`` needs, validated once."""

    replicas: tuple[ReplicaSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    # Redis shared by several gateways: the block index and session affinity (None: in memory).
    redis_url: str | None = None
    # Seconds a shared session-affinity entry lives after its last use: at least the replicas'
    # --max-session-ttl, so no entry expires before the session it points to.
    affinity_ttl_s: int = 86400
    # Redis where replicas register themselves (kvhive serve --register), polled every interval.
    discover_url: str | None = None
    discover_interval_s: float = 1.0
    index_max_keys: int = 1_000_000
    model_path: str | None = None
    block_size: int = 16
    hash_seed: int = 0
    model_fingerprint: str = ""
    scorer: str = "longest_prefix"
    policy: str = "kv"
    tiers: TierWeights = field(default_factory=TierWeights)
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    health_interval_s: float = 1.0
    failures_to_drop: int = 2
    # Upstream time limits (``upstream.py`` says what each bounds); request_timeout_s 0: none.
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    outliers: OutlierPolicy = field(default_factory=OutlierPolicy)
    # A replica's events endpoint is silent when nothing came this long after a request went there.
    events_silent_after_s: float = 30.0
    prefix_chunk_chars: int = 512
    prefix_max_chunks: int = 100_000
    tokenize_workers: int = 2
    max_sessions: int = 100_000
    # The replicas run with --api-key and without --share-prefix-cache: each key salts its blocks.
    salt_with_api_key: bool = False
    # Largest request body the gateway reads (413 above): it holds each body in memory to forward it.
    max_request_bytes: int = 32 * 2**20
    # Per-connection HTTP limits: request head size, fields and time, keep-alive, open connections.
    http: HttpLimits = field(default_factory=HttpLimits)

    def __post_init__(self) -> None:
        if not self.replicas and self.discover_url is None:
            raise ValueError("--replica: give at least one replica (or --discover)")
        for flag, url in (("--redis-url", self.redis_url), ("--discover", self.discover_url)):
            if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(f"{flag} must be a redis:// URL, got {url!r}")
        if not 1 <= self.affinity_ttl_s <= MAX_AFFINITY_TTL_S:
            raise ValueError(f"--session-affinity-ttl must be in [1, {MAX_AFFINITY_TTL_S}], got {self.affinity_ttl_s}")
        if not 0 < self.discover_interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"--discover-interval must be in (0, {MAX_INTERVAL_S}], got {self.discover_interval_s}")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError("--replica: the same URL is given twice")
        roles = {r.role for r in self.replicas}
        if roles & {"prefill", "decode"} and not {"prefill", "decode"} <= roles:
            raise ValueError("--prefill and --decode go together: give at least one of each")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if not 0 <= self.hash_seed < 2**64:
            raise ValueError(f"--hash-seed must fit in 64 bits, got {self.hash_seed}")
        if self.scorer not in SCORERS:
            raise ValueError(f"--scorer must be one of {sorted(SCORERS)}, got {self.scorer!r}")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"--policy must be one of {ROUTING_POLICIES}, got {self.policy!r}")
        if not 0 < self.health_interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"--health-interval must be in (0, {MAX_INTERVAL_S}], got {self.health_interval_s}")
        if self.failures_to_drop < 1:
            raise ValueError(f"--failures-to-drop must be >= 1, got {self.failures_to_drop}")
        if self.index_max_keys < 1:
            raise ValueError(f"--index-max-keys must be >= 1, got {self.index_max_keys}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {self.max_request_bytes}")
        if not (math.isfinite(self.request_timeout_s) and 0 <= self.request_timeout_s <= 86400):
            raise ValueError(f"--request-timeout must be in [0, 86400] (0: no limit), got {self.request_timeout_s}")
        if not (math.isfinite(self.connect_timeout_s) and 0 < self.connect_timeout_s <= 600):
            raise ValueError(f"--connect-timeout must be in (0, 600], got {self.connect_timeout_s}")
        if not (math.isfinite(self.events_silent_after_s) and 0 < self.events_silent_after_s <= 86400):
            raise ValueError(f"--events-silent-after must be in (0, 86400], got {self.events_silent_after_s}")

    @property
    def request_limit_s(self) -> float | None:
        """--request-timeout in seconds, None for no limit."""
        return self.request_timeout_s or None

    @property
    def disaggregated(self) -> bool:
        """True with --prefill / --decode replicas: prompts prefill on one, decode on the other."""
        return any(r.role != "both" for r in self.replicas)
