"""A foreign replica: vLLM for CPU publishing its KV events behind ``kvhive gateway`` (``kind=vllm``).

    python bench/vllm_replica_routing.py [--docs 4] [--doc-tokens 400]

Starts vLLM (``../shared/peers/vllm.sh serve float32 PORT`` with ``--kv-events-config`` turning on
its ZMQ publisher and replay socket), one ``kvhive serve`` replica, and the gateway in front of both
(the vLLM replica as ``kind=vllm``: its engine hashes are mapped to kvhive keys from the token ids of
its BlockStored events). It checks, and records:

1. the raw vLLM events (decoded by ``kvhive.core.kv_events``): block size, medium, hash type;
2. that the gateway's tokenization equals vLLM's own (``/tokenize``) for the prompts sent;
3. routing: each document is sent once (routed by load, so some land on vLLM), then again with new
   questions: each must go back to the replica that holds it, with route reason ``kv``, and be
   served from that replica's cache (``cached_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_real import (  # noqa: E402
    REPO,
    free_port,
    gateway_metric,
    make_docs,
    start_gateway,
    start_kvhive_replica,
    stop,
    wait_for,
)
from run_info import command, machine  # noqa: E402

VLLM_SH = os.path.join(os.path.dirname(REPO), "shared", "peers", "vllm.sh")


def start_vllm(log_dir: str, topic: str) -> tuple[subprocess.Popen, str, str, str]:
    port, events, replay = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": topic}
    env = {**os.environ, "VLLM_EXTRA": "--kv-events-config " + json.dumps(config, separators=(",", ":")),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.Popen(["bash", VLLM_SH, "serve", "float32", str(port)], env=env,
                            stdout=open(f"{log_dir}/vllm.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    return proc, url, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"


class RawEvents:
    """Subscribes to vLLM's PUB socket beside the gateway and keeps what it sees, decoded."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.batches: list[tuple[int, object]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        from kvhive.core.kv_events import decode_batch

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        while not self._stop.is_set():
            if sub.poll(100):
                frames = sub.recv_multipart()
                try:
                    self.batches.append((int.from_bytes(frames[1], "big"), decode_batch(frames[2])))
                except Exception as exc:  # noqa: BLE001 - recorded in the report
                    self.errors.append(f"{type(exc).__name__}: {exc}")
        sub.close(linger=0)
        ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def summary(self) -> dict[str, object]:
        from kvhive.core.kv_events import BlockRemoved, BlockStored

        stored = [e for _, b in self.batches for e in b.events if isinstance(e, BlockStored)]
        removed = [e for _, b in self.batches for e in b.events if isinstance(e, BlockRemoved)]
        return {"batches": len(self.batches), "decode_errors": self.errors[:3],
                "stored_events": len(stored), "stored_blocks": sum(len(e.block_hashes) for e in stored),
                "removed_events": len(removed),
                "block_sizes": sorted({e.block_size for e in stored}),
                "media": sorted({str(e.medium) for e in stored}),
                "hash_types": sorted({type(h).__name__ for e in stored for h in e.block_hashes})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2, help="follow-up questions per document")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "vllm_replica_routing.json"))
    args = p.parse_args()
    log_dir = tempfile.mkdtemp(prefix="vllm-routing-")
    print(f"logs in {log_dir}", flush=True)
    vllm, vllm_url, events, replay = start_vllm(log_dir, "kv-events")
    kvhive, kvhive_spec = start_kvhive_replica(log_dir, num_blocks=400, threads=1)
    gateway = None
    raw = None
    report: dict[str, object] = {"machine": machine(), "command": command(__file__)}
    try:
        t0 = time.monotonic()
        wait_for(f"{vllm_url}/v1/models", lambda r: r.status_code == 200, 600, "vLLM", vllm)
        report["vllm_start_s"] = round(time.monotonic() - t0, 1)
        wait_for(kvhive_spec.split(",")[0] + "/health", lambda r: r.status_code == 200, 120, "kvhive", kvhive)
        raw = RawEvents(events)
        specs = [f"{vllm_url},events={events},replay={replay},kind=vllm", kvhive_spec]
        gateway, url = start_gateway(log_dir, specs)
        docs = make_docs(args.docs, args.doc_tokens, 7)

        # 2. Tokenization: the gateway's (kvhive's tokenizer) against vLLM's /tokenize.
        from kvhive.core.model_files import default_model_path
        from kvhive.core.tokenizer import Tokenizer

        tok = Tokenizer.from_model_path(default_model_path())
        same = 0
        for doc in docs:
            theirs = httpx.post(f"{vllm_url}/tokenize", json={"model": "smollm2-135m", "prompt": doc},
                                timeout=30).json().get("tokens")
            same += theirs == tok.encode(doc)
        report["tokenization_equal"] = f"{same}/{len(docs)}"

        # 3. Routing.
        rows = []
        with httpx.Client(timeout=300) as client:
            def ask(doc_index: int, question: str) -> dict[str, object]:
                body = {"model": "smollm2-135m", "prompt": f"{docs[doc_index]}\n{question}", "max_tokens": 1,
                        "temperature": 0}
                start = time.perf_counter()
                r = client.post(f"{url}/v1/completions", json=body)
                r.raise_for_status()
                usage = r.json()["usage"]
                replica = r.headers["x-kvhive-replica"]
                row = {"doc": doc_index, "replica": "vllm" if replica == vllm_url else "kvhive",
                       "reason": r.headers["x-kvhive-route-reason"], "prompt_tokens": usage["prompt_tokens"],
                       "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                       "latency_ms": round((time.perf_counter() - start) * 1000, 1)}
                rows.append(row)
                print(row, flush=True)
                return row

            first = {i: ask(i, "Question 0: summarise it.")["replica"] for i in range(len(docs))}
            time.sleep(2.0)       # the replicas' events reach the gateway
            for k in range(1, args.rounds + 1):
                for i in range(len(docs)):
                    ask(i, f"Question {k}: what about item {k}?")
        follow = [r for r in rows[len(docs):]]
        report["first_placement"] = first
        report["follow_ups"] = len(follow)
        report["follow_ups_to_holder"] = sum(r["replica"] == first[r["doc"]] for r in follow)
        report["follow_ups_reason_kv"] = sum(r["reason"] == "kv" for r in follow)
        report["follow_ups_on_vllm_cached_tokens"] = [
            r["cached_tokens"] for r in follow if r["replica"] == "vllm"]
        labels = {"replica": vllm_url}
        report["gateway_vllm_event_batches"] = gateway_metric(
            url, "kvhive_gateway_kv_event_batches_total", labels)
        report["gateway_vllm_unmapped_blocks"] = gateway_metric(
            url, "kvhive_gateway_kv_event_unmapped_blocks_total", labels)
        report["gateway_index_keys"] = gateway_metric(url, "kvhive_gateway_index_keys")
        report["requests"] = rows
    finally:
        if raw is not None:
            raw.close()
            report["vllm_events"] = raw.summary()
        stop([gateway, kvhive])
        if vllm.poll() is None:
            os.killpg(vllm.pid, 15)
            try:
                vllm.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(vllm.pid, 9)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps({k: v for k, v in report.items() if k != "requests"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
