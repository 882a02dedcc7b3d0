"""What a soak drill counts, torch- and network-free: the phase schedule, how each answer is
judged (fine, refused while the disk was full, cut by a restart, an error), the sessions that must
still exist, and the per-phase latency figures and targets.

The schedule splits the run into equal slots. Well-behaved clients run in every slot; hostile
clients only in the hostile ones (``hostile`` and the two fault slots). ``redis_stall``: Redis is
stopped, then flushed; ``disk_full``: the replicas' disk fills, then empties, and every replica
restarts at the end of that slot. Latency targets compare ``quiet`` with ``hostile`` slots only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The restart halfway (after the two faults) lets the lookups after it find any record a fault lost,
# and leaves half the run, hostile slots included, to the processes whose gauges end the run.
SCHEDULE = ("quiet", "hostile", "redis_stall", "quiet", "disk_full", "quiet", "hostile", "quiet", "hostile", "quiet")
HOSTILE_PHASES = frozenset({"hostile", "redis_stall", "disk_full"})
# Requests that generate (the latency figures are theirs; deletes and lookups take milliseconds).
GENERATING = frozenset({"chat", "chat_stream", "context_create", "session_turn", "conversation_turn", "responses",
                        "probe", "probe_session"})
# Requests that write a session or stored-response record: on a full disk they may be refused (507/503).
PERSISTING = frozenset({"context_create", "session_turn", "conversation_turn", "responses", "probe_session",
                        "spam_session"})
NOT_DURABLE = frozenset({"507", "503"})
# A hostile request is refused correctly with one of these, or by a closed connection.
REFUSALS = frozenset({"400", "408", "413", "429", "431", "closed"})
WINDOW_SLACK_S = 5.0          # a window of a fault covers answers this long after it ended
P99_RATIO_GOAL = 1.5


def phase_at(at_s: float, duration_s: float, schedule: tuple[str, ...] = SCHEDULE) -> str:
    """The scheduled phase at ``at_s`` seconds into a run of ``duration_s`` (the last one past the end)."""
    slot = int(at_s / duration_s * len(schedule)) if duration_s > 0 else 0
    return schedule[min(max(slot, 0), len(schedule) - 1)]


def slot_start(name: str, duration_s: float, schedule: tuple[str, ...] = SCHEDULE) -> tuple[float, float]:
    """(start, end) in seconds of the first slot called ``name``."""
    i = schedule.index(name)
    width = duration_s / len(schedule)
    return i * width, (i + 1) * width


@dataclass(frozen=True)
class Record:
    """One exchange: its kind, status ("aborted" for a stream dropped on purpose, "closed" when the
    server closed the connection, "exception:<type>" when no answer came), latency, start (s since
    the run began), which client sent it ("good" or "hostile") and to which replica."""

    kind: str
    status: str
    latency_s: float
    at_s: float
    client: str = "good"
    replica: str = ""


def overlaps(record: Record, window: tuple[float, float | None], end_s: float) -> bool:
    start, stop = window
    stop = (end_s if stop is None else stop) + WINDOW_SLACK_S
    return record.at_s <= stop and record.at_s + record.latency_s >= start


@dataclass
class Windows:
    """When each fault held: (start, end) seconds since the run began (end None: still holding)."""

    disk_full: list[tuple[float, float | None]] = field(default_factory=list)
    restart: list[tuple[float, float | None]] = field(default_factory=list)
    redis_stall: list[tuple[float, float | None]] = field(default_factory=list)

    def during(self, name: str, record: Record, end_s: float) -> bool:
        return any(overlaps(record, w, end_s) for w in getattr(self, name))


def judge(record: Record, windows: Windows, end_s: float) -> str:
    """A well-behaved answer: ok, aborted (on purpose), refused_not_durable (507/503 on a write
    while the disk was full), restart (refused or cut while the replicas restarted) or error."""
    status = record.status
    if status.startswith("2"):
        return "ok"
    if status == "aborted":
        return "aborted"
    if status in NOT_DURABLE and record.kind in PERSISTING and windows.during("disk_full", record, end_s):
        return "refused_not_durable"
    if windows.during("restart", record, end_s):         # refused or cut by the clean restart
        return "restart"
    return "error"


def judge_hostile(record: Record, windows: Windows, end_s: float) -> str:
    """A hostile request: refused (4xx or a closed connection, as it should be), accepted (a 200
    where one is right: a spam session under the limits), restart (anything but a 4xx while the
    replicas restarted: their clean stop closes connections), refused_not_durable, 5xx (bad input
    made the server fail) or unexpected (anything else: accepted bad input, a connection held
    open, a timeout)."""
    status = record.status
    if status.startswith("2") and record.kind == "spam_session":
        return "accepted"
    if status[0] != "4" and windows.during("restart", record, end_s):    # closed or cut by the clean stop
        return "restart"
    if status in REFUSALS:
        return "refused"
    if status in NOT_DURABLE and record.kind in PERSISTING and windows.during("disk_full", record, end_s):
        return "refused_not_durable"
    if status.startswith("5"):
        return "5xx"
    return "unexpected"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def count(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def phase_latency(records: list[Record], windows: Windows, duration_s: float) -> dict[str, dict]:
    """p50/p99 of well-behaved generating requests answered 2xx, per phase (a request counts in
    the phase it started in; one cut by a restart window in none)."""
    by_phase: dict[str, list[float]] = {}
    for r in records:
        if r.client != "good" or r.kind not in GENERATING or not r.status.startswith("2"):
            continue
        if windows.during("restart", r, duration_s):
            continue
        by_phase.setdefault(phase_at(r.at_s, duration_s), []).append(r.latency_s)
    return {phase: {"requests": len(v), "p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)}
            for phase, v in sorted(by_phase.items())}


def p99_ratio(phases: dict[str, dict]) -> float | None:
    """p99 of the hostile phases over p99 of the quiet ones."""
    quiet, hostile = phases.get("quiet", {}).get("p99_s"), phases.get("hostile", {}).get("p99_s")
    return hostile / quiet if quiet and hostile else None


@dataclass
class Tracked:
    """A session the drill created (answered 200): where, whose, its TTL, when it last answered 200."""

    replica: str
    key: str
    ttl_s: float
    last_ok_s: float
    deleting: bool = False            # a DELETE is on its way
    deleted: bool = False
    lost: str | None = None           # how it was found missing


class Ledger:
    """Every session created with a 200 and whether it must still exist: not deleted and its TTL,
    counted from its last 200, not yet run out."""

    def __init__(self) -> None:
        self.sessions: dict[str, Tracked] = {}

    def created(self, session_id: str, replica: str, key: str, ttl_s: float, at_s: float) -> None:
        self.sessions[session_id] = Tracked(replica, key, ttl_s, at_s)

    def answered(self, session_id: str, at_s: float) -> None:
        self.sessions[session_id].last_ok_s = at_s

    def deleting(self, session_id: str, on_its_way: bool = True) -> None:
        self.sessions[session_id].deleting = on_its_way

    def deleted(self, session_id: str) -> None:
        self.sessions[session_id].deleted = True

    def must_exist(self, session_id: str, now_s: float, margin_s: float = 10.0) -> bool:
        s = self.sessions[session_id]
        return not (s.deleting or s.deleted) and s.lost is None and s.last_ok_s + s.ttl_s > now_s + margin_s

    def missing(self, session_id: str, now_s: float, how: str) -> bool:
        """A lookup or turn found the session gone: a loss when it must still exist."""
        if session_id in self.sessions and self.must_exist(session_id, now_s):
            self.sessions[session_id].lost = how
            return True
        return False

    def alive(self, now_s: float) -> list[str]:
        """The sessions that must exist now (safe from another thread while clients add sessions)."""
        return [i for i, _ in list(self.sessions.items()) if self.must_exist(i, now_s)]

    def losses(self) -> dict[str, str]:
        return {i: f"{s.replica}: {s.lost}" for i, s in self.sessions.items() if s.lost is not None}


def targets(figures: dict) -> dict[str, bool]:
    """Each target of the drill, met or not."""
    ratio = figures["latency"]["p99_ratio"]
    return {"no lost session": figures["sessions"]["lost"] == 0,
            "no wrong greedy answer": figures["probes"]["wrong"] == 0 and figures["probes"]["answered"] > 0,
            "no 5xx from bad input": figures["hostile"]["5xx"] == 0,
            "every hostile request refused (4xx or a closed connection)": figures["hostile"]["unexpected"] == 0,
            "no well-behaved request failed (but for full-disk refusals and the restart)":
                figures["well_behaved"]["num_errors"] == 0,
            f"hostile-phase p99 <= {P99_RATIO_GOAL}x quiet": ratio is not None and ratio <= P99_RATIO_GOAL,
            "gauges back to baseline": all(g["back"] for g in figures["gauges"].values())}


def gauges(before: dict[str, dict], after: dict[str, dict], keys: list[str]) -> dict[str, dict]:
    """Per replica and baseline gauge: before, after, and whether it came back (equal)."""
    out = {}
    for replica in before:
        b, a = before[replica]["metrics"], after.get(replica, {}).get("metrics", {})
        for key in keys:
            if key in b or key in a:
                out[f"{replica} {key}"] = {"before": b.get(key), "after": a.get(key),
                                           "back": a.get(key) is not None and a.get(key) == b.get(key, 0.0)}
    return out


def summarize(records: list[Record], windows: Windows, ledger: Ledger, probes: list[dict], duration_s: float
              ) -> dict:
    """Every figure of a run but the gauges: answers judged, latency per phase, sessions, probes,
    hostile outcomes."""
    good = [r for r in records if r.client == "good"]
    hostile = [r for r in records if r.client == "hostile"]
    judged = [judge(r, windows, duration_s) for r in good]
    errors = count([f"{r.kind} {r.status}" for r, j in zip(good, judged, strict=True) if j == "error"])
    outcomes = [judge_hostile(r, windows, duration_s) for r in hostile]
    by_kind: dict[str, dict[str, int]] = {}
    for r, outcome in zip(hostile, outcomes, strict=True):
        by_kind.setdefault(r.kind, {})
        by_kind[r.kind][f"{outcome} ({r.status})"] = by_kind[r.kind].get(f"{outcome} ({r.status})", 0) + 1
    phases = phase_latency(records, windows, duration_s)
    wrong = [p for p in probes if not p["ok"]]
    refused = sum(1 for r in records if r.kind in PERSISTING and r.status in NOT_DURABLE
                  and windows.during("disk_full", r, duration_s))
    losses = ledger.losses()
    on_full_disk = count([f"{r.kind} {r.status}" for r in records
                          if r.kind in PERSISTING and windows.during("disk_full", r, duration_s)])
    return {
        "well_behaved": {"requests": len(good), "judged": count(judged), "errors": errors,
                         "num_errors": sum(errors.values()),
                         "5xx": sum(1 for r, j in zip(good, judged, strict=True) if j == "error" and r.status[0] == "5"),
                         "by_kind": {k: count([r.status for r in good if r.kind == k])
                                     for k in sorted({r.kind for r in good})}},
        "latency": {"phases": phases, "p99_ratio": p99_ratio(phases), "goal": P99_RATIO_GOAL},
        "sessions": {"created": len(ledger.sessions), "deleted": sum(s.deleted for s in ledger.sessions.values()),
                     "refused_not_durable": refused, "writes_on_full_disk": on_full_disk, "lost": len(losses), "lost_by": count(list(losses.values())),
                     "losses": dict(list(losses.items())[:20])},
        "probes": {"answered": len(probes), "wrong": len(wrong), "by_mode": count([p["mode"] for p in probes]),
                   "wrong_examples": wrong[:10]},
        "hostile": {"requests": len(hostile), "outcomes": count(outcomes),
                    "5xx": outcomes.count("5xx"), "unexpected": outcomes.count("unexpected"), "by_kind": by_kind},
    }
