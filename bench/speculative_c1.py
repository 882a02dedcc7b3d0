#!/usr/bin/env python3
"""Decode tokens/s of one request (c1) with and without n-gram speculative decoding, in process.

    python bench/speculative_c1.py                          # k = 5, lookup 2..4, 128 tokens
    python bench/speculative_c1.py --k 8 --max-tokens 256 --threads 4

The default model (float32) answers a prompt that quotes itself (repeat a document) and an open
question, greedy, to max_tokens. Decode speed is (tokens - 1) over the time from the first token
to the last; each case runs --repeat times after one warm-up and the median is printed, with the
tokens per engine step, the drafting counters of all runs (the warm-up included: it sets the
tenant's acceptance prior the later runs start from) and the outputs' equality (speculation must
not change them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model.loader import load_model
from kvhive.request import SamplingParams

DOCUMENT = ("Speculative decoding drafts several tokens and lets the target model verify them in one "
            "forward pass. A decode step on a CPU is bound by reading the weights once, so verifying "
            "five tokens costs about as much as computing one. Drafts that quote the prompt are cheap: "
            "they come from an index of the request's own tokens.")
PROMPTS = {"quoting": f"Repeat this paragraph word for word, twice:\n\n{DOCUMENT}",
           "open": "Write a short story about a lighthouse keeper who finds a message in a bottle."}


def decode(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """One request to the end: its tokens, decode seconds (first token to last) and engine steps."""
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    first = last = 0.0
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.new_token_ids and not tokens:
                first = time.perf_counter()
            tokens += out.new_token_ids
            last = time.perf_counter()
    return tokens, last - first, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32"), Tokenizer.from_model_path(path)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=args.lookup_min,
                             prompt_lookup_max=args.lookup_max)
    print(f"threads {torch.get_num_threads()}, k {args.k}, lookup {args.lookup_min}..{args.lookup_max}, "
          f"{args.max_tokens} tokens")
    for name, text in PROMPTS.items():
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        results = {}
        for label, config in (("plain", None), ("ngram", spec)):
            engine = LLMEngine(EngineConfig(model_path=path, cache=CacheConfig(num_blocks=512, enable_prefix_caching=False),
                                            scheduler=SchedulerConfig(max_model_len=4096), speculative=config),
                               loaded=loaded, tokenizer=tok)
            runs = [decode(engine, prompt, args.max_tokens) for _ in range(args.repeat + 1)][1:]
            tokens, _, steps = runs[0]
            rate = statistics.median((len(t) - 1) / s for t, s, _ in runs)
            results[label] = (tokens, rate)
            counters = engine.stats().spec_decode
            counts = "" if counters is None else (
                f"  (all {args.repeat + 1} runs: {counters.num_drafts} drafted steps, "
                f"{counters.num_draft_tokens} draft tokens, {counters.num_accepted_tokens} accepted)")
            print(f"{name:8s} {label:6s} {rate:7.1f} tok/s  {len(tokens) / steps:4.2f} tokens/step{counts}")
        print(f"{name:8s} speed-up {results['ngram'][1] / results['plain'][1]:.2f}x, same tokens: "
              f"{results['ngram'][0] == results['plain'][0]}")


if __name__ == "__main__":
    main()
