"""A generation request and its sampling parameters (torch-free)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from kvhive.core.retention import RetentionSpec
from kvhive.core.structured_spec import StructuredSpec

# Most top logprobs a request may ask for per token (OpenAI caps chat at 20).
MAX_LOGPROBS = 20
# A temperature or top_p below this samples greedily: dividing logits by a smaller temperature
# overflows float32, and a smaller top_p rounds to 0 in float32 (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Seeds are 64-bit integers, signed or unsigned: [-2**63, 2**64), what torch.Generator.manual_seed
# accepts (a negative seed s seeds as s + 2**64).
MIN_SEED, SEED_END = -2**63, 2**64
# Bounds of the penalties: OpenAI's for presence and frequency; repetition divides a positive logit
# (multiplies a negative one) by at most this, far past where it stops changing which token wins.
MAX_ABS_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
# logit_bias: at most this many tokens (OpenAI's bound), each biased within +-MAX_LOGIT_BIAS.
MAX_LOGIT_BIAS_TOKENS = 300
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; validated once. temperature or top_p below SAMPLING_EPS, or top_k == 1,
    means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: disabled
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Report each sampled token's logprob and this many top alternatives (None: no logprobs).
    logprobs: int | None = None
    # Report each prompt token's logprob (after the first) and this many top alternatives; the
    # request then computes its whole prompt (no prefix-cache hits) and cannot run in a session.
    prompt_logprobs: int | None = None
    # Decode under this constraint's grammar (None: unconstrained); the engine compiles it once per
    # distinct spec and ends the request when the grammar is complete.
    structured: StructuredSpec | None = None
    # vLLM's sampling extras (kvhive.engine.logits_processors applies them before sampling).
    repetition_penalty: float = 1.0     # over prompt and output tokens; 1: none
    presence_penalty: float = 0.0       # OpenAI's, over output tokens; 0: none
    frequency_penalty: float = 0.0
    min_p: float = 0.0                  # drop tokens less likely than min_p x the top one; 0: none
    min_tokens: int = 0                 # EOS and stop_token_ids cannot end the output before this
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, bias added to its logit)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not MIN_SEED <= self.seed < SEED_END:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        self._check_extras()

    def _check_extras(self) -> None:
        """ValueError for a sampling extra outside its bounds (each message names its field)."""
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                             f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {token_id} must be in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}] for a token id >= 0, got {bias}")

    @property
    def uses_token_history(self) -> bool:
        """True when a penalty needs the tokens the request has seen (its prompt and output)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def changes_logits(self) -> bool:
        """True when something changes the logits before sampling (penalties, bias, min_p, min_tokens)."""
        return self.uses_token_history or bool(self.logit_bias) or self.min_p > 0 or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < SAMPLING_EPS or self.top_p < SAMPLING_EPS or self.top_k == 1


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"   # admitted with blocks; its KV is loading from a slow tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request stopped (OpenAI's finish_reason values)."""

    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the context limit
    ABORT = "abort"        # the client went away or the server cancelled it
    ERROR = "error"        # computing the request's row failed; other requests run on


@dataclass
class Request:
    """One sequence being generated. The scheduler and KV manager mutate it; nothing else does."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    # The session (``x-session-id`` / ``conversation_id``) whose blocks this request continues and,
    # when it ends, keeps alive; ``end_session`` frees them instead.
    session_id: str | None = None
    end_session: bool = False
    # How firmly its blocks stay cached once freed (kvhive.core.retention); None: the default priority.
    retention: RetentionSpec | None = None
    # Admission order under ``--scheduling-policy priority`` (vLLM's: lower runs first); 0 otherwise.
    priority: int = 0
    # Disaggregated serving: this request's part in a KV transfer (a KVTransferParams), or None.
    kv_transfer: Any = None
    arrival_time: float = field(default_factory=time.monotonic)
    # When (time.monotonic) the engine first scheduled it; None while it has not run yet.
    scheduled_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V are in the pool (prefix hits included).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first schedule; reported as cached_tokens.
    num_cached_tokens: int = -1
    finish_reason: FinishReason | None = None
    # With prompt_logprobs: prompt positions 0..n-1 whose row's logprob of the next prompt token
    # went out (row i scores token i + 1); all of them once it reaches num_prompt_tokens - 1.
    num_prompt_logprob_rows: int = 0
    # Chained hashes of the full blocks of all_token_ids, extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # With a penalty: how many leading tokens of all_token_ids the runner has been handed (a
    # ScheduledSeq's ``history``); the runner keeps them until the request finishes.
    num_history_tokens_sent: int = 0

    def __post_init__(self) -> None:
        # Prompt followed by generated tokens; appended to, never rebuilt.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Record one generated token."""
        self.all_token_ids.append(token_id)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens (a copy)."""
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Length of prompt + output."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_rows(self) -> bool:
        """True while prompt logprobs are asked for and some are still to come: the prompt is then
        computed from position 0, without prefix-cache hits."""
        return (self.sampling.prompt_logprobs is not None
                and self.num_prompt_logprob_rows < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is RequestStatus.FINISHED
