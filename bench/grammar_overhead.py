#!/usr/bin/env python3
"""What decoding under a JSON schema costs: the default model through ``LLMEngine`` in process (no
HTTP), greedy, 32 completion tokens per request by default.

    python bench/grammar_overhead.py [--rounds 3] [--tokens 32]

Arms, each on a fresh engine over the same loaded model, the schema compiled before the clock starts
as the server compiles it before it queues a request (prefix caching off, so every arm computes
the same prompts): concurrency 1 (4 requests one after another) and 8 (8 at once), without and with
a json_schema; at concurrency 8 also 4 constrained requests sharing their steps with 4 unconstrained
ones, and the all-constrained arm with the masks computed after the forward pass
(``grammar_mask_overlap=False``) to show what the overlap saves. Completion tokens/s is the arm's
tokens over its wall time; a neighbour's rate is each unconstrained request's (tokens - 1) over its
first-to-last-token time. Arms alternate in paired rounds and each figure is the median over rounds.
The masks' own time (computed, waited for by the step thread, and applied to the logits with the
matchers advanced) comes from the runner's counters: the step thread's share of it is the
grammar's cost on the critical path, a figure a busy machine's noise does not blur as it blurs
tokens/s.
Result: bench/results/grammar_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import run_info  # noqa: E402

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvhive.core.model_files import default_model_path  # noqa: E402
from kvhive.core.structured_spec import StructuredSpec  # noqa: E402
from kvhive.core.tokenizer import Tokenizer  # noqa: E402
from kvhive.engine.llm_engine import LLMEngine  # noqa: E402
from kvhive.model.loader import load_model  # noqa: E402
from kvhive.request import SamplingParams  # noqa: E402

RESULT = os.path.join(HERE, "results", "grammar_overhead.json")
PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                     "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
SPEC = StructuredSpec("json_schema", schema=json.dumps(PEOPLE, sort_keys=True, separators=(",", ":")))


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    """n distinct chat prompts asking for a list of people as JSON."""
    return [tok.encode_chat([{"role": "user", "content": f"List {3 + i} people from city number {i} as JSON, "
                                                         "with their name, age, city and hobbies."}])
            for i in range(n)]


def run_arm(loaded, tok, model_path: str, reqs: list[tuple[list[int], bool]], concurrency: int, tokens: int,
            overlap: bool = True) -> dict:
    """Run ``reqs`` (prompt, constrained) at ``concurrency``; tokens/s overall and per request kind."""
    engine = LLMEngine(EngineConfig(model_path=model_path, grammar_mask_overlap=overlap,
                                    cache=CacheConfig(num_blocks=512, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=2048)),
                       loaded=loaded, tokenizer=tok)
    try:
        if any(c for _, c in reqs):
            # As the server does (EngineClient.check_structured) before it queues a request: the
            # spec, and the vocabulary's table for the grammar library, compiled once and cached.
            engine.grammars.compile(SPEC)
        stamps: dict[str, list[float]] = {}
        kinds = {f"r{i}": c for i, (_, c) in enumerate(reqs)}
        pending = list(enumerate(reqs))
        started = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and engine.scheduler.stats().num_running + engine.scheduler.stats().num_waiting < concurrency:
                i, (prompt, constrained) = pending.pop(0)
                engine.add_request(f"r{i}", prompt, SamplingParams(
                    max_tokens=tokens, temperature=0.0, ignore_eos=not constrained,
                    structured=SPEC if constrained else None))
            for out in engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                stamps.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.new_token_ids))
        wall = time.perf_counter() - started
        times = engine.runner.grammar_rows.times
    finally:
        engine.close()
    total = sum(len(s) for s in stamps.values())
    load = os.getloadavg()[0]
    rates = {c: [(len(s) - 1) / (s[-1] - s[0]) for rid, s in stamps.items() if kinds[rid] == c and len(s) > 1]
             for c in (False, True)}
    return {"tokens": total, "wall_s": wall, "tokens_per_s": total / wall, "load_average_1min": load,
            "free_request_tokens_per_s": statistics.fmean(rates[False]) if rates[False] else None,
            "constrained_request_tokens_per_s": statistics.fmean(rates[True]) if rates[True] else None,
            "mask_rows": times.rows, "mask_compute_ms": times.compute_seconds * 1e3,
            "mask_wait_ms": times.wait_seconds * 1e3, "mask_inline_ms": times.inline_seconds * 1e3,
            "mask_apply_ms": times.apply_seconds * 1e3,
            # The grammar's share of the arm's wall time on the step thread (the critical path).
            "grammar_critical_share": (times.wait_seconds + times.inline_seconds + times.apply_seconds) / wall}


ARMS = {
    "c1_free": (1, [False] * 4, True), "c1_json": (1, [True] * 4, True),
    "c8_free": (8, [False] * 8, True), "c8_json": (8, [True] * 8, True),
    "c8_mixed": (8, [True, False] * 4, True), "c8_json_sync": (8, [True] * 8, False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    path = default_model_path()
    tok, loaded = Tokenizer.from_model_path(path), load_model(path, dtype="float32", device="cpu")
    texts = prompts(tok, 8)
    run_arm(loaded, tok, path, [(texts[0], True), (texts[1], False)], 2, 8)     # warm up kernels and the cache
    rounds = []
    for r in range(args.rounds):
        order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        rounds.append({})
        for arm in order:
            concurrency, kinds, overlap = ARMS[arm]
            rounds[-1][arm] = run_arm(loaded, tok, path, list(zip(texts[:len(kinds)], kinds, strict=True)), concurrency, args.tokens, overlap)
            print(r, arm, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rounds[-1][arm].items()}))

    def med(arm: str, key: str) -> float:
        return statistics.median(rd[arm][key] for rd in rounds)

    summary = {arm: {key: med(arm, key) for key in ("tokens_per_s", "mask_compute_ms", "mask_wait_ms", "mask_inline_ms",
                                                    "mask_apply_ms", "grammar_critical_share")}
               for arm in ARMS}
    summary["c8_free"]["free_request_tokens_per_s"] = med("c8_free", "free_request_tokens_per_s")
    summary["c8_mixed"]["free_request_tokens_per_s"] = med("c8_mixed", "free_request_tokens_per_s")
    slowdown = {
        "c1_json_vs_free": 1 - med("c1_json", "tokens_per_s") / med("c1_free", "tokens_per_s"),
        "c8_json_vs_free": 1 - med("c8_json", "tokens_per_s") / med("c8_free", "tokens_per_s"),
        "c8_neighbours_vs_free": 1 - med("c8_mixed", "free_request_tokens_per_s") / med("c8_free", "free_request_tokens_per_s"),
        "c8_json_sync_vs_free": 1 - med("c8_json_sync", "tokens_per_s") / med("c8_free", "tokens_per_s"),
    }
    record = {"machine": run_info.machine(), "command": run_info.command(__file__),
              "date": time.strftime("%Y-%m-%d"), "driver": "LLMEngine in process (no HTTP)",
              "model": "SmolLM2-135M-Instruct Q4_1 GGUF, float32", "tokens_per_request": args.tokens,
              "schema": PEOPLE, "rounds": rounds, "summary": summary, "slowdown": slowdown,
              "targets": {"c8_json_vs_free": 0.10, "c8_neighbours_vs_free": 0.03}}
    print(json.dumps(slowdown, indent=1))
    with open(RESULT, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
