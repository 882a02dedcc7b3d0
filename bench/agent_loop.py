#!/usr/bin/env python3
"""An agent loop over real HTTP: TTFT per turn and cached fraction, kvhive against vLLM for CPU.

The trace (``bench/agent_trace.py``): 8 agents at once share a ~3,200-token system prompt with 20
tool definitions; each runs 12 turns, turn ``t`` sending the history with ``t`` canned tool calls
(~65 tokens) and results (~285 tokens) and asking for the next step (greedy, ``--max-tokens``
tokens, streamed). Each agent sends its next turn as soon as the last one's stream ends.

Arms, the servers each started for them in turn (never an idle one beside it):

- ``kvhive``: ``kvhive serve``, automatic prefix caching;
- ``kvhive_conv``: the same server, a second pass of the trace with ``conversation_id`` (a
  session per agent; the last turn ends it);
- ``kvhive_spec``, ``kvhive_conv_spec``: the two passes again on a server with speculative
  decoding (``--speculative-config``, by default kvhive's ``history`` method as
  docs/speculative_decoding.md recommends it; greedy output unchanged);
- ``vllm``: vLLM for CPU with prefix caching (``../shared/peers/vllm.sh serve DTYPE PORT``);
- ``vllm_ngram`` (only when named in ``--arms``): the same with vLLM's n-gram speculation
  (``--vllm-speculative-config``, k 5, lookup 2..4).

Each pass salts the system prompt so that it hits no cache an earlier pass left. TTFT is the time
from sending the request to the first streamed chunk that carries generated text (or a tool-call
delta); the cached fraction is ``usage.prompt_tokens_details.cached_tokens / prompt_tokens``
(``stream_options.include_usage``). Rounds alternate which server goes first; the target (turns
2-12 TTFT <= 0.6x vLLM's) is judged on the median of the rounds' paired ratios of the median TTFT
over turns 2-12 of all agents.

    flock /tmp/kvhive-bench.lock python bench/agent_loop.py --dtype float32 --rounds 2 --tools-field
    flock /tmp/kvhive-bench.lock python bench/agent_loop.py --dtype bfloat16 --rounds 2 --tools-field
    python bench/agent_loop.py --arms kvhive --agents 2 --turns 3 --out /tmp/agent_loop.json   # a quick check

Results merge into ``bench/results/agent_loop.json`` by dtype; ``python bench/report.py`` renders them.
``--tools-field`` sends the same history through ``tools`` / ``tool_calls`` / ``tool`` messages
instead of plain chat; vLLM then serves it with its Hermes tool parser (``--enable-auto-tool-choice
--tool-call-parser hermes``) and ``--chat-template bench/smollm2_tools.jinja``, which renders the
definitions, calls and results as kvhive does for a template without tool support (SmolLM2's own
template renders neither ``tools`` nor ``tool_calls``), so both servers see the same prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import agent_trace
from multiturn_vs_vllm import VLLM_SH, wait_up
from run_info import command, machine
from sessions_vs_vllm import chat_stream

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "smollm2-135m"
TEMPLATE = os.path.join(HERE, "smollm2_tools.jinja")
TOOL_PARSING = "--enable-auto-tool-choice --tool-call-parser hermes"
ARMS = ("kvhive", "kvhive_conv", "kvhive_spec", "kvhive_conv_spec", "vllm", "vllm_ngram")
DEFAULT_ARMS = ("kvhive", "kvhive_conv", "kvhive_spec", "kvhive_conv_spec", "vllm")
# Speculative decoding as docs/speculative_decoding.md recommends it (kvhive's own method), and
# vLLM's usual n-gram setting for its own arm.
KVHIVE_SPEC = {"method": "history", "num_speculative_tokens": 12, "prompt_lookup_min": 2, "prompt_lookup_max": 8}
VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
TARGET = 0.6


def stream_chat(port: int, body: dict) -> dict:
    """POST one streamed chat completion (``sessions_vs_vllm.chat_stream``): TTFT, latency, token counts."""
    start = time.perf_counter()
    reply = chat_stream(port, "/v1/chat/completions", body, {})
    latency = time.perf_counter() - start
    usage = reply.usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": reply.ttft_s, "latency_s": latency, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "text": reply.text}


def request_body(agent: int, turn: int, salt: str, args: argparse.Namespace, conversation: bool) -> dict:
    """Turn ``turn`` of ``agent``'s trace as a chat request."""
    body = {"model": MODEL, "messages": agent_trace.messages(agent, turn, salt, args.tools_field),
            "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.tools_field:
        body["tools"] = agent_trace.tool_definitions()
    if conversation:
        body["conversation_id"] = f"agent{agent}-{salt}"
        body["end_conversation"] = turn == args.turns
    return body


def run_trace(port: int, args: argparse.Namespace, conversation: bool) -> dict:
    """The whole trace against one server, agents in parallel threads; rows per request."""
    salt = f"{random.randrange(10**7, 10**8)}"
    return {"salt": salt, **run_agents(args.agents, args.turns, lambda a, t: stream_chat(
        port, request_body(a, t, salt, args, conversation)))}


def run_agents(agents: int, turns: int, send: Callable[[int, int], dict]) -> dict:
    """Turns 1..``turns`` of each agent in order (``send(agent, turn)`` gives a turn's row), the agents
    in parallel threads: the wall time, the host's load before and after, the rows by agent and turn."""
    rows: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def agent(a: int) -> None:
        try:
            for t in range(1, turns + 1):
                row = send(a, t)
                with lock:
                    rows.append({"agent": a, "turn": t, **row})
        except BaseException as e:  # reported after the join
            errors.append(e)

    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(a,)) for a in range(agents)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return {"wall_s": time.perf_counter() - t0, "load_average_1m": [load_start, os.getloadavg()[0]],
            "rows": sorted(rows, key=lambda r: (r["agent"], r["turn"]))}


def summarize(trace: dict) -> dict:
    """Median TTFT of turn 1 and of turns 2+, cached fractions, per-turn medians. A reply that
    streamed no output (an immediate stop, or a tool parser holding back an unfinished call) has
    no TTFT: it is counted in ``no_output`` and left out of the TTFT figures."""
    rows = trace["rows"]
    timed = [r for r in rows if r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in timed if r["turn"] >= 2]

    def cached(rs: list[dict]) -> float | None:
        prompt = sum(r["prompt_tokens"] or 0 for r in rs)
        return sum(r["cached_tokens"] or 0 for r in rs) / prompt if prompt else None

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    turns = sorted({r["turn"] for r in rows})
    return {"ttft_turn1_s": median([r["ttft_s"] for r in timed if r["turn"] == 1]),
            "ttft_turns2plus_s": median(later),
            "ttft_turns2plus_p90_s": sorted(later)[int(0.9 * len(later))] if later else None,
            "cached_fraction_turns2plus": cached([r for r in rows if r["turn"] >= 2]),
            "cached_fraction_all": cached(rows), "no_output": len(rows) - len(timed),
            "prompt_tokens_by_turn": [median([r["prompt_tokens"] for r in rows if r["turn"] == t]) for t in turns],
            "ttft_by_turn_s": [median([r["ttft_s"] for r in timed if r["turn"] == t]) for t in turns],
            "cached_by_turn": [cached([r for r in rows if r["turn"] == t]) for t in turns],
            "wall_s": trace["wall_s"], "load_average_1m": trace["load_average_1m"]}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def warm_up(port: int) -> None:
    """One untimed request so that no arm's first timed turn pays for set-up."""
    stream_chat(port, {"model": MODEL, "messages": [{"role": "user", "content": "warm up " * 300}],
                       "max_tokens": 4, "temperature": 0, "stream": True})


def serve(cmd: list[str], port: int, log: str, env: dict | None, passes: list[tuple[str, bool]],
          args: argparse.Namespace) -> dict[str, dict]:
    """Start a server, run the named passes of the trace on it, stop it."""
    print("+", shlex.join(cmd), flush=True)
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            print(f"up after {wait_up(port, proc):.0f}s", flush=True)
            warm_up(port)
            out = {}
            for name, conversation in passes:
                out[name] = run_trace(port, args, conversation)
                s = summarize(out[name])
                print(f"{name}: turn 1 {ms(s['ttft_turn1_s'])} ms, turns 2+ {ms(s['ttft_turns2plus_s'])} ms, "
                      f"cached {s['cached_fraction_turns2plus'] or 0:.3f}, no output {s['no_output']}, "
                      f"wall {s['wall_s']:.0f} s", flush=True)
            return out
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
            proc.wait(timeout=120)


def server_jobs(args: argparse.Namespace) -> list[tuple[list[str], dict | None, list[tuple[str, bool]], str]]:
    """The servers the arms need: per server its command, environment, passes (arm, with
    ``conversation_id``) and name."""
    jobs = []
    for name, spec in (("kvhive", None), ("kvhive_spec", args.speculative_config)):
        plain, conv = name, name.replace("kvhive", "kvhive_conv")
        passes = [(a, a == conv) for a in (plain, conv) if a in args.arms]
        if passes:
            cmd = [sys.executable, "-m", "kvhive.cli", "serve", "--port", str(args.port), "--log-level", "warning",
                   "--dtype", args.dtype, *shlex.split(args.kvhive_args), *(["--speculative-config", spec] if spec else [])]
            jobs.append((cmd, None, passes, name))
    for name, spec in (("vllm", None), ("vllm_ngram", args.vllm_speculative_config)):
        if name in args.arms:
            extra = vllm_extra(args, TEMPLATE) + (f" --speculative-config {spec}" if spec else "")
            jobs.append((["bash", VLLM_SH, "serve", args.dtype, str(args.port)],
                         dict(os.environ, VLLM_EXTRA=extra.strip()), [(name, False)], name))
    return jobs


def run_round(index: int, args: argparse.Namespace) -> dict[str, dict]:
    """One round: each server the arms need, started in turn (the order reversed every other
    round), running its passes: prefix caching, then sessions."""
    jobs = server_jobs(args)
    out: dict[str, dict] = {}
    for cmd, env, passes, name in jobs if index % 2 == 0 else jobs[::-1]:
        log = os.path.join(args.log_dir, f"agent_loop_{name}_{args.dtype}_r{index + 1}.log")
        out.update(serve(cmd, args.port, log, env, passes, args))
    return out


def compact(config: dict) -> str:
    """A speculative config as one shell word."""
    return json.dumps(config, separators=(",", ":"))


def vllm_extra(args: argparse.Namespace, template: str) -> str:
    """vLLM's extra flags: with ``--tools-field``, its Hermes tool parser and the template that
    renders tools as kvhive does, then ``--vllm-args``."""
    tools = f"--chat-template {shlex.quote(template)} {TOOL_PARSING} " if args.tools_field else ""
    return f"{tools}{args.vllm_args}".strip()


def paired(rounds: list[dict], arm: str, key: str = "ttft_turns2plus_s") -> list[float]:
    """Each round's arm / vLLM ratio of ``key``."""
    return [r[arm][key] / r["vllm"][key] for r in rounds if arm in r and "vllm" in r]


def same_text(rounds: list[dict], arm: str, other: str = "vllm") -> float | None:
    """Fraction of (round, agent, turn) whose greedy reply on ``arm`` equals ``other``'s."""
    pairs = [(a["text"], b["text"]) for r in rounds if arm in r and other in r
             for a, b in zip(r[arm]["rows"], r[other]["rows"], strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def plain_arm(arm: str) -> str | None:
    """The arm a speculative arm runs without speculation."""
    return {"kvhive_spec": "kvhive", "kvhive_conv_spec": "kvhive_conv", "vllm_ngram": "vllm"}.get(arm)


def table(runs: dict[str, dict]) -> list[str]:
    """Markdown: per dtype and arm, the medians over rounds, and the paired ratio against vLLM."""
    lines = ["| dtype | arm | TTFT turn 1 (ms) | TTFT turns 2-12 (ms) | p90 turns 2-12 (ms) | cached turns 2-12 | "
             "same greedy text as vLLM | same as without speculation | ratio to vLLM per round | median ratio | "
             "target ≤ 0.6x |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for dtype, run in runs.items():
        rounds = [{arm: summarize(trace) for arm, trace in r.items()} for r in run["rounds"]]
        for arm in ARMS:
            got = [r[arm] for r in rounds if arm in r]
            if not got:
                continue
            med = {k: statistics.median(g[k] for g in got) for k in
                   ("ttft_turn1_s", "ttft_turns2plus_s", "ttft_turns2plus_p90_s", "cached_fraction_turns2plus")}
            ratios = paired(rounds, arm) if arm != "vllm" else []
            # The target is kvhive's; a vLLM arm's ratio only shows what its speculation did.
            verdict = ("-" if not ratios or arm.startswith("vllm")
                       else "met" if statistics.median(ratios) <= TARGET else "not met")
            same = same_text(run["rounds"], arm) if arm != "vllm" else None
            base = plain_arm(arm)
            unchanged = same_text(run["rounds"], arm, base) if base else None
            lines.append(f"| {dtype} | {arm} | {med['ttft_turn1_s'] * 1000:,.0f} | "
                         f"{med['ttft_turns2plus_s'] * 1000:,.0f} | {med['ttft_turns2plus_p90_s'] * 1000:,.0f} | "
                         f"{med['cached_fraction_turns2plus']:.3f} | {'-' if same is None else f'{same:.2f}'} | "
                         f"{'-' if unchanged is None else f'{unchanged:.2f}'} | "
                         f"{', '.join(f'{x:.2f}x' for x in ratios) or '-'} | "
                         f"{f'{statistics.median(ratios):.2f}x' if ratios else '-'} | {verdict} |")
    return lines


def round_table(runs: dict[str, dict]) -> list[str]:
    """Markdown: every pass of every round, with the host's load while it ran."""
    lines = ["| dtype | round | arm | TTFT turns 2-12 (ms) | ratio to vLLM | wall (s) | load average, start to end |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for dtype, run in runs.items():
        for i, r in enumerate(run["rounds"], 1):
            s = {arm: summarize(trace) for arm, trace in r.items()}
            for arm in (a for a in ARMS if a in s):
                ratio = (f"{s[arm]['ttft_turns2plus_s'] / s['vllm']['ttft_turns2plus_s']:.2f}x"
                         if arm != "vllm" and "vllm" in s else "-")
                load = s[arm]["load_average_1m"]
                lines.append(f"| {dtype} | {i} | {arm} | {ms(s[arm]['ttft_turns2plus_s'])} | {ratio} | "
                             f"{s[arm]['wall_s']:.0f} | {load[0]:.1f} to {load[1]:.1f} |")
    return lines


def turn_table(runs: dict[str, dict]) -> list[str]:
    """Markdown: median TTFT per turn (ms) of each arm, first round, per dtype."""
    lines = []
    for dtype, run in runs.items():
        first = {arm: summarize(trace) for arm, trace in run["rounds"][0].items()}
        arms = [a for a in ARMS if a in first]
        turns = len(first[arms[0]]["ttft_by_turn_s"])
        lines += [f"Median TTFT per turn (ms), {dtype}, round 1, over the {run['config']['agents']} agents:", "",
                  "| turn | prompt tokens | " + " | ".join(arms) + " |", "| ---: | ---: |" + " ---: |" * len(arms)]
        for t in range(turns):
            lines.append(f"| {t + 1} | {first[arms[0]]['prompt_tokens_by_turn'][t]:,.0f} | "
                         + " | ".join(ms(first[a]["ttft_by_turn_s"][t]) for a in arms) + " |")
        lines.append("")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first-round", type=int, default=1,
                    help="number of the first round (who goes first alternates by round number)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"which of {','.join(ARMS)} to run")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tools-field", action="store_true",
                    help="send tools / tool_calls / tool_call_id instead of the plain-chat form")
    ap.add_argument("--kvhive-args", default="--kv-cache-gb 4",
                    help="extra kvhive serve flags (default: the 4 GiB of KV vllm.sh gives vLLM)")
    ap.add_argument("--vllm-args", default="", help="extra vLLM server flags (VLLM_EXTRA)")
    ap.add_argument("--speculative-config", default=compact(KVHIVE_SPEC),
                    help="the kvhive_spec arms' --speculative-config")
    ap.add_argument("--vllm-speculative-config", default=compact(VLLM_SPEC),
                    help="the vllm_ngram arm's --speculative-config (no spaces: vllm.sh splits VLLM_EXTRA on them)")
    ap.add_argument("--port", type=int, default=8171)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "agent_loop.json"))
    ap.add_argument("--log-dir", default=os.path.join(HERE, "out"), help="the servers' logs")
    ap.add_argument("--notes", default="", help="a note stored with this dtype's runs")
    ap.add_argument("--append", action="store_true",
                    help="add these rounds to the dtype's rounds already in --out (same trace settings)")
    args = ap.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := set(args.arms) - set(ARMS):
        ap.error(f"unknown arms: {sorted(unknown)}")
    if " " in args.vllm_speculative_config:
        ap.error("--vllm-speculative-config: no spaces (vllm.sh splits VLLM_EXTRA on them)")
    os.makedirs(args.log_dir, exist_ok=True)
    first = args.first_round - 1
    rounds = [run_round(first + i, args) for i in range(args.rounds)]
    config = {k: getattr(args, k) for k in ("agents", "turns", "max_tokens", "tools_field", "kvhive_args",
                                            "vllm_args", "arms")}
    if any(a.endswith("_spec") for a in args.arms):
        config["speculative_config"] = args.speculative_config
    if "vllm_ngram" in args.arms:
        config["vllm_speculative_config"] = args.vllm_speculative_config
    config["vllm_extra"] = vllm_extra(args, "bench/smollm2_tools.jinja")
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "runs": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    result.update(machine=machine(), date=time.strftime("%Y-%m-%d"))
    old = result["runs"].get(args.dtype)
    if args.append and old is not None:
        if old["config"] != config:
            raise SystemExit(f"{args.out} holds {args.dtype} rounds of another trace: {old['config']}")
        rounds = old["rounds"] + rounds
    run_command = f"{old['command']} && {command(__file__)}" if args.append and old is not None else command(__file__)
    result["runs"][args.dtype] = {"command": run_command, "config": config, "rounds": rounds,
                                  **({"notes": args.notes} if args.notes else {})}
    result["command"] = " && ".join(run["command"] for run in result["runs"].values())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(table(result["runs"]) + [""] + round_table(result["runs"]) + [""] + turn_table(result["runs"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
