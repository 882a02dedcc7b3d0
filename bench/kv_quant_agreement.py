#!/usr/bin/env python3
"""Agreement of an 8-bit KV cache with float32 KV: greedy tokens and their logprobs, in process.

    python bench/kv_quant_agreement.py                     # 200 prompts, default model, f32 and bf16
    python bench/kv_quant_agreement.py --dtypes float32 --out /tmp/agreement.json
    python bench/kv_quant_agreement.py --smoke             # 4 prompts on a tiny random model

Prompts are built deterministically (a fixed seed over a word list) at lengths of 20-400 tokens.
For each model dtype, every prompt generates 32 greedy tokens (EOS ignored) with ``--kv-cache-dtype``
float32 KV (the model's dtype for a bf16 model: the reference), int8 and fp8. Per 8-bit dtype:
the greedy match rate (prompts whose tokens are all identical to the reference's), the fraction
of tokens before the first divergence, and the mean absolute difference of the chosen tokens'
logprobs over the positions where both runs chose the same tokens so far. Writes JSON and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import asdict, dataclass

from run_info import command, machine

from kvhive.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model.llama import LlamaModel
from kvhive.model.loader import LoadedModel, load_model
from kvhive.request import SamplingParams

WORDS = ("the river city morning light paper window garden bridge station winter music story table "
         "market letter mountain road coffee teacher doctor engine cloud forest ocean island kitchen "
         "history science number question answer evening friend village storm harbor lamp clock "
         "because while after before although quickly slowly quietly bright heavy ancient modern "
         "walks reads builds carries remembers explains finds opens closes watches").split()
KV_DTYPES = ("int8", "fp8")


@dataclass(frozen=True)
class Agreement:
    """One (model dtype, 8-bit KV dtype) against the reference KV dtype."""

    dtype: str
    kv_cache_dtype: str
    reference_kv: str
    prompts: int
    greedy_match_rate: float          # prompts whose tokens all equal the reference's
    leading_token_fraction: float     # tokens before the first divergence, over all tokens
    mean_abs_logprob_diff: float      # chosen tokens' logprobs where the prefixes agree
    compared_positions: int


def build_prompts(tokenizer: Tokenizer, count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    """``count`` prompts of ``lengths[0]``..``lengths[1]`` tokens, sentences of seeded random words."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        target = rng.randint(*lengths)
        words = [rng.choice(WORDS) for _ in range(target)]
        text = " ".join(w + ("." if rng.random() < 0.1 else "") for w in words)
        out.append(tokenizer.encode(text)[:target])
    return out


def generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for every prompt (continuous batching, EOS ignored)."""
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    results: dict[str, tuple[list[int], list[float]]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, sampling)
        results[str(i)] = ([], [])
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs = results[out.request_id]
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs or ()]
    return [results[str(i)] for i in range(len(prompts))]


def compare(reference: list[tuple[list[int], list[float]]], ours: list[tuple[list[int], list[float]]]
            ) -> tuple[float, float, float, int]:
    """(match rate, leading-token fraction, mean |logprob difference|, positions compared)."""
    matched = leading = positions = 0
    total_diff = 0.0
    for (ref_tokens, ref_lp), (tokens, lp) in zip(reference, ours, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens, strict=True)) if a != b), len(tokens))
        matched += same == len(tokens)
        leading += same
        total_diff += sum(abs(a - b) for a, b in zip(ref_lp[:same], lp[:same], strict=True))
        positions += same
    tokens_all = sum(len(t) for t, _ in reference)
    return matched / len(reference), leading / tokens_all, total_diff / max(positions, 1), positions


def _engine(loaded: LoadedModel, tokenizer: Tokenizer, dtype: str, kv: str, model_path: str) -> LLMEngine:
    config = EngineConfig(model_path=model_path, dtype=dtype, kv_cache_dtype=kv,
                          cache=CacheConfig(block_size=16, num_blocks=2048, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=1024))
    return LLMEngine(config, loaded=loaded, tokenizer=tokenizer)


def _tiny_model(dtype: str) -> LoadedModel:
    """A 2-layer random Llama over the default tokenizer's vocabulary (the --smoke model)."""
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
    return LoadedModel(cfg, LlamaModel.random_init(cfg, seed=0, dtype=dtype), "kv-agreement-smoke")


def run(args: argparse.Namespace) -> list[Agreement]:
    """Every (model dtype, 8-bit KV dtype) against the model dtype's own float KV."""
    tokenizer = Tokenizer.from_model_path(default_model_path())
    prompts = build_prompts(tokenizer, args.prompts, args.seed, (args.min_len, args.max_len))
    rows = []
    for dtype in args.dtypes:
        loaded = _tiny_model(dtype) if args.smoke else load_model(default_model_path(), dtype=dtype)
        outputs = {}
        for kv in ("auto", *KV_DTYPES):
            engine = _engine(loaded, tokenizer, dtype, kv, "tiny" if args.smoke else default_model_path())
            try:
                outputs[kv] = generate(engine, prompts, args.new_tokens)
            finally:
                engine.close()
        for kv in KV_DTYPES:
            rate, leading, diff, positions = compare(outputs["auto"], outputs[kv])
            rows.append(Agreement(dtype, kv, dtype, len(prompts), rate, leading, diff, positions))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                                 "kv_quant_agreement.json"), help="JSON result file")
    p.add_argument("--smoke", action="store_true", help="4 short prompts, 8 tokens, a tiny random model")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.min_len, args.max_len, args.new_tokens = 4, 20, 40, 8
    rows = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine(), "command": command("bench/kv_quant_agreement.py"), "smoke": args.smoke,
                   "results": [asdict(r) for r in rows]}, f, indent=2)
    print(f"{'dtype':<9} {'kv':<5} {'match':>6} {'leading':>8} {'|dlogprob|':>11} {'positions':>9}")
    for r in rows:
        print(f"{r.dtype:<9} {r.kv_cache_dtype:<5} {r.greedy_match_rate:>6.3f} {r.leading_token_fraction:>8.3f} "
              f"{r.mean_abs_logprob_diff:>11.4f} {r.compared_positions:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
