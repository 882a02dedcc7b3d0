"""A few forward passes before a server takes its first request.

The first steps a process runs pay costs that later steps do not: the first touch of buffers the
allocator hands out, the OpenMP team's start, the oneDNN primitives and kernel work areas made for
the first shapes they see, lazily built Python state. Measured on the default model (2-core EPYC,
float32): the first turn of a session after a restart from the disk tier took 0.38-0.43 s where the
next turns took 0.14 s; after one unrelated 40-token request the first turn took 0.15 s. So a
server runs ``warm_up`` once, while it starts: a prefill chunk, then a step with a decode row and a
chunk over a cached prefix (the shapes a conversation's turns take), sampled greedily.

It writes into pool blocks that nothing holds yet (a freshly built engine: every block free and
without a hash), so no request can ever read what it leaves there, and it touches neither the
scheduler, the prefix cache, the tiers nor the KV events.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.request import SamplingParams

if TYPE_CHECKING:
    from kvhive.engine.runner import ModelRunner

PROMPT_TOKENS = 48          # the first chunk; then one decode row beside a chunk of EXTEND_TOKENS
EXTEND_TOKENS = 24
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
_IDS = ("kvhive-warm-up-a", "kvhive-warm-up-b")


def warm_up(runner: ModelRunner, vocab_size: int) -> bool:
    """Run the warm-up steps on a runner whose pool nothing uses yet; False (nothing run) when the
    pool is too small for them or the model keeps a separate window pool."""
    B = runner.block_size
    blocks_a = -(-(PROMPT_TOKENS + 1) // B)
    blocks_b = -(-(PROMPT_TOKENS + EXTEND_TOKENS) // B)
    if runner.window is not None or runner.num_blocks < blocks_a + blocks_b:
        return False
    rng = random.Random(0)
    tokens = [rng.randrange(vocab_size) for _ in range(PROMPT_TOKENS + EXTEND_TOKENS)]
    table_a = list(range(blocks_a))
    table_b = list(range(blocks_a, blocks_a + blocks_b))
    first = runner.execute(StepPlan([
        ScheduledSeq(_IDS[0], tokens[:PROMPT_TOKENS], 0, table_a, True, _GREEDY),
        ScheduledSeq(_IDS[1], tokens[:PROMPT_TOKENS], 0, table_b, False, _GREEDY)]))
    runner.execute(StepPlan([
        ScheduledSeq(_IDS[0], [first.sampled[_IDS[0]]], PROMPT_TOKENS, table_a, True, _GREEDY,
                     num_output_tokens=1),
        ScheduledSeq(_IDS[1], tokens[PROMPT_TOKENS:], PROMPT_TOKENS, table_b, True, _GREEDY)]))
    runner.release(list(_IDS))
    return True
