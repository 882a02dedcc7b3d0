#!/usr/bin/env python3
"""TTFT per turn over real HTTP: kvhive sessions vs prefix caching vs no caching, and vLLM for CPU.

Full benchmark (run it on a quiet machine, about 20-30 minutes):

    python bench/sessions_vs_vllm.py --servers sessions,prefix,none --repeats 5
        # writes bench/results/sessions_vs_vllm.json and docs/sessions_vs_vllm.png
    python bench/sessions_vs_vllm.py --servers vllm --repeats 3 --merge
        # vLLM alone afterwards (an idle vLLM beside kvhive slows it), added to the same file

``python bench/report.py`` then turns the result into docs/benchmarks.md. Short end-to-end
check (3 turns of ~100 new tokens, 1 conversation x 2 turns of multiturn.py, results under /tmp):

    python bench/sessions_vs_vllm.py --turns 3 --sentences 5 --mt-convs 1 --mt-turns 2 \\
        --repeats 1 --out /tmp/sessions_vs_vllm.json --plot /tmp/sessions_vs_vllm.png

Four servers, started together and left running side by side, each on its own port:

- ``sessions``: ``kvhive serve``; turn 1 of each conversation is ``POST /v1/context`` (header
  ``x-session-ttl``), later turns send the ``x-session-id`` it answered with
  (``--session-api conversation``: ``conversation_id`` in the chat body instead);
- ``prefix``: ``kvhive serve``, automatic prefix caching only (no session);
- ``none``: ``kvhive serve --no-enable-prefix-caching``;
- ``vllm``: vLLM for CPU with prefix caching (``../shared/peers/vllm.sh serve float32 PORT``;
  it takes about 2 minutes to start).

Two workloads, as ``bench/sessions_ttft.py`` runs them in process: the long chat (one conversation of
``--turns`` turns, ``--sentences`` sentences, about 500 new tokens at 24, per user turn, the
server's own greedy reply fed back as history) and ../shared/bench/multiturn.py's shared system
prompt, user turns and canned replies (``--mt-convs`` x ``--mt-turns``, sequential). Every request
is a streamed chat completion, greedy, ``--max-tokens`` (16) tokens; TTFT is send to the first
non-empty content delta, as multiturn.py measures it. The servers take turns, one conversation
turn each, in an order that rotates every turn, so load from elsewhere on a shared machine hits
all of them alike. Each repeat salts its prompts (an 8-digit number at the start of the first
message) so that no repeat hits the cache an earlier one left; the tables show per-turn medians.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import itertools
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from multiturn_vs_vllm import VLLM_SH, wait_up
from run_info import command, machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.environ.get("KVHIVE_SHARED", os.path.join(ROOT, "..", "shared"))
MODEL = "smollm2-135m"
SERVERS = ("sessions", "prefix", "none", "vllm")


def load_multiturn():
    """../shared/bench/multiturn.py as a module (its text generators)."""
    spec = importlib.util.spec_from_file_location("multiturn", os.path.join(SHARED, "bench", "multiturn.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def long_chat_user_turns(num_turns: int, sentences: int, rng_seed: int = 3) -> list[str]:
    """The long chat's user messages: notes of ``sentences`` sentences each (24: ~500 tokens)."""
    mt, rng = load_multiturn(), random.Random(rng_seed)
    return [f"Part {t + 1} of my notes. " + " ".join(mt._sentence(rng) for _ in range(sentences))
            for t in range(num_turns)]


def interleave(turns: dict[str, Iterator[dict]], first: int = 0) -> dict[str, list[dict]]:
    """Advance each mode's workload one turn at a time, rotating which mode goes first.

    Mode number ``first`` leads the first turn (vary it across repeats: the first request after
    a pause tends to be slower).
    """
    rows: dict[str, list[dict]] = {mode: [] for mode in turns}
    modes = list(turns)
    for k in itertools.count(first):
        order = modes[k % len(modes):] + modes[:k % len(modes)]
        try:
            for mode in order:
                rows[mode].append(next(turns[mode]))
        except StopIteration:
            return rows
    raise AssertionError("unreachable")


@dataclass
class Reply:
    """One streamed chat completion as the client saw it."""

    ttft_s: float | None
    text: str
    usage: dict
    session_id: str | None


def call_text(calls: list[dict]) -> str:
    """A ``delta.tool_calls`` piece as the text the model generated: each call's name and arguments."""
    functions = [call.get("function") or {} for call in calls]
    return "".join((f.get("name") or "") + (f.get("arguments") or "") for f in functions)


def chat_stream(port: int, path: str, body: dict, headers: dict[str, str]) -> Reply:
    """POST a streamed chat completion (or completion); TTFT is send to the first chunk carrying
    generated output (content, a completion's text, or a tool call's piece). A tool call joins the
    text as its function's name and argument pieces, what the model generated: the ids, indexes and
    types each server adds are left out, so two servers' greedy calls compare equal."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    start = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "Accept": "text/event-stream", **headers})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path} on port {port}: HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft, text, usage = None, [], {}
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {"content": choice.get("text")}
            if delta.get("content") or delta.get("tool_calls"):
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(delta.get("content") or call_text(delta["tool_calls"]))
    session_id = resp.getheader("x-session-id")
    conn.close()
    return Reply(ttft, "".join(text), usage, session_id)


class Conversation:
    """One conversation with one server; ``send`` runs a turn in the server's mode."""

    def __init__(self, server: str, port: int, name: str, args: argparse.Namespace) -> None:
        self.server, self.port, self.name, self.args = server, port, name, args
        self.session_id: str | None = None

    def send(self, messages: list[dict]) -> tuple[Reply, dict]:
        """One streamed turn: the reply and the row fields common to both workloads."""
        body = {"model": MODEL, "messages": messages, "max_tokens": self.args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        path, headers = "/v1/chat/completions", {}
        if self.server == "sessions" and self.args.session_api == "conversation":
            body["conversation_id"] = self.name
        elif self.server == "sessions" and self.session_id is None:
            path, headers = "/v1/context", {"x-session-ttl": "3600"}
        elif self.server == "sessions":
            headers = {"x-session-id": self.session_id}
        reply = chat_stream(self.port, path, body, headers)
        if path == "/v1/context":
            if reply.session_id is None:
                raise RuntimeError("POST /v1/context answered without x-session-id")
            self.session_id = reply.session_id
        details = reply.usage.get("prompt_tokens_details") or {}
        return reply, {"ttft_s": reply.ttft_s, "prompt_tokens": reply.usage.get("prompt_tokens"),
                       "cached_tokens": details.get("cached_tokens")}


def long_chat(server: str, port: int, args: argparse.Namespace, salt: str) -> Iterator[dict]:
    """The long chat on one server, one turn per ``next()``."""
    conv = Conversation(server, port, f"long-chat-{salt}", args)
    messages: list[dict] = []
    for t, text in enumerate(long_chat_user_turns(args.turns, args.sentences)):
        messages.append({"role": "user", "content": f"{salt} {text}" if t == 0 else text})
        reply, row = conv.send(messages)
        messages.append({"role": "assistant", "content": reply.text})
        yield {"turn": t + 1, **row}


def multiturn(server: str, port: int, args: argparse.Namespace, salt: str) -> Iterator[dict]:
    """multiturn.py's fixed history on one server, conversations in sequence, one turn per ``next()``."""
    mt = load_multiturn()
    system = f"{salt} " + mt.system_prompt()
    for c in range(args.mt_convs):
        conv = Conversation(server, port, f"mt{c}-{salt}", args)
        messages = [{"role": "system", "content": system}]
        for t in range(args.mt_turns):
            messages.append({"role": "user", "content": mt.user_turn(c, t)})
            _, row = conv.send(messages)
            messages.append({"role": "assistant", "content": mt.canned_reply(c, t)})
            yield {"conv": c, "turn": t + 1, **row}


class Server(NamedTuple):
    """How to start one server, and where it listens."""

    command: list[str]
    port: int


def server_specs(names: list[str], args: argparse.Namespace) -> dict[str, Server]:
    """The command line and port of each named server (consecutive ports from ``--port``)."""
    kvhive = [sys.executable, "-m", "kvhive.cli", "serve", "--log-level", "warning", *shlex.split(args.kvhive_args)]
    specs = {}
    for name, port in zip(names, itertools.count(args.port)):
        if name == "vllm":
            command = ["bash", VLLM_SH, "serve", args.vllm_dtype, str(port)]
        else:
            command = [*kvhive, "--port", str(port)] + (["--no-enable-prefix-caching"] if name == "none" else [])
        specs[name] = Server(command, port)
    return specs


def start_servers(specs: dict[str, Server], log_dir: str) -> dict[str, subprocess.Popen]:
    """Start the servers (each in its own process group) and wait until all answer."""
    procs = {}
    try:
        for name, spec in specs.items():
            print("+", shlex.join(spec.command), flush=True)
            with open(os.path.join(log_dir, f"sessions_vs_vllm_{name}.log"), "w") as log:
                procs[name] = subprocess.Popen(spec.command, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)
        for name, spec in specs.items():
            print(f"{name} up after {wait_up(spec.port, procs[name]):.0f}s", flush=True)
    except BaseException:
        stop_servers(procs)
        raise
    return procs


def stop_servers(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM each server's process group and wait for it."""
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
    for proc in procs.values():
        proc.wait(timeout=120)


def warm_up(port: int) -> None:
    """One untimed request, so that no server's first timed turn pays for set-up."""
    chat_stream(port, "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "warm up " * 300}],
                 "max_tokens": 4, "temperature": 0, "stream": True}, {})


def median_rows(repeats: list[list[dict]]) -> list[dict]:
    """Per-turn medians of TTFT over the repeats (the other fields from the first repeat)."""
    rows = []
    for same_turn in zip(*repeats, strict=True):
        ttfts = [r["ttft_s"] for r in same_turn if r["ttft_s"] is not None]
        rows.append({**same_turn[0], "ttft_s": statistics.median(ttfts) if ttfts else None,
                     "ttft_all_s": [r["ttft_s"] for r in same_turn]})
    return rows


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def paired_ratio(a: dict, b: dict) -> float | None:
    """Median over the repeats of a's TTFT / b's TTFT in the same repeat: the two requests ran one
    right after the other, so the host's load, which moves both, cancels out of each ratio."""
    pairs = [x / y for x, y in zip(a.get("ttft_all_s", [a["ttft_s"]]), b.get("ttft_all_s", [b["ttft_s"]]),
                                   strict=True) if x is not None and y]
    return statistics.median(pairs) if pairs else None


def table(rows: dict[str, list[dict]], names: list[str], keys: list[str]) -> list[str]:
    """Markdown rows: the turn keys, prompt tokens, TTFT per server, ratios, cached tokens per server."""
    ratios = [(a, b) for a, b in (("sessions", "none"), ("sessions", "prefix"), ("sessions", "vllm"),
                                  ("prefix", "vllm")) if a in names and b in names]
    paired = {"sessions", "prefix"} <= set(names)
    head = ([*keys, "prompt tok"] + [f"TTFT {n} (ms)" for n in names] + [f"{a}/{b}" for a, b in ratios]
            + (["sessions/prefix paired"] if paired else []) + [f"cached {n}" for n in names])
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for i, first in enumerate(rows[names[0]]):
        by = {n: rows[n][i] for n in names}
        pr = paired_ratio(by["sessions"], by["prefix"]) if paired else None
        cells = ([str(first[k]) for k in keys] + [str(first["prompt_tokens"])]
                 + [ms(by[n]["ttft_s"]) for n in names]
                 + [ratio(by[a]["ttft_s"], by[b]["ttft_s"]) for a, b in ratios]
                 + (["-" if pr is None else f"{pr:.2f}"] if paired else [])
                 + ["-" if by[n]["cached_tokens"] is None else str(by[n]["cached_tokens"]) for n in names])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(rows: dict[str, list[dict]]) -> list[str]:
    """The sessions TTFT targets on the long chat, each with met / not met. 'Sessions <= prefix'
    is judged on the paired ratio (``paired_ratio``) as well as on the per-turn medians."""
    if not {"sessions", "prefix", "none"} <= rows.keys():
        return []
    s, p, n = (rows[k] for k in ("sessions", "prefix", "none"))
    later = range(1, len(s))
    half = all(s[i]["ttft_s"] <= 0.5 * n[i]["ttft_s"] for i in later)
    not_slower = all(s[i]["ttft_s"] <= p[i]["ttft_s"] for i in range(len(s)))
    paired = [paired_ratio(s[i], p[i]) for i in range(len(s))]
    worst = max((s[i]["ttft_s"] / n[i]["ttft_s"] for i in later), default=0.0)
    return [f"- turns >= 2: sessions TTFT <= 0.5x no caching: {'met' if half else 'not met'} "
            f"(worst {worst:.2f}x)",
            f"- sessions TTFT <= prefix caching TTFT at every turn, per-turn medians: "
            f"{'met' if not_slower else 'not met'}",
            f"- the same, paired (median over repeats of sessions / prefix in the same repeat): "
            f"{'met' if all(r is not None and r <= 1.0 for r in paired) else 'not met'} "
            f"(worst {max((r for r in paired if r is not None), default=0.0):.2f}x)"]


def plot(results: dict, names: list[str], path: str) -> None:
    """TTFT per turn: the long chat and the multiturn.py workload, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        chat = results["long_chat"][name]
        axes[0].plot([r["turn"] for r in chat], [r["ttft_s"] * 1000 for r in chat], marker="o", label=name)
        mt = results["multiturn"][name]
        axes[1].plot(range(1, len(mt) + 1), [r["ttft_s"] * 1000 for r in mt], marker="o", label=name)
    axes[0].set(title=f"long chat over HTTP ({results['config']['turns']} turns)", xlabel="turn", ylabel="TTFT (ms)")
    axes[1].set(title="multiturn.py over HTTP (conversations in sequence)", xlabel="request", ylabel="TTFT (ms)")
    for ax in axes:
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS), help="which of sessions,prefix,none,vllm to run")
    ap.add_argument("--turns", type=int, default=10, help="long chat: turns")
    ap.add_argument("--sentences", type=int, default=24, help="long chat: sentences per user turn (24: ~500 tokens)")
    ap.add_argument("--mt-convs", type=int, default=2, help="multiturn.py: conversations")
    ap.add_argument("--mt-turns", type=int, default=4, help="multiturn.py: turns per conversation")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="salted repeats; tables show per-turn medians")
    ap.add_argument("--session-api", choices=("context", "conversation"), default="context")
    ap.add_argument("--kvhive-args", default="", help="extra arguments for every kvhive serve")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--port", type=int, default=8140, help="first of four consecutive ports")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sessions_vs_vllm.json"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "sessions_vs_vllm.png"))
    ap.add_argument("--merge", action="store_true",
                    help="add these servers to the result already at --out (same workload settings)")
    ap.add_argument("--log-dir", default=os.path.join(HERE, "out"), help="the servers' logs")
    args = ap.parse_args()
    names = [n for n in args.servers.split(",") if n]
    if unknown := set(names) - set(SERVERS):
        ap.error(f"unknown servers: {sorted(unknown)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    os.makedirs(args.log_dir, exist_ok=True)
    specs = server_specs(names, args)
    procs = start_servers(specs, args.log_dir)
    raw: dict[str, dict[str, list[list[dict]]]] = {"long_chat": {n: [] for n in names},
                                                   "multiturn": {n: [] for n in names}}
    salts = [f"{random.randrange(10**7, 10**8)}" for _ in range(args.repeats)]
    try:
        for spec in specs.values():
            warm_up(spec.port)
        for rep, salt in enumerate(salts):
            for workload, turns in (("long_chat", long_chat), ("multiturn", multiturn)):
                rows = interleave({n: turns(n, specs[n].port, args, salt) for n in names}, first=rep)
                for n in names:
                    raw[workload][n].append(rows[n])
                    print(f"repeat {rep + 1} {workload} {n}:", [ms(r["ttft_s"]) for r in rows[n]], flush=True)
    finally:
        stop_servers(procs)
    results = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
               "command": command(__file__),
               "config": {k: getattr(args, k) for k in ("turns", "sentences", "mt_convs", "mt_turns", "max_tokens",
                                                        "repeats", "session_api", "kvhive_args", "vllm_dtype")},
               "servers": {n: shlex.join(spec.command) for n, spec in specs.items()}, "salts": salts,
               **{w: {n: median_rows(raw[w][n]) for n in names} for w in ("long_chat", "multiturn")}}
    if args.merge:
        results = merge(args.out, results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, list(results["servers"]), args.plot)
    print("\n".join(table(results["long_chat"], list(results["servers"]), ["turn"])))
    return 0


def merge(path: str, new: dict) -> dict:
    """The result at ``path`` with ``new``'s servers added; the workload settings must match."""
    with open(path) as f:
        old = json.load(f)
    same = ("turns", "sentences", "mt_convs", "mt_turns", "max_tokens", "session_api")
    if any(old["config"][k] != new["config"][k] for k in same):
        raise SystemExit(f"{path} was run with other workload settings: {old['config']}")
    old["command"] += " && " + new["command"]
    old["servers"].update(new["servers"])
    for workload in ("long_chat", "multiturn"):
        old[workload].update(new[workload])
    return old


if __name__ == "__main__":
    sys.exit(main())
