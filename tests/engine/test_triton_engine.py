"""The Triton paged kernels (decode and prefill) inside the runner and the engine, on CPU under Triton's
interpreter: greedy tokens equal the torch path's (a batch of three, a prefix-cache hit whose short tail runs as
decode rows), and the padded static-shape decode (the CUDA graphs' buckets, run eagerly) matches
the dense reference.

The kernel tests run in a process started with ``TRITON_INTERPRET=1`` (``support.triton_interpret``);
without it, ``test_under_the_interpreter`` runs this module again in such a child. Until a Triton
prefill kernel exists, ``--attention-backend triton`` refuses to start (both kernels or none): these
tests let the decode half run alone by asking for the Triton kernels as ``auto`` would on CUDA.
"""

from __future__ import annotations

import pytest
from support.engines import make_engine, run
from support.families import hf_model, path_in, prompt_ids, save_hf
from support.runners import generate, make_runner, prompt
from support.tiny import dense_greedy
from support.triton_interpret import interpreted, interpreter_run_passes

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine import attention_kernels
from kvhive.engine.llm_engine import LLMEngine
from kvhive.model.cuda_graphs import DecodeGraphs
from kvhive.model.loader import load_model
from kvhive.request import SamplingParams

PROMPTS = {"a": prompt(11, 20), "b": prompt(3, 21), "c": prompt(26, 22)}


def test_under_the_interpreter() -> None:
    interpreter_run_passes(__file__, min_passed=3)


@interpreted
def test_engine_greedy_tokens_equal_the_torch_path(tokenizer) -> None:
    shared = prompt(21, 5)
    outputs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(tokenizer, attention_backend=backend)
        runner = engine.runner
        if backend == "triton":
            assert type(runner.decode_kernel).__name__ == "TritonDecodeKernel"
            assert runner.paths()["decode_attention"] == "Triton paged (cpu)"
            assert runner.paths()["prefill_attention"] == "Triton paged (cpu)"
        else:
            assert runner.decode_kernel is None and runner.prefill_kernel is None
        batch = run(engine, PROMPTS)                                      # three requests at once
        # The same 21 tokens again, then 3 more: at least 20 cached, a short tail.
        first = run(engine, {"d": shared})
        hit = run(engine, {"e": shared + prompt(3, 6)})
        assert hit["e"][1] >= 20
        outputs[backend] = (batch, first, hit)
        engine.close()
    assert outputs["triton"] == outputs["torch"]


@interpreted
def test_padded_static_decode_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = make_runner(4, native=False)
    kernel = attention_kernels.choose_attention_kernels(runner.config, runner.dtype, runner.device, True, None,
                                                        False, backend="triton").decode
    assert kernel is not None
    max_blocks = -(-runner.config.max_position_embeddings // runner.block_size)
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache, max_blocks, capture=False,
                                        decode_kernel=kernel)
    calls = []
    original = type(kernel).__call__
    monkeypatch.setattr(type(kernel), "__call__", lambda self, *args: calls.append(1) or original(self, *args))
    got = generate(runner, PROMPTS, 6, join_at={"b": 2, "c": 4})
    for rid, p in PROMPTS.items():
        assert got[rid] == dense_greedy(runner.model, p, 6), rid
    assert runner.decode_graphs.num_steps > 0 and calls


@interpreted
def test_gemma_window_and_soft_cap_rows_run_the_kernel(tokenizer, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiny Gemma 2: a window layer (8 keys, in its own pool) and a global one, both soft-capped.
    pytest.importorskip("transformers")
    path = save_hf(hf_model("gemma2"), path_in(tmp_path, "gemma2"))
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {"a": prompt_ids(40, seed=5), "b": prompt_ids(23, seed=6)}
    rules: list[tuple[float | None, int | None]] = []
    outputs = {}
    # And with n-gram drafts (the random model repeats itself): drafted rows of the window layer
    # read their own windows through the kernel, rejected drafts roll back in both pools.
    ngram = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                              draft_sizing="per_request")
    for name, backend, speculative in (("torch", "torch", None), ("triton", "triton", None),
                                       ("triton drafted", "triton", ngram)):
        config = EngineConfig(model_path="tiny", cache=CacheConfig(block_size=16, num_blocks=24),
                              scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=512),
                              attention_backend=backend, speculative=speculative)
        engine = LLMEngine(config, loaded=load_model(path), tokenizer=tokenizer)
        assert engine.runner.window is not None
        if name == "triton":
            _record_rules(monkeypatch, type(engine.runner.decode_kernel), rules)
        outputs[name] = run(engine, prompts, sampling)
        if speculative is not None:
            assert engine.stats().spec_decode.num_accepted_tokens > 0
        engine.close()
    assert outputs["triton"] == outputs["torch"] == outputs["triton drafted"]
    assert (5.0, 8) in rules and (5.0, None) in rules              # window layer, global layer


def _record_rules(monkeypatch: pytest.MonkeyPatch, kernel_class: type, rules: list) -> None:
    """Each ``kernel_class.attend`` call appends its (softcap, window) to ``rules``."""
    attend = kernel_class.attend

    def recording(self, *args, **kwargs):
        rules.append(args[6:8])
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(kernel_class, "attend", recording)
