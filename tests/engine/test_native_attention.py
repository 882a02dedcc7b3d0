"""The C++ attention kernels give the same greedy tokens as torch's SDPA on the default model (float32
and bfloat16); the ``--no-native-attention`` flag itself: tests/unit/test_native_attention_flag.py."""

from __future__ import annotations

import pytest

from kvhive.config import EngineConfig
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model import cpu
from kvhive.model.decode_kernel import CpuDecodeKernel
from kvhive.model.prefill_kernel import CpuPrefillKernel
from kvhive.request import SamplingParams


def greedy(dtype: str, native: bool, prompts: list[list[int]]) -> tuple[list[list[int]], LLMEngine]:
    # The host's level named: the kernels run even where torch's bf16 prefill would be measured faster.
    engine = LLMEngine(EngineConfig(model_path=default_model_path(), dtype=dtype, native_attention=native,
                                    cpu_isa=cpu.detect().best))
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, sampling)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [tokens[f"r{i}"] for i in range(len(prompts))], engine
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_and_sdpa_give_the_same_greedy_tokens(dtype: str) -> None:
    tokenizer = Tokenizer.from_model_path(default_model_path())
    system = "You are a careful assistant. " + " ".join(f"Fact {i}: the cache keeps block {i}." for i in range(60))
    prompts = [tokenizer.encode_chat([{"role": "system", "content": system},
                                      {"role": "user", "content": q}], True)
               for q in ("Which block does fact 7 keep?", "Summarise the facts in one line.", "Say hi.")]
    native, engine = greedy(dtype, True, prompts)
    prefill = CpuPrefillKernel.load()
    assert (engine.runner.decode_kernel is not None) == (CpuDecodeKernel.load() is not None)
    assert (engine.runner.prefill_kernel is not None) == (prefill is not None and engine.runner.dtype in prefill.dtypes)
    reference, plain = greedy(dtype, False, prompts)
    assert plain.runner.decode_kernel is None and plain.runner.prefill_kernel is None
    assert native == reference
