#!/usr/bin/env python3
"""A coding agent through Anthropic's Messages API: cache reads and TTFT per turn, kvhive against vLLM for CPU.

The trace is ``bench/agent_trace.py``'s, in the Messages API's shape: the tools (20 definitions with
JSON-schema ``input_schema``) and the system prompt (instructions, ~600 tokens) are shared by every
turn of an agent; turn ``t`` sends the task and ``t`` rounds of an assistant ``tool_use`` block and
the user's ``tool_result`` block (~65 and ~285 tokens), and asks for the next step (greedy,
``--max-tokens`` tokens, streamed). Two ``cache_control`` breakpoints (``{"type": "ephemeral",
"ttl": --ttl}``), as coding agents place them: on the system block (the prefix tools + system) and
on the last block of the history (the newest ``tool_result``), so each turn reads the previous
turn's history from the cache and writes its own.

Two arms, each on a server of its own started for it, in paired rounds (who goes first alternates):

- ``kvhive``: ``kvhive serve`` (the default SmolLM2 GGUF), ``POST /v1/messages``;
- ``vllm``: vLLM for CPU's ``POST /v1/messages`` (``../shared/peers/vllm.sh serve DTYPE PORT``, the
  same model dequantised to a Hugging Face directory), with ``--chat-template
  bench/smollm2_tools.jinja``: SmolLM2's own template renders neither tools nor calls, and this
  one writes them as kvhive does for such a template, so both servers see the same prompt (the
  table shows each turn's prompt tokens on both).

Each pass of the trace salts the system prompt (nothing an earlier pass left is read); ``--repeats``
passes per server per round. Per turn the usage counters are recorded with Anthropic's meanings
(the prompt is ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``; the last
usage a stream reports counts), and TTFT is the time from sending the request to the first
streamed piece of output (a ``text_delta``, an ``input_json_delta``, or a ``tool_use`` block's
start). ``--tool-choice none`` (the default) shows the model the tools but reads its reply as text,
so that no tool parser holds back the first tokens on either server; ``auto`` lets each server
read calls.

    flock /tmp/kvhive-bench.lock python bench/messages_agent.py --rounds 2
    python bench/messages_agent.py --arms kvhive --turns 3 --repeats 1 --out /tmp/messages_agent.json  # a quick check

The result goes to ``bench/results/messages_agent.json``; ``python bench/report.py`` renders it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import statistics
import sys
import time

import agent_trace
from agent_loop import TEMPLATE, run_agents
from multiturn_vs_vllm import VLLM_SH, served
from run_info import command, machine

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"
ARMS = ("kvhive", "vllm")
COUNTERS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens")
PEER = "vLLM for CPU 0.32.0"


def anthropic_tools() -> list[dict]:
    """The trace's tool definitions in the Messages API's shape."""
    return [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
            for f in (t["function"] for t in agent_trace.tool_definitions())]


def tool_use_id(agent: int, turn: int) -> str:
    return f"toolu_{agent}_{turn}"


def history(agent: int, turn: int) -> list[dict]:
    """The task, then ``turn`` rounds of a ``tool_use`` and its ``tool_result``; a breakpoint on the last."""
    out: list[dict] = [{"role": "user", "content": [{"type": "text", "text": agent_trace.user_task(agent)}]}]
    for t in range(1, turn + 1):
        name, arguments = agent_trace.tool_call(agent, t)
        out.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": tool_use_id(agent, t), "name": name, "input": arguments}]})
        out.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_use_id(agent, t), "content": agent_trace.tool_result(agent, t)}]})
    return out


def request_body(agent: int, turn: int, salt: str, args: argparse.Namespace) -> dict:
    """Turn ``turn`` of ``agent``'s trace: tools, system and history, two breakpoints."""
    breakpoint_ = {"type": "ephemeral", "ttl": args.ttl}
    messages = history(agent, turn)
    messages[-1]["content"][-1]["cache_control"] = breakpoint_
    return {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "system": [{"type": "text", "text": agent_trace.system_prompt(salt, with_tools_text=False),
                        "cache_control": breakpoint_}],
            "tools": anthropic_tools(), "tool_choice": {"type": args.tool_choice}, "messages": messages}


def messages_stream(port: int, body: dict, api_key: str) -> dict:
    """POST one streamed ``/v1/messages``: TTFT, the last usage reported, the text or calls' JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    start = time.perf_counter()
    conn.request("POST", "/v1/messages", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                          "x-api-key": api_key, "anthropic-version": "2023-06-01"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"/v1/messages on port {port}: HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft, text, usage, stop = None, [], {}, None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        event = json.loads(line[5:])
        kind = event.get("type")
        reported = event.get("usage") or (event.get("message") or {}).get("usage") or {}
        usage.update({k: v for k, v in reported.items() if v is not None})
        piece = None
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            piece = delta.get("text") or delta.get("partial_json")
        elif kind == "content_block_start" and (event.get("content_block") or {}).get("type") == "tool_use":
            piece = json.dumps({"tool_use": event["content_block"].get("name")})
        elif kind == "message_delta":
            stop = (event.get("delta") or {}).get("stop_reason")
        if piece:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            text.append(piece)
    conn.close()
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - start, **{k: usage.get(k) for k in COUNTERS},
            "stop_reason": stop, "text": "".join(text)}


def run_trace(port: int, args: argparse.Namespace) -> dict:
    """One pass of the trace against one server, agents in parallel threads; rows per request."""
    salt = f"{random.randrange(10**7, 10**8)}"
    return {"salt": salt, **run_agents(args.agents, args.turns, lambda a, t: messages_stream(
        port, request_body(a, t, salt, args), args.api_key))}


def prompt_tokens(row: dict) -> int:
    """Anthropic's total: what was read, what was written to the cache and what was neither."""
    return sum(row[k] or 0 for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))


def per_turn(passes: list[dict]) -> list[dict]:
    """Per turn, the medians over the passes' agents: counters, prompt, read fraction, TTFT."""
    rows = [r for p in passes for r in p["rows"]]
    out = []
    for t in sorted({r["turn"] for r in rows}):
        at = [r for r in rows if r["turn"] == t]
        timed = [r["ttft_s"] for r in at if r["ttft_s"] is not None]
        out.append({"turn": t, "prompt_tokens": statistics.median(prompt_tokens(r) for r in at),
                    **{k: statistics.median(r[k] or 0 for r in at) for k in COUNTERS},
                    "read_fraction": statistics.median((r["cache_read_input_tokens"] or 0) / prompt_tokens(r)
                                                       for r in at),
                    "ttft_s": statistics.median(timed) if timed else None, "no_output": len(at) - len(timed)})
    return out


def later_ttft(passes: list[dict]) -> float | None:
    """Median TTFT over turns 2 and later of every agent of the passes."""
    timed = [r["ttft_s"] for p in passes for r in p["rows"] if r["turn"] >= 2 and r["ttft_s"] is not None]
    return statistics.median(timed) if timed else None


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def warm_up(port: int, args: argparse.Namespace) -> None:
    """One untimed request so that no arm's first timed turn pays for set-up."""
    messages_stream(port, {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
                           "messages": [{"role": "user", "content": "warm up " * 300}]}, args.api_key)


def serve(cmd: list[str], env: dict | None, log: str, args: argparse.Namespace) -> list[dict]:
    """Start a server, run ``--repeats`` passes of the trace on it, stop it."""
    with served(cmd, args.port, log, env):
        warm_up(args.port, args)
        passes = []
        for _ in range(args.repeats):
            passes.append(run_trace(args.port, args))
            fractions = " ".join(f"{t['read_fraction']:.2f}" for t in per_turn(passes[-1:]))
            print(f"  pass {len(passes)}: turns 2+ TTFT {ms(later_ttft(passes[-1:]))} ms; read fraction per "
                  f"turn {fractions}; wall {passes[-1]['wall_s']:.0f} s", flush=True)
        return passes


def run_round(index: int, args: argparse.Namespace) -> dict[str, list[dict]]:
    """One round: kvhive and vLLM, the order alternating by round."""
    jobs = []
    if "kvhive" in args.arms:
        cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(args.port), "--log-level", "warning",
               "--dtype", args.dtype, *shlex.split(args.kvhive_args)]
        jobs.append(("kvhive", cmd, None))
    if "vllm" in args.arms:
        extra = f"--chat-template {shlex.quote(TEMPLATE)} {args.vllm_args}".strip()
        jobs.append(("vllm", ["bash", VLLM_SH, "serve", args.dtype, str(args.port)],
                     dict(os.environ, VLLM_EXTRA=extra)))
    out = {}
    for name, cmd, env in jobs if index % 2 == 0 else jobs[::-1]:
        out[name] = serve(cmd, env, os.path.join(args.log_dir, f"messages_agent_{name}_r{index + 1}.log"), args)
    return out


def table(record: dict) -> list[str]:
    """Markdown: per turn, each server's counters, read fraction and TTFT (medians over every pass)."""
    arms = [a for a in ARMS if any(a in r for r in record["rounds"])]
    turns = {a: per_turn([p for r in record["rounds"] for p in r.get(a, [])]) for a in arms}
    head = ["turn", "prompt tokens" + (" (" + " / ".join(arms) + ")" if len(arms) > 1 else "")]
    for a in arms:
        head += [f"{a} read / created / input", f"{a} read fraction", f"{a} TTFT (ms)"]
    lines = ["| " + " | ".join(head) + " |", "| ---: |" + " ---: |" * (len(head) - 1)]
    for i, t in enumerate(turns[arms[0]]):
        cells = [str(t["turn"]), " / ".join(f"{turns[a][i]['prompt_tokens']:,.0f}" for a in arms)]
        for a in arms:
            r = turns[a][i]
            cells += [f"{r['cache_read_input_tokens']:,.0f} / {r['cache_creation_input_tokens']:,.0f} / "
                      f"{r['input_tokens']:,.0f}", f"{r['read_fraction']:.3f}",
                      ms(r["ttft_s"]) + (f" ({r['no_output']} without output)" if r["no_output"] else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def round_table(record: dict) -> list[str]:
    """Markdown: each round's median TTFT over turns 2+, per server, and kvhive's ratio to vLLM."""
    lines = ["| round | arm | TTFT turns 2+ (ms) | ratio to vLLM | wall (s), per pass | load average, start to end |",
             "| ---: | --- | ---: | ---: | --- | --- |"]
    for i, r in enumerate(record["rounds"], 1):
        for arm in (a for a in ARMS if a in r):
            ttft = later_ttft(r[arm])
            ratio = f"{ttft / later_ttft(r['vllm']):.2f}x" if arm != "vllm" and "vllm" in r and ttft else "-"
            loads = [p["load_average_1m"] for p in r[arm]]
            walls = ", ".join(f"{p['wall_s']:.0f}" for p in r[arm])
            lines.append(f"| {i} | {arm} | {ms(ttft)} | {ratio} | {walls} | {loads[0][0]:.1f} to {loads[-1][1]:.1f} |")
    return lines


def summary_lines(record: dict) -> list[str]:
    """Markdown: per server, the read fraction of turns 2+ (summed tokens) and the median of the
    rounds' paired TTFT ratios to vLLM."""
    lines = []
    for arm in (a for a in ARMS if any(a in r for r in record["rounds"])):
        rows = [row for r in record["rounds"] for p in r.get(arm, []) for row in p["rows"] if row["turn"] >= 2]
        read = sum(row["cache_read_input_tokens"] or 0 for row in rows) / max(1, sum(prompt_tokens(row) for row in rows))
        ratios = [later_ttft(r[arm]) / later_ttft(r["vllm"]) for r in record["rounds"]
                  if arm != "vllm" and arm in r and "vllm" in r and later_ttft(r[arm]) and later_ttft(r["vllm"])]
        lines.append(f"- {arm}: turns 2+ read {read:.3f} of their prompt tokens from the cache"
                     + (f"; TTFT turns 2+ **{statistics.median(ratios):.2f}x** vLLM's (median of the rounds' paired "
                        f"ratios: {', '.join(f'{x:.2f}x' for x in ratios)})" if ratios else "") + ".")
    return [*lines, ""]


def config_line(record: dict) -> str:
    c = record["config"]
    return (f"{c['agents']} agent(s) at once, {c['turns']} turns, {c['repeats']} salted passes per server per round, "
            f"{c['max_tokens']} output tokens, greedy, `tool_choice` `{c['tool_choice']}`, breakpoints' TTL "
            f"{c['ttl']}, `--dtype {c['dtype']}`; kvhive flags `{c['kvhive_args'] or 'defaults'}`; peer: {record['peer']} "
            f"with `{c['vllm_extra']}`.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS), help="which of kvhive,vllm to run")
    ap.add_argument("--agents", type=int, default=1, help="agents running the trace at once")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3, help="salted passes of the trace per server per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tool-choice", default="none", choices=("none", "auto"))
    ap.add_argument("--ttl", default="5m", choices=("5m", "1h"))
    ap.add_argument("--api-key", default="bench-agent", help="sent as x-api-key (the breakpoints' owner)")
    ap.add_argument("--kvhive-args", default="--kv-cache-gb 4",
                    help="extra kvhive serve flags (default: the 4 GiB of KV vllm.sh gives vLLM)")
    ap.add_argument("--vllm-args", default="--enable-auto-tool-choice --tool-call-parser hermes",
                    help="extra vLLM server flags, after --chat-template bench/smollm2_tools.jinja")
    ap.add_argument("--port", type=int, default=8174)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "messages_agent.json"))
    ap.add_argument("--log-dir", default=os.path.join(HERE, "out"), help="the servers' logs")
    ap.add_argument("--notes", default="", help="a note stored with the result")
    args = ap.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := set(args.arms) - set(ARMS):
        ap.error(f"unknown arms: {sorted(unknown)}")
    os.makedirs(args.log_dir, exist_ok=True)
    rounds = [run_round(i, args) for i in range(args.rounds)]
    config = {k: getattr(args, k) for k in ("agents", "turns", "repeats", "max_tokens", "tool_choice", "ttl",
                                            "dtype", "kvhive_args", "arms")}
    config["vllm_extra"] = f"--chat-template bench/smollm2_tools.jinja {args.vllm_args}".strip()
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "command": command(__file__),
              "peer": f"{PEER}, {args.dtype}", "config": config, "rounds": rounds,
              **({"notes": args.notes} if args.notes else {})}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join([config_line(result), "", *table(result), "", *round_table(result), "", *summary_lines(result)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
