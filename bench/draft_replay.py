#!/usr/bin/env python3
"""How much of speculative decoding's possible gain the draft sizing takes, replayed step by step.

    python bench/draft_replay.py               # writes bench/results/draft_replay.json (~5 minutes)
    python bench/draft_replay.py --smoke       # one workload, 16 tokens, no result file

1. **Decode in process.** The four workloads of ``bench/quoting_prompts.py`` run on the engine
   (default model, float32) the way ``bench/speculative_workloads.py`` runs them over HTTP: per
   workload each variant's prompt once with one output token (the prefix cache and the history
   store see it), then variants 0-3 one after another (c1, each its own request) and variants 0-7
   at once (c8), ``--max-tokens`` greedy with ``ignore_eos``, each concurrency its own tenant. Once
   plain and once with kvhive's recommended speculative config; the speculative outputs must equal
   the plain ones. Every step of decode rows is logged: its requests, its rows, its seconds.
2. **Step cost.** From those steps: a line over the draft rows of one-request steps, and a plane
   (requests, draft rows) over the steps of more; the replay's clock.
3. **Replay.** The same runs again without the model: the server's own ``DraftProposer``,
   ``size_drafts`` and ``Probes`` draft and size step by step, the plain outputs say which draft
   tokens the target model accepts, and the fitted cost times each step (and teaches the sizing's
   ``StepCost``, as the engine's steps do). Three policies on the same drafts:
   ``sized`` (what the server does), ``all`` (every proposed draft verified whole) and ``oracle``
   (each draft cut to exactly the tokens the model then accepts: no draft row ever wasted, an
   upper bound for any sizing of these drafts). The figure is plain time over drafted time, c1 the
   median request and c8 the batch of eight, as the HTTP benchmark reads them.

The replay drafts what the server drafts (the same classes on the same tokens); where the sizing
cuts nothing (c1) its draft counters are the HTTP benchmark's. What it cannot show is a drafter
that proposes other tokens: ``oracle`` bounds the sizing of these drafts, not drafting itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import quoting_prompts
import torch
from run_info import command, machine, save_record

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.core.tokenizer import Tokenizer
from kvhive.core.tool_definitions import chat_template_input
from kvhive.engine.llm_engine import LLMEngine
from kvhive.engine.speculative.draft_proposals import DraftProposer
from kvhive.engine.speculative.step_cost import Probes, StepCost, size_drafts
from kvhive.model import quant_rows
from kvhive.model.loader import load_model
from kvhive.request import Request, SamplingParams
from kvhive.server.chat import template_messages
from kvhive.server.chat_protocol import ChatMessage

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ("doc_qa", "code_edit", "agent_summary", "open_chat")
C1_REQUESTS, C8 = 4, 8
SPEC = {"method": "history", "num_speculative_tokens": 12, "prompt_lookup_min": 2, "prompt_lookup_max": 8}
POLICIES = ("sized", "all", "oracle")


def prompt_ids(tok: Tokenizer, workload: str, variant: int) -> list[int]:
    """A variant's prompt as the server renders the chat request (the agent turn's tool call and result too)."""
    messages = [ChatMessage.model_validate(m) for m in quoting_prompts.messages(workload, variant)]
    rendered, variables = chat_template_input(tok.chat_template, template_messages(messages), [], "messages")
    return tok.encode_chat(rendered, True, False, **variables)


def runs(workload: str) -> list[tuple[str, list[int]]]:
    """(tenant, variants) of the measured runs of a workload, in the HTTP benchmark's order."""
    return [(f"{workload}-c1", [v]) for v in range(C1_REQUESTS)] + [(f"{workload}-c8", list(range(C8)))]


def warm_ups(workload: str) -> list[tuple[str, int]]:
    """(tenant, variant) of each prompt sent once with one output token before the measured runs."""
    return [(f"{workload}-c1", v) for v in range(C1_REQUESTS)] + [(f"{workload}-c8", v) for v in range(C8)]


class Decoder:
    """One engine (plain or speculative) and the steps of decode rows it ran."""

    def __init__(self, loaded, tok: Tokenizer, spec: SpeculativeConfig | None) -> None:
        config = EngineConfig(model_path=default_model_path(), speculative=spec,
                              cache=CacheConfig(num_blocks=2048, enable_prefix_caching=True),
                              scheduler=SchedulerConfig(max_model_len=4096))
        self.engine = LLMEngine(config, loaded=loaded, tokenizer=tok)
        self.tok = tok
        self.steps: list[tuple[int, int, float]] = []      # (requests, rows, seconds)
        self._plan = None
        execute = self.engine.runner.execute

        def keep_plan(plan):
            self._plan = plan
            return execute(plan)
        self.engine.runner.execute = keep_plan

    def run(self, workload: str, tenant: str, variants: list[int], max_tokens: int,
            log: bool) -> tuple[dict[int, list[int]], float]:
        """Decode ``variants`` at once: their outputs and the decode rate (c1: the request's; more:
        all decode tokens over the time from the first first token to the last token)."""
        ids = {f"{tenant}/{v}/{max_tokens}": v for v in variants}
        for rid, v in ids.items():
            self.engine.add_request(rid, prompt_ids(self.tok, workload, v), SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True), cache_salt=tenant)
        outs: dict[int, list[int]] = {v: [] for v in variants}
        first = last = None
        while self.engine.has_unfinished():
            self._plan = None
            started = time.perf_counter()
            produced = self.engine.step()
            now = time.perf_counter()
            plan = self._plan
            if log and plan is not None and plan.decode_rows_only:
                self.steps.append((len(plan.seqs), plan.num_tokens, now - started))
            for out in produced:
                if out.new_token_ids:
                    first = now if first is None else first
                    last = now
                    outs[ids[out.request_id]].extend(out.new_token_ids)
        tokens = sum(len(o) for o in outs.values())
        return outs, (tokens - len(variants)) / (last - first) if last and last > first else 0.0


def decode_all(decoder: Decoder, workloads: tuple[str, ...], max_tokens: int) -> dict:
    """Every workload's warm-ups, then its c1 and c8 runs: outputs and decode rates."""
    result = {}
    for wl in workloads:
        for tenant, v in warm_ups(wl):
            decoder.run(wl, tenant, [v], 1, log=False)
        rates, outputs = {"c1": [], "c8": []}, {}
        for tenant, variants in runs(wl):
            outs, rate = decoder.run(wl, tenant, variants, max_tokens, log=True)
            rates["c1" if len(variants) == 1 else "c8"].append(rate)
            outputs.update({f"{tenant}/{v}": o for v, o in outs.items()})
        result[wl] = {"c1": statistics.median(rates["c1"]), "c8": rates["c8"][0], "outputs": outputs}
        print(f"  {wl}: c1 {result[wl]['c1']:.1f} tok/s, c8 {result[wl]['c8']:.1f} tok/s", flush=True)
    return result


def fit_cost(steps: list[tuple[int, int, float]]) -> dict:
    """Least squares: one-request steps ``a + c * draft rows``; others ``a + b * requests + c * draft rows``."""
    one = np.array([(1.0, rows - 1, s) for n, rows, s in steps if n == 1])
    many = np.array([(1.0, n, rows - n, s) for n, rows, s in steps if n > 1])
    line = np.linalg.lstsq(one[:, :2], one[:, 2], rcond=None)[0]
    plane = np.linalg.lstsq(many[:, :3], many[:, 3], rcond=None)[0]
    return {"one_request": {"base_ms": line[0] * 1e3, "draft_row_ms": line[1] * 1e3, "steps": len(one)},
            "requests": {"base_ms": plane[0] * 1e3, "request_ms": plane[1] * 1e3, "draft_row_ms": plane[2] * 1e3,
                         "steps": len(many)}}


def clock(cost: dict) -> Callable[[int, int], float]:
    """Seconds of a step of ``requests`` requests and ``rows`` rows under the fitted ``cost``."""
    one, many = cost["one_request"], cost["requests"]

    def seconds(requests: int, rows: int) -> float:
        if requests == 1:
            return (one["base_ms"] + one["draft_row_ms"] * (rows - 1)) / 1e3
        return (many["base_ms"] + many["request_ms"] * requests + many["draft_row_ms"] * (rows - requests)) / 1e3
    return seconds


def accepted(draft: list[int], truth: list[int], pos: int) -> int:
    """How many of ``draft``'s tokens the target model accepts at output position ``pos``."""
    n = 0
    while n < len(draft) and pos + n < len(truth) and draft[n] == truth[pos + n]:
        n += 1
    return n


class Replay:
    """One server's drafting state (proposer, learned step cost, probes) replaying runs under a policy."""

    def __init__(self, policy: str, seconds: Callable[[int, int], float]) -> None:
        self.policy, self.seconds = policy, seconds
        self.proposer, self.cost, self.probes = DraftProposer(SpeculativeConfig(**SPEC)), StepCost(), Probes()

    def kept(self, live: dict, drafts: dict[str, list[int]]) -> dict[str, int]:
        """How many of each request's drafts the step verifies under the policy."""
        if self.policy == "oracle":
            return {rid: accepted(d, live[rid][1], live[rid][0].num_output_tokens) for rid, d in drafts.items()}
        if self.policy == "all" or not drafts:
            return {rid: len(d) for rid, d in drafts.items()}
        kept = size_drafts({rid: self.proposer.chances(rid, len(d)) for rid, d in drafts.items()},
                           len(live), len(live), self.cost)
        for rid in self.probes.pick(kept, {rid: len(d) for rid, d in drafts.items()}, len(live), self.cost):
            kept[rid] += 1
        return kept

    def run(self, requests: list[tuple[Request, list[int]]]) -> dict:
        """Decode ``requests`` (each with its target output) at once, step by step: plain over
        drafted seconds, steps, draft tokens verified and accepted."""
        live = {r.request_id: (r, target) for r, target in requests}
        drafted_s, steps, verified, ok_total = 0.0, 0, 0, 0
        while live:
            drafts = {rid: d for rid, (r, t) in live.items()
                      if (d := self.proposer.propose(r, len(t) - r.num_output_tokens - 1))}
            kept = self.kept(live, drafts)
            rows = len(live) + sum(kept.values())
            step = self.seconds(len(live), rows)
            drafted_s, steps = drafted_s + step, steps + 1
            self.cost.observe(rows, step)
            for rid, (request, target) in list(live.items()):
                draft = drafts.get(rid, [])[:kept.get(rid, 0)]
                ok = accepted(draft, target, request.num_output_tokens)
                if draft:
                    self.proposer.record(rid, len(draft), ok)
                    self.probes.settle(rid, len(draft), ok)
                    verified, ok_total = verified + len(draft), ok_total + ok
                for token in target[request.num_output_tokens:request.num_output_tokens + ok + 1]:
                    request.append_output_token(token)
                if request.num_output_tokens >= len(target):
                    self.proposer.finish(request)
                    self.probes.forget(rid)
                    del live[rid]
        # Plain: one token a step; a batch shrinks as its shortest outputs end.
        plain_s, alive, done = 0.0, len(requests), 1
        for n in sorted(len(target) for _, target in requests):
            plain_s += (n - done) * self.seconds(alive, alive)
            done, alive = n, alive - 1
        return {"ratio": plain_s / drafted_s, "steps": steps, "draft_tokens": verified, "accepted": ok_total}


def replay(workloads: tuple[str, ...], prompts: Callable[[str, int], list[int]], truth: dict, policy: str,
           seconds: Callable[[int, int], float]) -> dict:
    """Every run of every workload on one server's drafting state, under ``policy``: per workload
    and concurrency, plain over drafted time (c1: the median request), the draft counters and the
    steps of the run read."""
    server = Replay(policy, seconds)
    out = {}
    for wl in workloads:
        outputs = truth[wl]["outputs"]
        for tenant, v in warm_ups(wl):              # a prompt and one token each
            request = Request(f"w{tenant}/{v}", prompts(wl, v), SamplingParams(max_tokens=1), cache_salt=tenant)
            request.append_output_token(outputs[f"{tenant}/{v}"][0])
            server.proposer.finish(request)
        stats = {"c1": [], "c8": []}
        for tenant, variants in runs(wl):
            requests = []
            for v in variants:
                target = outputs[f"{tenant}/{v}"]
                request = Request(f"{tenant}/{v}", prompts(wl, v), SamplingParams(max_tokens=len(target)),
                                  cache_salt=tenant)
                request.append_output_token(target[0])
                requests.append((request, target))
            stats["c1" if len(variants) == 1 else "c8"].append(server.run(requests))
        out[wl] = {}
        for conc, rows in stats.items():
            ordered = sorted(rows, key=lambda r: r["ratio"])
            out[wl][conc] = {"ratio": statistics.median(r["ratio"] for r in rows),
                             "draft_tokens": sum(r["draft_tokens"] for r in rows),
                             "accepted": sum(r["accepted"] for r in rows),
                             "steps_median_run": ordered[(len(rows) - 1) // 2]["steps"]}
    return out


def render(name: str, record: dict) -> list[str]:
    """The fitted step cost, then per workload and concurrency: measured, replayed per policy."""
    c = record["step_cost"]
    lines = [f"Step cost fitted on {c['requests']['steps'] + c['one_request']['steps']} decode steps: one request "
             f"{c['one_request']['base_ms']:.1f} ms + {c['one_request']['draft_row_ms']:.2f} ms a draft row; more "
             f"requests {c['requests']['base_ms']:.1f} ms + {c['requests']['request_ms']:.2f} ms a request + "
             f"{c['requests']['draft_row_ms']:.2f} ms a draft row. {record['max_tokens']} tokens a request.", "",
             "| workload | conc | measured in process | replay: sized | all drafts | oracle sizing | "
             "draft tokens (sized / oracle) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for wl, m in record["measured"].items():
        for conc in ("c1", "c8"):
            r = {p: record["replay"][p][wl][conc] for p in POLICIES}
            lines.append(f"| {wl} | {conc} | {m[conc]:.2f}x | {r['sized']['ratio']:.2f}x | {r['all']['ratio']:.2f}x | "
                         f"{r['oracle']['ratio']:.2f}x | {r['sized']['draft_tokens']} / {r['oracle']['draft_tokens']} |")
    return [*lines, "", f"Speculative outputs equal to plain: {record['outputs_equal']}.", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--smoke", action="store_true", help="code edit only, 16 tokens, print only")
    ap.add_argument("--decoded", help="a JSON file of step 1's outputs, rates and steps: read if it exists "
                    "(the replay alone, seconds), else written")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "draft_replay.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    workloads = ("code_edit",) if args.smoke else WORKLOADS
    max_tokens = 16 if args.smoke else args.max_tokens
    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32"), Tokenizer.from_model_path(path)
    quant_rows.calibrate(loaded.model)             # as the server does: its GGUF-block row limit
    if args.decoded and os.path.exists(args.decoded):
        with open(args.decoded) as f:
            decoded = json.load(f)
    else:
        decoded = {}
        for label, spec in (("plain", None), ("spec", SpeculativeConfig(**SPEC))):
            print(label, flush=True)
            decoder = Decoder(loaded, tok, spec)
            decoded[label] = (decode_all(decoder, workloads, max_tokens), decoder.steps)
            decoder.engine.close()
        if args.decoded:
            with open(args.decoded, "w") as f:
                json.dump(decoded, f)
    plain, spec = decoded["plain"][0], decoded["spec"][0]
    equal = sum(plain[wl]["outputs"][k] == spec[wl]["outputs"][k] for wl in workloads for k in plain[wl]["outputs"])
    total = sum(len(plain[wl]["outputs"]) for wl in workloads)
    cost = fit_cost(decoded["plain"][1] + decoded["spec"][1])
    prompts = functools.partial(prompt_ids, tok)
    record = {"machine": machine(), "command": command(__file__), "date": time.strftime("%Y-%m-%d"),
              "threads": args.threads, "max_tokens": max_tokens, "spec": SPEC, "step_cost": cost,
              "outputs_equal": f"{equal} of {total}",
              "measured": {wl: {c: spec[wl][c] / plain[wl][c] for c in ("c1", "c8")} for wl in workloads},
              "replay": {p: replay(workloads, prompts, plain, p, clock(cost)) for p in POLICIES}}
    if args.smoke:
        print("\n".join(render("smoke", record)))
        return
    save_record(args.out, record, render)


if __name__ == "__main__":
    main()
