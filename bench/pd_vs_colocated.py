#!/usr/bin/env python3
"""Disaggregated prefill/decode against two colocated replicas, on one core per instance, paired.

    flock /tmp/kvhive-bench.lock python bench/pd_vs_colocated.py            # the measurement
    python bench/pd_vs_colocated.py --quick                                  # a smoke run

Two arms stay up side by side, each behind its own ``kvhive gateway``:
- **pd**: ``kvhive serve --kv-role prefill`` on core 0 and ``--kv-role decode`` on core 1, behind
  ``kvhive gateway --prefill .. --decode ..``;
- **colocated**: two ``kvhive serve`` (``--kv-role both``) on cores 0 and 1, behind
  ``kvhive gateway --replica .. --replica ..``.
Every instance runs ``--num-threads 1`` on the default model (default dtype), once per
``--budgets`` value of ``--max-num-batched-tokens`` (the default 2,048 runs a 1,500-token prompt
in one step; 256 chunks it, as a colocated server does to shield running decodes). A round sends one arm
a steady stream of decodes (``--decoders`` clients, each streaming ``--decode-tokens`` greedy tokens,
then the next request) while new long prompts (``--long-sentences`` sentences, ~1,500 tokens, unique per round)
arrive every ``--interval`` seconds (``--budgets 256@6``: that run every 6 s), streamed with
``--long-max-tokens`` tokens. Rounds alternate
A, B, B, A ... with the same prompts for both arms. Recorded: the running decodes' inter-token gaps
(p50/p99/p99.9/max), the long prompts' TTFT (p50/p90), the KV transfer throughput from the
decode and prefill /metrics, and a loopback TCP and memcpy bound for the same bytes.
Writes ``bench/results/pd_vs_colocated.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from router_real import ENV, REPO, free_port, stop, wait_for  # bench/ is on sys.path: scripts run from there
from run_info import command, machine

MODEL = "smollm2-135m"
SENTENCE = "The ledger for cargo ship {n} lists {a} crates of tea, {b} barrels of oil and {c} bales of wool."


def serve(name: str, core: int, log_dir: str, extra: list[str], profile_dir: str | None = None
          ) -> tuple[subprocess.Popen, str]:
    """A ``kvhive serve`` pinned to ``core`` (one thread); the process and its URL. ``profile_dir``:
    run it under ``profiled_serve.py``, its trace ``profile_dir/NAME_trace.json``."""
    port = free_port()
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    launch = [sys.executable, "-m", "kvhive.cli", "serve"]
    if profile_dir is not None:
        launch = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiled_serve.py"),
                  "--trace", os.path.join(profile_dir, f"{name}_trace.json"), "--control", profile_dir, "--"]
    cmd = [*pin, *launch, "--port", str(port), "--num-threads", "1",
           "--max-model-len", "4096", "--log-level", "warning", *extra]
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO), f"http://127.0.0.1:{port}"


def gateway(flags: list[str], log_dir: str, name: str) -> tuple[subprocess.Popen, str]:
    """A ``kvhive gateway`` with ``flags``, once every replica it names is up."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvhive.cli", "gateway", "--port", str(port), "--log-level", "warning", *flags]
    log = open(os.path.join(log_dir, f"{name}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/health", lambda r: r.status_code == 200 and set(r.json()["replicas"].values()) == {"up"},
             300, name, proc)
    return proc, url


def stream(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """One greedy streamed completion: (start, arrival time of each text chunk, prompt tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, times, prompt_tokens = time.perf_counter(), [], 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
    return start, times, prompt_tokens


def long_prompt(tag: str, sentences: int) -> str:
    """A new ~``sentences`` x 25-token prompt, unique to ``tag`` from its first token."""
    return f"Archive {tag}. " + " ".join(SENTENCE.format(n=i, a=i * 7 % 91, b=i * 13 % 53, c=i * 3 % 29)
                                         for i in range(sentences))


def run_round(url: str, tag: str, args: argparse.Namespace) -> dict:
    """Decoders stream steadily while the long prompts arrive; their gaps and the prompts' TTFTs."""
    stop_decoders, gaps, lock = threading.Event(), [], threading.Lock()
    ttfts: list[float] = []
    tokens: list[int] = []

    def decoder(k: int) -> None:
        with httpx.Client() as client:
            n = 0
            while not stop_decoders.is_set():
                _, times, _ = stream(client, url, f"Story {tag}-{k}-{n}: once upon a time, a sailor", args.decode_tokens)
                with lock:
                    gaps.extend(b - a for a, b in zip(times, times[1:], strict=False))
                n += 1

    def long_one(i: int) -> None:
        with httpx.Client() as client:
            start, times, prompt_tokens = stream(client, url, long_prompt(f"{tag}-{i}", args.long_sentences),
                                                 args.long_max_tokens)
        with lock:
            ttfts.append(times[0] - start)
            tokens.append(prompt_tokens)

    decoders = [threading.Thread(target=decoder, args=(k,)) for k in range(args.decoders)]
    for t in decoders:
        t.start()
    time.sleep(args.warm_s)
    longs = []
    for i in range(args.long_prompts):
        longs.append(threading.Thread(target=long_one, args=(i,)))
        longs[-1].start()
        time.sleep(args.interval)
    for t in longs:
        t.join()
    stop_decoders.set()
    for t in decoders:
        t.join()
    return {"gaps": gaps, "ttfts": ttfts, "prompt_tokens": tokens}


def scrape(url: str) -> dict[str, float]:
    """The KV transfer counters of one instance: bytes, frame/load count and seconds."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "kvhive_kv_transfer_bytes_total":
                out[s.labels["direction"] + "_bytes"] = out.get(s.labels["direction"] + "_bytes", 0) + s.value
            elif s.name in ("kvhive_kv_transfer_seconds_sum", "kvhive_kv_transfer_seconds_count"):
                out[s.name.rsplit("_", 1)[1]] = out.get(s.name.rsplit("_", 1)[1], 0) + s.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def loopback_bound(total_bytes: int, frame_bytes: int, repeat: int = 5) -> dict[str, float]:
    """GB/s of a plain loopback TCP copy of ``total_bytes`` in ``frame_bytes`` frames, and of a memcpy."""
    import numpy as np

    frame, tcp = bytes(frame_bytes), []
    for _ in range(repeat):
        server = socket.create_server(("127.0.0.1", 0))
        got = [0]

        def sink(server: socket.socket = server, got: list[int] = got) -> None:
            conn, _ = server.accept()
            buf = bytearray(1 << 20)
            while (n := conn.recv_into(buf)) > 0:
                got[0] += n
            conn.close()

        reader = threading.Thread(target=sink)
        reader.start()
        start = time.perf_counter()
        with socket.create_connection(server.getsockname()) as out:
            for _ in range(max(1, total_bytes // frame_bytes)):
                out.sendall(frame)
        reader.join()
        tcp.append(got[0] / (time.perf_counter() - start) / 1e9)
        server.close()
    src, dst = np.ones(total_bytes, np.uint8), np.empty(total_bytes, np.uint8)
    copies = []
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(dst, src)
        copies.append(total_bytes / (time.perf_counter() - start) / 1e9)
    return {"tcp_gb_s": max(tcp), "memcpy_gb_s": max(copies), "bytes": total_bytes, "frame_bytes": frame_bytes}


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(rounds: list[dict]) -> dict:
    """Pooled inter-token gaps and TTFTs of an arm's rounds, in ms."""
    gaps = [g for r in rounds for g in r["gaps"]]
    ttfts = [t for r in rounds for t in r["ttfts"]]
    return {"itl_ms": {name: 1000 * pct(gaps, q) for name, q in
                       (("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999), ("max", 1.0))},
            "ttft_ms": {"p50": 1000 * pct(ttfts, 0.5), "p90": 1000 * pct(ttfts, 0.9)},
            "num_gaps": len(gaps), "num_prompts": len(ttfts),
            "prompt_tokens": statistics.median(t for r in rounds for t in r["prompt_tokens"])}


def start_arms(log_dir: str, extra: list[str], profile_dir: str | None = None
               ) -> tuple[list[subprocess.Popen], dict[str, str], dict[str, str]]:
    """Both arms' instances and gateways; (processes, gateway URL per arm, instance URL per name).
    ``profile_dir``: the prefill and decode instances run under the profiler (``profile_transfer``)."""
    kv_port = free_port()
    procs, urls = [], {}
    for name, core, flags in (("prefill", 0, ["--kv-role", "prefill"]),
                              ("decode", 1, ["--kv-role", "decode", "--kv-transfer-port", str(kv_port)]),
                              ("replica0", 0, []), ("replica1", 1, [])):
        proc, urls[name] = serve(name, core, log_dir, flags + extra,
                                 profile_dir if name in ("prefill", "decode") else None)
        procs.append(proc)
    for name, proc in zip(urls, procs, strict=True):
        wait_for(urls[name] + "/health", lambda r: r.status_code == 200, 600, name, proc)
    gateways = {}
    for arm, flags in (("pd", ["--prefill", urls["prefill"], "--decode", f"{urls['decode']},kv=127.0.0.1:{kv_port}"]),
                       ("colocated", ["--replica", urls["replica0"], "--replica", urls["replica1"]])):
        proc, gateways[arm] = gateway(flags, log_dir, f"gateway-{arm}")
        procs.append(proc)
    return procs, gateways, urls


def warm_up(urls: dict[str, str], sentences: int) -> None:
    """A long and a short prompt on every instance: first requests of a shape pay one-off set-up."""
    with httpx.Client() as client:
        for url in urls.values():
            stream(client, url, long_prompt("warm-up", sentences), 4)
            stream(client, url, "Warm-up: once upon a time", 4)


def profile_transfer(url: str, profile_dir: str, sentences: int, wait_s: float = 60.0) -> list[str]:
    """One long prompt through the PD gateway at ``url`` while the prefill and decode instances
    profile (their layer-by-layer KV send and load beside the layers' kernels); the traces written."""
    traces = [os.path.join(profile_dir, f"{name}_trace.json") for name in ("prefill", "decode")]

    def until_all(suffix: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(os.path.exists(t + suffix) for t in traces):
            time.sleep(0.1)

    open(os.path.join(profile_dir, "start"), "w").close()
    until_all(".started", wait_s / 3)                 # a profiler that cannot start is not waited for long
    with httpx.Client() as client:
        stream(client, url, long_prompt("profiled", sentences), 4)
    open(os.path.join(profile_dir, "stop"), "w").close()
    until_all(".done", wait_s)
    return [t for t in traces if os.path.exists(t + ".done")]


def measure(args: argparse.Namespace, gateways: dict[str, str], urls: dict[str, str]) -> dict:
    """Paired rounds (the arm that starts alternates); each arm's rounds and the transfer counters."""
    rounds: dict[str, list[dict]] = {"pd": [], "colocated": []}
    counters = {"prefill": scrape(urls["prefill"]), "decode": scrape(urls["decode"])}
    for r in range(args.rounds):
        for arm in ("pd", "colocated") if r % 2 == 0 else ("colocated", "pd"):
            load = os.getloadavg()[0]
            got = {**run_round(gateways[arm], f"r{r}", args), "load_1m": load}
            rounds[arm].append(got)
            print(f"round {r} {arm}: ITL p99 {1000 * pct(got['gaps'], 0.99):.0f} ms, TTFT "
                  f"{', '.join(f'{1000 * t:.0f}' for t in got['ttfts'])} ms", flush=True)
    counters = {name: delta(scrape(urls[name]), before) for name, before in counters.items()}
    return {"rounds": rounds, "counters": counters}


def transfer_figures(counters: dict[str, dict[str, float]], num_prompts: int) -> dict:
    """Transfer throughput from the instances' counters, against a loopback bound for the same bytes."""
    sent, received = counters["prefill"], counters["decode"]
    per_prompt = int(sent.get("sent_bytes", 0) / max(num_prompts, 1))
    frame = int(sent.get("sent_bytes", 0) / max(sent.get("count", 0), 1))
    out = {"bytes_per_prompt": per_prompt, "frame_bytes": frame,
           "send_gb_s": sent.get("sent_bytes", 0) / max(sent.get("sum", 0), 1e-9) / 1e9,
           "decode_load_gb_s": received.get("received_bytes", 0) / max(received.get("sum", 0), 1e-9) / 1e9,
           "decode_load_ms_per_prompt": 1000 * received.get("sum", 0) / max(received.get("count", 0), 1)}
    if per_prompt and frame:
        out["loopback"] = loopback_bound(per_prompt, frame)
    return out


def run_budget(args: argparse.Namespace, budget: int, interval: float) -> dict:
    """Both arms with ``--max-num-batched-tokens budget`` on every instance and long prompts
    ``interval`` seconds apart: paired rounds, summed up."""
    args = argparse.Namespace(**{**vars(args), "interval": interval})
    log_dir = tempfile.mkdtemp(prefix="kvhive-pd-bench-")
    load_start, procs, traces = os.getloadavg()[0], [], []
    profile_dir = None if args.profile_dir is None else os.path.join(args.profile_dir, f"budget{budget}")
    if profile_dir is not None:
        os.makedirs(profile_dir, exist_ok=True)
    try:
        procs, gateways, urls = start_arms(log_dir, [*args.server_args.split(), "--device", args.device,
                                                     "--max-num-batched-tokens", str(budget)], profile_dir)
        warm_up(urls, args.long_sentences)
        if profile_dir is not None:
            traces = profile_transfer(gateways["pd"], profile_dir, args.long_sentences)
        got = measure(args, gateways, urls)
    finally:
        stop(procs)
    arms = {arm: summary(rounds) for arm, rounds in got["rounds"].items()}
    pd, co = arms["pd"], arms["colocated"]
    ratios = {f"{what}_{q}": pd[f"{what}_ms"][q] / co[f"{what}_ms"][q]
              for what, q in (("itl", "p99"), ("itl", "p99.9"), ("ttft", "p50"), ("ttft", "p90"))}
    return {"max_num_batched_tokens": budget, "interval_s": interval, "arms": arms, "ratios": ratios,
            "load_average_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
            "targets_met": {"itl_p99 <= 0.5x": ratios["itl_p99"] <= 0.5, "ttft_p50 <= 1.3x": ratios["ttft_p50"] <= 1.3},
            "transfer": transfer_figures(got["counters"], pd["num_prompts"]), "profiler_traces": traces,
            "paired_medians": paired_medians(got["rounds"]),
            "per_round": {arm: [{"itl_p99_ms": 1000 * pct(r["gaps"], 0.99), "ttft_ms": [1000 * t for t in r["ttfts"]],
                                 "load_1m": round(r["load_1m"], 2)} for r in rounds]
                          for arm, rounds in got["rounds"].items()}}


def paired_medians(rounds: dict[str, list[dict]]) -> dict[str, float]:
    """Median over rounds of PD / colocated in the same round: ITL p99 and median TTFT."""
    pairs = list(zip(rounds["pd"], rounds["colocated"], strict=True))
    return {"itl_p99": statistics.median(pct(p["gaps"], 0.99) / pct(c["gaps"], 0.99) for p, c in pairs),
            "ttft_p50": statistics.median(statistics.median(p["ttfts"]) / statistics.median(c["ttfts"])
                                          for p, c in pairs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="rounds per arm (paired, the first arm alternates)")
    ap.add_argument("--decoders", type=int, default=4, help="clients streaming decodes back to back")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--long-prompts", type=int, default=4, help="long prompts per round")
    ap.add_argument("--long-sentences", type=int, default=48, help="sentences of ~31 tokens per long prompt")
    ap.add_argument("--long-max-tokens", type=int, default=16)
    ap.add_argument("--interval", type=float, default=8.0, help="seconds between long prompts (for --budgets)")
    ap.add_argument("--warm-s", type=float, default=2.0, help="decodes alone before the first long prompt")
    ap.add_argument("--budgets", default="2048,256",
                    help="--max-num-batched-tokens values, one run of both arms each (2048: the default); "
                         "BUDGET@SECONDS gives that run its own --interval")
    ap.add_argument("--server-args", default="", help="extra flags for every kvhive serve")
    ap.add_argument("--device", default="cpu",
                    help="every instance's --device (cuda: all four instances share the one GPU)")
    ap.add_argument("--profile-dir", default=None, metavar="DIR",
                    help="before the rounds, profile one long prompt on the prefill and decode instances "
                         "(bench/profiled_serve.py): Chrome traces DIR/budgetN/{prefill,decode}_trace.json")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one short round per arm")
    ap.add_argument("--out", default=None, help="the result file (default: bench/results/pd_vs_colocated.json; "
                                                "with --quick, one in the temp directory)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.decoders, args.decode_tokens, args.long_prompts = 1, 2, 16, 1
        args.long_sentences, args.long_max_tokens, args.interval, args.warm_s = 8, 4, 0.5, 0.5
        args.budgets = "2048"
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "pd_vs_colocated_quick.json") if args.quick else
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pd_vs_colocated.json"))
    runs = []
    for spec in args.budgets.split(","):
        budget, _, interval = spec.partition("@")
        runs.append(run_budget(args, int(budget), float(interval) if interval else args.interval))
    record = {"machine": machine(), "command": command(__file__), "date": time.strftime("%Y-%m-%d"),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "quick", "profile_dir")},
              "device": args.device, "dtype": "float32 (the default)", "runs": runs}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for run in runs:
        print(json.dumps({k: run[k] for k in ("max_num_batched_tokens", "interval_s", "arms", "ratios", "transfer")},
                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
