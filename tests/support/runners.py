"""ModelRunner on the tiny random Llama, driven step by step without a scheduler: shuffled block
tables, step plans, and a minimal continuous-batching loop."""

from __future__ import annotations

import random

from support.tiny import tiny_model

from kvhive.engine.runner import ModelRunner
from kvhive.engine.step import ScheduledSeq, StepPlan
from kvhive.model.decode_kernel import CpuDecodeKernel
from kvhive.model.llama import LlamaModel
from kvhive.model.prefill_kernel import CpuPrefillKernel
from kvhive.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
HAS_KERNEL = CpuDecodeKernel.load() is not None       # False where no C++ compiler is installed
_PREFILL = CpuPrefillKernel.load()                     # None also without AVX-512

class Blocks:
    """Hands out pool blocks in a shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], num_tokens: int) -> list[int]:
        """Extend table in place until it holds num_tokens tokens; return it."""
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table


def make_runner(block_size: int, dtype: str = "float32", num_blocks: int = 256,
                model: LlamaModel | None = None, pack: bool = False, native: bool = True) -> ModelRunner:
    """A runner over the tiny model (or ``model``); checks it took the C++ kernels where they load."""
    model = model or tiny_model(dtype=dtype, pack=pack)
    runner = ModelRunner(model, model.config, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                         native_attention=native)
    assert (runner.decode_kernel is not None) == (native and HAS_KERNEL)
    has_prefill = _PREFILL is not None and runner.dtype in _PREFILL.dtypes
    assert (runner.prefill_kernel is not None) == (native and has_prefill)
    return runner


def seq(rid: str, tokens: list[int], start: int, table: list[int], sample: bool = True,
        sampling: SamplingParams = GREEDY) -> ScheduledSeq:
    """One sequence of a step plan."""
    return ScheduledSeq(rid, list(tokens), start, list(table), sample, sampling)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def generate(runner: ModelRunner, prompts: dict[str, list[int]], num_tokens: int, join_at: dict[str, int],
             sampling: dict[str, SamplingParams] | None = None, seed: int = 0) -> dict[str, list[int]]:
    """A minimal continuous-batching loop: request r joins at step join_at[r], prefills in one chunk."""
    blocks = Blocks(runner.num_blocks, runner.block_size, seed)
    tables: dict[str, list[int]] = {r: [] for r in prompts}
    outputs: dict[str, list[int]] = {r: [] for r in prompts}
    computed = dict.fromkeys(prompts, 0)
    step = 0
    while any(len(o) < num_tokens for o in outputs.values()):
        seqs = []
        for r, p in prompts.items():
            if step < join_at.get(r, 0) or len(outputs[r]) >= num_tokens:
                continue
            tokens = (p + outputs[r])[computed[r]:]
            blocks.grow(tables[r], computed[r] + len(tokens))
            params = (sampling or {}).get(r, GREEDY)
            seqs.append(seq(r, tokens, computed[r], tables[r], sampling=params))
        result = runner.execute(StepPlan(seqs))
        for s in seqs:
            computed[s.request_id] += s.num_new_tokens
            outputs[s.request_id].append(result.sampled[s.request_id])
        step += 1
    return outputs
