#!/usr/bin/env python3
"""Hostile-load drill: clients for T minutes against two kvhive replicas this script starts, with
quiet and hostile phases, a Redis stall, a full disk and a restart.

    python bench/soak.py --clients 6 --minutes 3 --redis-stop-s 8 --out /tmp/soak.json
    python bench/soak.py --clients 32 --minutes 30 --drain-s 300

Needs root (or ``unshare -rm``) to mount a small tmpfs, and ``redis-server``. Two replicas share
one set of API keys (two well-behaved keys, one hostile key): ``redis`` keeps sessions and KV in a
redis-server the script starts (and KV on the tmpfs), ``disk`` keeps both on the tmpfs.

The run is cut into equal slots (``soak_figures.SCHEDULE``): quiet, hostile, redis_stall, quiet,
disk_full, quiet, hostile, quiet, hostile, quiet. Well-behaved clients (``soak_clients``) run all
along: chats, sessions, ``conversation_id`` chats, dropped streams, ``/v1/responses`` chains and
greedy probes checked against the answers of the quiet replica. Hostile clients
(``soak_hostile``, a quarter of the clients, one key) run in the hostile slots: bad JSON bodies,
oversize bodies, endless and slow headers on raw sockets, bursts of session creates. In the
redis_stall slot Redis is stopped (SIGSTOP) for ``--redis-stop-s``, then flushed; in the disk_full
slot the tmpfs is full (shrunk to what it holds) until the slot ends, then both replicas restart
(clean stop, start) and every session that must exist is looked up.

At the end every session answered 200 and neither deleted nor expired is looked up (a 404 then,
or on a turn during the run, is a lost session), then deleted; the script waits up to
``--drain-s`` for what is left to expire and compares the gauges with their values at the start.
Writes ``--out`` (``bench/results/soak.json``); server logs go to ``bench/out/soak_*.log``.
Exit status 0 when every target is met.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from run_info import command, machine
from soak_clients import SCENARIOS, Client, Run, reference_answers
from soak_figures import SCHEDULE, gauges, slot_start, summarize, targets
from soak_hostile import Hostile
from soak_infra import RedisServer, Replica, SmallDisk, baseline_keys, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GOOD_KEYS = ("soak-key-a", "soak-key-b")
HOSTILE_KEY = "soak-key-hostile"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8, help="clients in all (at least 2)")
    p.add_argument("--hostile-fraction", type=float, default=0.25, help="share of the clients that are hostile")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-stop-s", type=float, default=20.0, help="how long Redis stays stopped")
    p.add_argument("--disk-mb", type=int, default=2048,
                   help="size of the tmpfs the replicas' disk dirs are on (each replica's disk tier: 40%%)")
    p.add_argument("--session-ttl-s", type=int, default=300, help="TTL of the well-behaved clients' sessions")
    p.add_argument("--server-args", default="--kv-cache-gb 0.25 --max-model-len 2048 --default-session-ttl 120 "
                   "--max-sessions-per-key 200", help="more 'kvhive serve' arguments, for both replicas")
    p.add_argument("--body-bytes", type=int, default=900_000, help="size of the hostile bodies under the limit")
    p.add_argument("--limit-bytes", type=int, default=1 << 20, help="the replicas' body limit (--max-request-bytes)")
    p.add_argument("--slow-header-s", type=float, default=60.0, help="a slow header not cut off by then is held open")
    p.add_argument("--spam-burst", type=int, default=50, help="session creates per spam burst")
    p.add_argument("--spam-ttl-s", type=int, default=300, help="TTL of the spam sessions")
    p.add_argument("--grace-s", type=float, default=180.0, help="time a client may finish its scenario")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle time before the end checks")
    p.add_argument("--drain-s", type=float, default=150.0,
                   help="wait up to this long for what is left (conversations, stored responses) to expire")
    p.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    args = p.parse_args()
    slot_s = args.minutes * 60 / len(SCHEDULE)
    if args.clients < 2 or not 0 < args.hostile_fraction < 1:
        p.error("--clients must be >= 2 and --hostile-fraction in (0, 1)")
    if not 0 < args.redis_stop_s < slot_s * 0.8:
        p.error(f"--redis-stop-s must be under 80% of a slot ({slot_s:.0f} s at --minutes {args.minutes:g})")
    return args


async def faults(run: Run, redis: RedisServer, disk: SmallDisk, replicas: dict[str, Replica], stop_s: float) -> None:
    """The Redis stall, then the full disk and the restart, each in its slot."""
    start, end = slot_start("redis_stall", run.duration_s)
    await asyncio.sleep(max(0.0, start + (end - start - stop_s) / 3 - run.now_s()))
    run.windows.redis_stall.append((run.now_s(), None))
    await asyncio.to_thread(redis.stall, stop_s, run.note)
    run.windows.redis_stall[-1] = (run.windows.redis_stall[-1][0], run.now_s())

    start, end = slot_start("disk_full", run.duration_s)
    await asyncio.sleep(max(0.0, start - run.now_s()))
    run.windows.disk_full.append((run.now_s(), None))
    free = await asyncio.to_thread(disk.fill)
    run.note(f"disk full ({free / 2**20:.0f} MB were free, {disk.free_bytes()} bytes now)")
    await asyncio.sleep(max(0.0, end - run.now_s()))
    await asyncio.to_thread(disk.unfill)
    run.windows.disk_full[-1] = (run.windows.disk_full[-1][0], run.now_s())
    run.note("disk emptied; restarting the replicas")
    run.windows.restart.append((run.now_s(), None))
    took = await asyncio.gather(*(asyncio.to_thread(r.restart) for r in replicas.values()))
    run.windows.restart[-1] = (run.windows.restart[-1][0], run.now_s())
    run.note("replicas restarted (" + ", ".join(f"{name} stopped in {stop:.0f} s, healthy {start:.0f} s later"
                                             for name, (stop, start) in zip(replicas, took, strict=True)) + ")")
    run.checks["after_restart"] = await asyncio.to_thread(check_sessions, run, replicas, "missing after the restart")


async def drill(args: argparse.Namespace, run: Run, replicas: dict[str, Replica], redis: RedisServer,
                disk: SmallDisk) -> list[dict[str, Any]]:
    """Run the clients and the faults; the RSS/gauge timeline."""
    timeline: list[dict[str, Any]] = []

    async def sample() -> None:
        while True:
            points = await asyncio.gather(*(asyncio.to_thread(r.snapshot) for r in replicas.values()))
            timeline.append({"at_s": round(run.now_s(), 1), **dict(zip(replicas, points, strict=True))})
            await asyncio.sleep(10)

    names = list(replicas)
    hostile_n = max(1, round(args.clients * args.hostile_fraction))
    http = [httpx.AsyncClient(base_url=replicas[names[i % 2]].base_url, timeout=300,
                              headers={"Authorization": f"Bearer {GOOD_KEYS[i // 2 % 2]}"})
            for i in range(args.clients - hostile_n)]
    good = [Client(run, names[i % 2], GOOD_KEYS[i // 2 % 2], h, random.Random(args.seed * 1000 + i))
            for i, h in enumerate(http)]
    bad = [Hostile(run, {n: r.base_url for n, r in replicas.items()}, HOSTILE_KEY, args.body_bytes, args.limit_bytes,
                   args.slow_header_s, args.spam_burst, args.spam_ttl_s, random.Random(args.seed * 1000 + 500 + i))
           for i in range(hostile_n)]
    background = [asyncio.create_task(sample()), asyncio.create_task(faults(run, redis, disk, replicas,
                                                                           args.redis_stop_s))]
    clients = [asyncio.create_task(c.loop()) for c in [*good, *bad]]
    try:
        done, pending = await asyncio.wait(clients, timeout=run.duration_s + args.grace_s)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()
        if not background[1].done():
            run.note("waiting for the faults to finish")
        await asyncio.wait_for(background[1], 600)   # a fault that failed fails the drill
    finally:
        for task in [*background, *clients]:
            task.cancel()
        for h in http:
            await h.aclose()
    return timeline


def check_sessions(run: Run, replicas: dict[str, Replica], how: str, delete: bool = False) -> dict[str, Any]:
    """Look up every session that must exist now (a 404 is a loss); ``delete``: then delete it."""
    alive = run.ledger.alive(run.now_s())
    statuses: dict[str, int] = {}
    for session_id in alive:
        s = run.ledger.sessions[session_id]
        headers = {"Authorization": f"Bearer {s.key}"}
        try:
            status = str(httpx.get(f"{replicas[s.replica].base_url}/v1/context/{session_id}", headers=headers,
                                   timeout=60).status_code)
        except httpx.HTTPError as exc:
            status = f"exception:{type(exc).__name__}"
        statuses[status] = statuses.get(status, 0) + 1
        if status == "404":
            run.ledger.missing(session_id, run.now_s(), how)
        if not delete:
            continue
        with contextlib.suppress(httpx.HTTPError):
            if httpx.delete(f"{replicas[s.replica].base_url}/v1/context/{session_id}", headers=headers,
                            timeout=60).status_code == 200:
                run.ledger.deleted(session_id)
    return {"checked": len(alive), "statuses": dict(sorted(statuses.items()))}


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM stops the drill like Ctrl-C: everything it started is stopped, the tmpfs unmounted."""
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, interrupt)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    log = lambda name: os.path.join(HERE, "out", f"soak_{name}.log")  # noqa: E731
    with contextlib.ExitStack() as stack:
        disk = SmallDisk(args.disk_mb)
        stack.callback(disk.close)
        redis = RedisServer(free_port(), log("redis"))
        stack.callback(redis.stop)
        keys = [a for k in (*GOOD_KEYS, HOSTILE_KEY) for a in ("--api-key", k)]
        disk_gb = f"{args.disk_mb * 0.4 / 1024:.3f}"
        common = [*shlex.split(args.server_args), *keys, "--max-request-bytes", str(args.limit_bytes),
                  "--disk-cache-gb", disk_gb]
        replicas = {"redis": Replica("redis", [*common, "--redis-url", redis.url, "--disk-cache-dir",
                                               disk.subdir("redis")], log("server_redis"), REPO),
                    "disk": Replica("disk", [*common, "--disk-cache-dir", disk.subdir("disk")], log("server_disk"),
                                    REPO)}
        for replica in replicas.values():
            stack.callback(replica.stop)
        with ThreadPoolExecutor(2) as pool:
            print("healthy after", [f"{t:.0f} s" for t in pool.map(Replica.start, replicas.values())], flush=True)
        before = {name: r.snapshot() for name, r in replicas.items()}
        references = {name: asyncio.run(reference_answers(r.base_url, GOOD_KEYS[0])) for name, r in replicas.items()}
        run = Run(time.monotonic(), args.minutes * 60, args.session_ttl_s, references)
        timeline = asyncio.run(drill(args, run, replicas, redis, disk))
        time.sleep(args.idle_s)
        run.checks["at_end"] = check_sessions(run, replicas, "missing at the end", delete=True)
        drained = {name: r.drain(args.drain_s) for name, r in replicas.items()}
        after = {name: r.snapshot() for name, r in replicas.items()}
        healthy = {name: r.healthy() for name, r in replicas.items()}
        for replica in replicas.values():
            replica.stop()
    figures = summarize(run.records, run.windows, run.ledger, run.probes, run.duration_s)
    figures["sessions"]["checks"] = run.checks
    figures["gauges"] = gauges(before, after, baseline_keys({k: 0 for s in (*before.values(), *after.values())
                                                             for k in s["metrics"]}))
    met = targets(figures)
    exit_codes = {name: r.exit_codes for name, r in replicas.items()}
    result = {
        "machine": machine(), "command": command(__file__),
        "config": {"clients": args.clients, "hostile_clients": max(1, round(args.clients * args.hostile_fraction)),
                   "minutes": args.minutes, "seed": args.seed, "schedule": SCHEDULE, "scenarios": SCENARIOS,
                   "redis_stop_s": args.redis_stop_s, "disk_mb": args.disk_mb, "body_bytes": args.body_bytes,
                   "servers": {name: shlex.join(r.cmd) for name, r in replicas.items()}, "cpus": os.cpu_count()},
        **figures, "targets": met, "throughput_rps": len(run.records) / run.duration_s,
        "events": run.events, "windows": vars(run.windows),
        "before": before, "after": after, "drained_after_s": drained, "healthy_after": healthy,
        "server_exit_codes": exit_codes,
        "rss_mb": {name: {"before": before[name]["rss_mb"], "after": after[name]["rss_mb"],
                          "max": max((p[name]["rss_mb"] or 0 for p in timeline), default=None)} for name in replicas},
        "timeline": timeline,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_report(result)
    print(f"wrote {args.out}")
    clean = all(healthy.values()) and all(c == 0 for codes in exit_codes.values() for c in codes)
    return 0 if all(met.values()) and clean and figures["well_behaved"]["num_errors"] == 0 else 1


def print_report(result: dict[str, Any]) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    w, h, s, p = result["well_behaved"], result["hostile"], result["sessions"], result["probes"]
    print(f"well-behaved: {w['requests']} requests {w['judged']}, errors {w['errors']}")
    for phase, f in result["latency"]["phases"].items():
        print(f"  {phase:<12} {f['requests']:>5}  p50 {ms(f['p50_s']):>8}  p99 {ms(f['p99_s']):>8}")
    ratio = result["latency"]["p99_ratio"]
    print(f"  p99 hostile / quiet: {'-' if ratio is None else f'{ratio:.2f}x'}")
    print(f"hostile: {h['requests']} requests {h['outcomes']}")
    for kind, outcomes in sorted(h["by_kind"].items()):
        print(f"  {kind:<20} {outcomes}")
    print(f"sessions: {s['created']} created, {s['deleted']} deleted, {s['refused_not_durable']} refused (not durable),"
          f" checks {s['checks']}, lost {s['lost']} {s['lost_by'] or ''}")
    print(f"probes: {p['answered']} answered {p['by_mode']}, wrong {p['wrong']}")
    for example in p["wrong_examples"][:3]:
        print(f"  {example}")
    for key, g in result["gauges"].items():
        if not g["back"]:
            print(f"  gauge not back: {key} {g['before']} -> {g['after']}")
    print("events:", "; ".join(f"{e['at_s']:.0f} s {e['event']}" for e in result["events"]))
    print(f"healthy after: {result['healthy_after']}, exit codes {result['server_exit_codes']}, "
          f"drained after {result['drained_after_s']}")
    for target, ok in result["targets"].items():
        print(f"  {'met    ' if ok else 'NOT MET'}  {target}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: the replicas and redis-server are stopped, the tmpfs unmounted", file=sys.stderr)
        sys.exit(130)
