"""The ``serve`` options of continuous batching: how many requests run, a step's token budget, how
long prefills are chunked beside short ones, and the admission order; and the SchedulerConfig
they make."""

from __future__ import annotations

import argparse

from kvhive.core.flag_values import auto_or_count
from kvhive.core.scheduler_config import (
    CPU_LONG_PREFILL_TOKENS,
    SCHEDULING_POLICIES,
    STEP_BUDGETS,
    SchedulerConfig,
)


def _token_count_or_auto(value: str) -> int | None:
    """``--long-prefill-token-threshold``: ``auto`` (None) or a token count >= 0."""
    return auto_or_count(value, "token", 0)


def add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    """Add the batching and admission options to the argument group ``g``."""
    g.add_argument("--max-num-seqs", type=int, default=8, metavar="N", help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="token budget of one step; longer prompts are prefilled in chunks")
    g.add_argument("--step-budget", choices=STEP_BUDGETS, default="compute",
                   help="how a token counts against --max-num-batched-tokens: compute, 1 + p / C at position "
                        "p, C being the context at which a token's attention costs as much as its "
                        "projections (3,072 for the default model), so a step of long-context prefill "
                        "chunks takes about as long as one of short prompts and requests arriving together "
                        "are not all held for one long step; tokens, one each (as vLLM counts)")
    g.add_argument("--long-prefill-token-threshold", type=_token_count_or_auto, default=None,
                   metavar="auto|N",
                   help="a prefill with more than N tokens left is long: it gets at most N tokens a step, "
                        "after the short ones, so a request arriving meanwhile waits for one chunk of it "
                        "rather than all of it; 0: off, every prefill as large as the budget allows "
                        f"(default: auto, {CPU_LONG_PREFILL_TOKENS} on CPU, off on CUDA)")
    g.add_argument("--max-long-partial-prefills", type=int, default=1, metavar="N",
                   help="most long prefills that get a chunk in one step; a long prompt waiting for its "
                        "turn lets the short ones behind it go first (default: 1)")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="admission order of waiting requests: fcfs, by arrival (a request's 'priority' "
                        "other than 0 is refused); priority, by the request's 'priority' (lower first), "
                        "then arrival, and preemption takes the latest of the lowest priority first (vLLM's)")


def build_scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The SchedulerConfig of parsed ``serve`` arguments; ValueError naming the flag when invalid."""
    threshold = args.long_prefill_token_threshold
    if threshold is None:
        threshold = min(CPU_LONG_PREFILL_TOKENS, args.max_num_batched_tokens) if args.device == "cpu" else 0
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, scheduling_policy=args.scheduling_policy,
                           max_num_batched_tokens=args.max_num_batched_tokens, step_budget=args.step_budget,
                           max_model_len=1 << 30 if args.max_model_len is None else args.max_model_len,
                           max_model_len_given=args.max_model_len is not None,
                           long_prefill_token_threshold=threshold,
                           max_long_partial_prefills=args.max_long_partial_prefills)
