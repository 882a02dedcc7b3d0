"""The scheduler's limits: how many requests run at once, a step's token budget, how a token counts
against it, how long prefills are chunked beside short ones, and the admission order."""

from __future__ import annotations

from dataclasses import dataclass, replace

STEP_BUDGETS = ("compute", "tokens")
# vLLM's --scheduling-policy: arrival order, or (request priority, arrival), lower first.
SCHEDULING_POLICIES = ("fcfs", "priority")
# --long-prefill-token-threshold when not given: on a CPU a step is compute-bound, so a 512-token
# chunk already keeps the cores busy and a request arriving meanwhile waits for at most that much
# prefill; on CUDA small chunks leave the device idle, so long prefills are not capped there.
CPU_LONG_PREFILL_TOKENS = 512


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    # The user set max_model_len (--max-model-len): past the model's context it is refused, not capped.
    max_model_len_given: bool = False
    # How a token counts against max_num_batched_tokens: "tokens", one each; "compute", 1 + p / C
    # at position p (C: attention_context, set from the model by EngineConfig.resolved).
    step_budget: str = "tokens"
    attention_context: int | None = None
    scheduling_policy: str = "fcfs"
    # A prefill with more tokens left than this is long: a step gives it at most this many, and at
    # most max_long_partial_prefills long prefills get a chunk in one step, so short prompts
    # (prefix hits, chat turns) are admitted beside a long one instead of behind it. 0: off.
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1

    @property
    def by_priority(self) -> bool:
        """Whether requests are admitted by their ``priority`` (lower first), then arrival."""
        return self.scheduling_policy == "priority"

    def __post_init__(self) -> None:
        if self.step_budget not in STEP_BUDGETS:
            raise ValueError(f"--step-budget must be one of {', '.join(STEP_BUDGETS)}, got {self.step_budget!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.attention_context is not None and self.attention_context <= 0:
            raise ValueError(f"attention_context must be positive, got {self.attention_context}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at "
                             f"least --max-num-seqs ({self.max_num_seqs})")
        if self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")
        if not 0 <= self.long_prefill_token_threshold <= self.max_num_batched_tokens:
            raise ValueError(f"--long-prefill-token-threshold must be 0 (off) to --max-num-batched-tokens "
                             f"({self.max_num_batched_tokens}), got {self.long_prefill_token_threshold}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_seqs:
            raise ValueError(f"--max-long-partial-prefills must be 1 to --max-num-seqs ({self.max_num_seqs}), "
                             f"got {self.max_long_partial_prefills}")

    def capped(self, max_position_embeddings: int) -> SchedulerConfig:
        """This config with ``max_model_len`` at most the model's context; ValueError where the user
        asked for more (positions past the context were never trained, as vLLM refuses too)."""
        if self.max_model_len <= max_position_embeddings:
            return self
        if self.max_model_len_given:
            raise ValueError(f"--max-model-len {self.max_model_len} is more than the model's context "
                             f"({max_position_embeddings} tokens); leave it out to use the model's")
        return replace(self, max_model_len=max_position_embeddings)

    def for_model(self, max_position_embeddings: int, attention_balance_context: int) -> SchedulerConfig:
        """This config capped at the model's context and, with ``step_budget`` "compute", with the
        model's attention balance context as ``attention_context``."""
        capped = self.capped(max_position_embeddings)
        if self.step_budget != "compute" or self.attention_context is not None:
            return capped
        return replace(capped, attention_context=attention_balance_context)
