"""kvhive's KVAwareRequestRouter against Ray Serve's own request routers, on one Ray Serve
application of 2 kvhive replicas on a two-node Ray cluster on this machine.

    flock /tmp/kvhive-bench.lock python bench/ray_routers.py [--rounds 2] [--requests 90] [--quick]
    flock /tmp/kvhive-bench.lock python bench/ray_routers.py --api responses

Workload (the same for every arm): ``--contexts`` shared long contexts of ~``--context-tokens``
tokens each (tenants' documents), short unique questions, the context of each request drawn with
Zipf popularity (``--zipf``), ``--concurrency`` clients, through the application's ingress,
streamed with two output tokens. Arms: ``kvhive`` (KVAwareRequestRouter), ``power_of_two`` (Ray's
default PowerOfTwoChoicesRequestRouter) and ``prefix_affinity`` (Ray's PrefixCacheAffinityRouter,
the class ``ray.serve.llm.request_router`` exports; imported from its defining module, since
``ray.serve.llm`` itself needs vLLM or SGLang installed). Each arm is a fresh ``serve run`` of the
same config but ``router.request_router_class`` (fresh replicas: empty caches), first sends every
context once (warm-up, not measured), then the measured requests. Arms alternate in order across
``--rounds`` (A,B,C then C,B,A). Records TTFT (first streamed token, at the client) p50/p90 and
the cached fraction of prompt tokens (``usage.prompt_tokens_details.cached_tokens``).

``--api responses`` holds each context as a stored response instead (``POST /v1/responses``
with the context as ``input``, during the warm-up) and asks each question as a follow-up of it
(``previous_response_id``, the question as ``input``, ``store: false``), streamed; the replicas share a Redis
(``redis_url``: sessions, stored responses and a KV tier), fresh for every arm, so a follow-up
sent to the replica that does not hold its conversation is still answered. Ray's routers see the
request's ``input`` as its prompt. Writes ``ray_routers_responses.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import yaml
from run_info import command, machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from support.ray_cluster import ray_cluster, serve_run, wait_for_app, write_config  # noqa: E402
from support.redis_server import RedisServer  # noqa: E402
from support.servers import free_port  # noqa: E402

MODEL = "smollm2-135m"
ARMS = {
    "kvhive": "kvhive.integrations.ray.router:KVAwareRequestRouter",
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix_affinity": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
                       ":PrefixCacheAffinityRouter",
}
WORDS = ("contract party deliver goods payment notice invoice warranty claim river mountain valley forest "
         "garden bridge tower market report data system network region cluster harbour engine ledger "
         "archive council budget schedule shipment supplier customer audit policy").split()
TARGETS = {"power_of_two": 0.5, "prefix_affinity": 0.8}   # kvhive's p90 TTFT at most this times the arm's


def make_contexts(count: int, tokens: int, seed: int) -> list[str]:
    """``count`` distinct documents of about ``tokens`` tokens (the default model's tokenizer)."""
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(default_model_path())
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        words = [f"Document {i} of tenant {rng.randrange(10**6)}."]
        while len(tokenizer.encode(" ".join(words), add_special_tokens=True)) < tokens:
            words.extend(rng.choice(WORDS) for _ in range(40))
        docs.append(" ".join(words))
    return docs


def make_workload(contexts: int, requests: int, zipf: float, seed: int,
                  tenants: int = 1) -> list[tuple[int, str, int]]:
    """(context index, question, tenant) per request; contexts drawn with Zipf(``zipf``) popularity,
    tenants uniformly (from their own generator: one tenant gives the same contexts and questions)."""
    rng, tenant_rng = random.Random(seed), random.Random(seed + 1)
    weights = [1 / (rank + 1) ** zipf for rank in range(contexts)]
    return [(rng.choices(range(contexts), weights)[0], f"\n\nQuestion {i}: what does line {rng.randrange(99)} say?",
             tenant_rng.randrange(tenants)) for i in range(requests)]


def tenant_key(tenant: int) -> str:
    """The API key of tenant ``tenant``."""
    return f"kvhive-bench-tenant-{tenant}"


def create_response(client: httpx.Client, context: str, headers: dict[str, str]) -> str:
    """Store ``context`` as a response (one output token); its id."""
    r = client.post("/v1/responses", json={"model": MODEL, "input": context, "max_output_tokens": 1,
                                           "temperature": 0, "store": True}, headers=headers)
    r.raise_for_status()
    return r.json()["id"]


def timed_stream(client: httpx.Client, path: str, body: dict, headers: dict[str, str],
                 is_token: Callable[[dict], bool],
                 usage_of: Callable[[dict], dict | None]) -> tuple[float | None, dict, str | None]:
    """Stream ``body`` to ``path``: the time to the first event ``is_token`` accepts, the last usage
    ``usage_of`` finds in an event, and the replica that answered."""
    start = time.perf_counter()
    ttft, usage = None, {}
    with client.stream("POST", path, json=body, headers=headers) as response:
        response.raise_for_status()
        replica = response.headers.get("x-kvhive-replica")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and is_token(event):
                ttft = time.perf_counter() - start
            usage = usage_of(event) or usage
    return ttft, usage, replica


def follow_up(client: httpx.Client, previous: str, question: str, headers: dict[str, str]) -> dict[str, object]:
    """Stream a follow-up of response ``previous`` (not stored: questions about one context run at
    once, and a stored follow-up would take the conversation's session, one request at a time)."""
    body = {"model": MODEL, "previous_response_id": previous, "input": question, "max_output_tokens": 2,
            "temperature": 0, "stream": True, "store": False}
    # The usage comes with response.completed, or response.incomplete when max_output_tokens ends it.
    ttft, usage, replica = timed_stream(
        client, "/v1/responses", body, headers, lambda e: e.get("type") == "response.output_text.delta",
        lambda e: e["response"].get("usage") if e.get("type") in ("response.completed", "response.incomplete")
        else None)
    return {"ttft_s": ttft, "prompt_tokens": usage.get("input_tokens", 0), "replica": replica,
            "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)}


def ask(client: httpx.Client, prompt: str, headers: dict[str, str]) -> dict[str, object]:
    """Stream one completion; its TTFT, prompt and cached tokens, and the replica that answered."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, usage, replica = timed_stream(client, "/v1/completions", body, headers, lambda e: bool(e.get("choices")),
                                        lambda e: e.get("usage"))
    return {"ttft_s": ttft, "prompt_tokens": usage.get("prompt_tokens", 0), "replica": replica,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(arm: str, rows: list[dict[str, object]], warmup_s: float) -> dict[str, object]:
    """TTFT percentiles (ms), cached fraction and per-replica counts of one arm's measured requests."""
    ttfts = [float(r["ttft_s"]) * 1000 for r in rows]
    prompt = sum(int(r["prompt_tokens"]) for r in rows)
    replicas: dict[str, int] = {}
    for r in rows:
        replicas[str(r["replica"])] = replicas.get(str(r["replica"]), 0) + 1
    return {"arm": arm, "requests": len(rows), "cached_fraction": round(sum(int(r["cached_tokens"]) for r in rows)
                                                                         / max(prompt, 1), 4),
            "ttft_p50_ms": round(percentile(ttfts, 0.5), 1), "ttft_p90_ms": round(percentile(ttfts, 0.9), 1),
            "ttft_mean_ms": round(statistics.fmean(ttfts), 1), "requests_per_replica": sorted(replicas.values()),
            "warmup_s": round(warmup_s, 1)}


def arm_config(path: str, port: int, arm: str, args: argparse.Namespace, redis_url: str | None = None) -> str:
    """The application's config for ``arm``: the example config, one replica per node."""
    keys = [tenant_key(t) for t in range(args.tenants)] if args.tenants > 1 else None
    write_config(path, port, kv_cache_gb=args.kv_cache_gb, num_threads=1, max_ongoing_requests=8,
                 router={"request_router_class": ARMS[arm]}, redis_url=redis_url, api_key=keys)
    with open(path) as f:
        config = yaml.safe_load(f)
    config["applications"][0]["deployments"] = [{"name": "KVHiveReplica", "max_replicas_per_node": 1}]
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def run_arm(cluster, arm: str, args: argparse.Namespace, contexts: list[str],
            workload: list[tuple[int, str, int]], workdir: str) -> dict[str, object]:
    """One fresh application routed by ``arm``: warm-up, then the measured requests."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        redis_url = None
        if args.api == "responses":      # a fresh Redis per arm: no arm finds another's KV
            redis = RedisServer(free_port(), stack.enter_context(tempfile.TemporaryDirectory()))
            redis.start()
            stack.callback(redis.stop)
            redis_url = redis.url
        config = arm_config(os.path.join(workdir, f"{arm}.yaml"), port, arm, args, redis_url)
        run = stack.enter_context(serve_run(cluster, config))
        headers = [{"Authorization": f"Bearer {tenant_key(t)}"} if args.tenants > 1 else {}
                   for t in range(args.tenants)]
        client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                                  headers=headers[0]))     # /v1/models needs a key too
        wait_for_app(run, client)
        start = time.perf_counter()
        if args.api == "responses":
            ids = {(t, c): create_response(client, context, headers[t])
                   for t in range(args.tenants) for c, context in enumerate(contexts)}
            send = lambda item: follow_up(client, ids[item[2], item[0]], item[1].strip(), headers[item[2]])  # noqa: E731
        else:
            for t in range(args.tenants):
                for i, context in enumerate(contexts):
                    ask(client, context + f"\n\nQuestion w{i}: what is this about?", headers[t])
            send = lambda item: ask(client, contexts[item[0]] + item[1], headers[item[2]])  # noqa: E731
        warmup_s = time.perf_counter() - start
        with ThreadPoolExecutor(args.concurrency) as pool:
            rows = list(pool.map(send, workload))
    result = summarize(arm, rows, warmup_s)
    print(json.dumps(result), flush=True)
    return result


def combine(runs: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """Per arm, the median over rounds of each figure, and each round's."""
    arms: dict[str, dict[str, object]] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        if mine:
            arms[arm] = {k: round(statistics.median(float(r[k]) for r in mine), 4 if k == "cached_fraction" else 1)
                         for k in ("cached_fraction", "ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms")}
            arms[arm]["rounds"] = mine
    return arms


def plot(record: dict[str, object], path: str) -> None:
    """TTFT p50/p90 and cached fraction per arm, side by side, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = record["arms"]
    names = list(arms)
    fig, (ttft, cached) = plt.subplots(1, 2, figsize=(9, 3.6))
    xs = range(len(names))
    ttft.bar([x - 0.2 for x in xs], [arms[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    ttft.bar([x + 0.2 for x in xs], [arms[n]["ttft_p90_ms"] for n in names], 0.4, label="p90")
    ttft.set_xticks(list(xs), names)
    ttft.set_ylabel("TTFT (ms)")
    ttft.legend()
    cached.bar(list(xs), [100 * arms[n]["cached_fraction"] for n in names], 0.5, color="tab:green")
    cached.set_xticks(list(xs), names)
    cached.set_ylabel("prompt tokens cached (%)")
    cached.set_ylim(0, 100)
    api = {"prompts": "contexts as prompt text", "responses": "contexts as stored responses"}[record["setup"]["api"]]
    if record["setup"].get("tenants", 1) > 1:
        api += f", {record['setup']['tenants']} tenants"
    fig.suptitle(f"Ray Serve request routers, 2 kvhive replicas, {api} (median of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, default=10)
    ap.add_argument("--context-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=90)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--api", choices=("prompts", "responses"), default="prompts",
                    help="contexts sent as prompt text, or held as stored responses and continued by id")
    ap.add_argument("--tenants", type=int, default=1,
                    help="API keys (tenants) sharing the contexts, each with its own KV (salted by its key)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 small contexts, 9 requests, 1 round")
    ap.add_argument("--out", default=None, help="default: bench/results/ray_routers[_responses].json")
    args = ap.parse_args()
    if args.tenants < 1:
        ap.error("--tenants must be >= 1")
    suffix = ("" if args.api == "prompts" else f"_{args.api}") + ("_tenants" if args.tenants > 1 else "")
    args.out = args.out or os.path.join(REPO, "bench", "results", f"ray_routers{suffix}.json")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # so the cluster is stopped
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"     # other work on the box must not get replicas killed
    if args.quick:
        args.contexts, args.context_tokens, args.requests, args.rounds = 3, 200, 9, 1
        args.out = os.path.join(tempfile.gettempdir(), f"ray_routers{suffix}_quick.json")
    contexts = make_contexts(args.contexts, args.context_tokens, args.seed)
    workload = make_workload(args.contexts, args.requests, args.zipf, args.seed, args.tenants)
    load_start = os.getloadavg()[0]
    runs = []
    with ray_cluster(num_nodes=2, cpus_per_node=2) as cluster, tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):
            arms = [arm for arm in ARMS if arm in args.arms.split(",")]
            order = arms if round_index % 2 == 0 else arms[::-1]
            runs += [{**run_arm(cluster, arm, args, contexts, workload, workdir), "round": round_index}
                     for arm in order]
    arms = combine(runs)
    kv = arms["kvhive"]["ttft_p90_ms"] if "kvhive" in arms else None
    ratios = {arm: round(kv / arms[arm]["ttft_p90_ms"], 3) for arm in TARGETS if arm in arms and kv}
    record = {"command": command("bench/ray_routers.py"), "machine": machine(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "load_average_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
              "setup": {k: getattr(args, k) for k in ("api", "contexts", "context_tokens", "requests", "concurrency",
                                                       "zipf", "rounds", "kv_cache_gb", "seed", "tenants")},
              "arms": arms, "p90_ratio_kvhive_over": ratios,
              "targets_met": {arm: ratios[arm] <= goal for arm, goal in TARGETS.items() if arm in ratios}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    if not args.quick and {"kvhive", "power_of_two", "prefix_affinity"} <= arms.keys():
        plot(record, os.path.join(REPO, "docs", f"ray_routers{suffix}.png"))
    print(json.dumps({"p90_ratio_kvhive_over": ratios, "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
