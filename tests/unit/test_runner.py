"""ModelRunner on a tiny random Llama: paged attention over the block pool equals a dense forward."""

from __future__ import annotations

import pytest
import torch
from support.runners import HAS_KERNEL, Blocks, generate, make_runner, prompt, seq
from support.tiny import dense_greedy, dense_logits, tiny_config, tiny_model

from kvhive.engine.runner import ModelRunner
from kvhive.engine.sampling import argmax_rows, sample_tokens
from kvhive.engine.step import StepPlan
from kvhive.model import attention
from kvhive.model.decode_kernel import CpuDecodeKernel
from kvhive.model.llama import LlamaModel, TorchOps
from kvhive.request import SamplingParams

DECODE_PATHS = pytest.mark.parametrize("native", [True, False], ids=["kernel", "sdpa"])
F32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=0.15, rtol=0.05)


def step_logits(runner: ModelRunner, plan: StepPlan) -> dict[str, torch.Tensor]:
    """Logits of every computed token of every sequence (not only the sampled ones)."""
    inputs = runner.prepare_inputs(plan, all_rows=True)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
        logits = runner.model.compute_logits(hidden)
    out, row = {}, 0
    for s in inputs.seqs:
        out[s.request_id] = logits[row:row + s.num_new_tokens]
        row += s.num_new_tokens
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batch_of_prefills_matches_dense(block_size: int) -> None:
    runner, blocks = make_runner(block_size), Blocks(256, block_size)
    # "d" is a one-token prompt: it takes the decode path (one new token) at position 0.
    prompts = {"a": prompt(5, 1), "b": prompt(17, 2), "c": prompt(33, 3), "d": prompt(1, 4)}
    plan = StepPlan([seq(r, p, 0, blocks.grow([], len(p))) for r, p in prompts.items()])
    got = step_logits(runner, plan)
    for rid, p in prompts.items():
        torch.testing.assert_close(got[rid], dense_logits(runner.model, p), **F32_TOL)


@DECODE_PATHS
@pytest.mark.parametrize("pack", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("dtype,tol", [("float32", F32_TOL), ("bfloat16", BF16_TOL)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_prefill_and_decode_step(block_size: int, dtype: str, tol: dict, pack: bool, native: bool) -> None:
    runner = make_runner(block_size, dtype, pack=pack, native=native)
    blocks = Blocks(256, block_size, seed=block_size)
    a, b, c = prompt(20, 4), prompt(9, 5), prompt(13, 6)
    ta, tb, tc = blocks.grow([], 21), blocks.grow([], 10), blocks.grow([], 13)
    step_logits(runner, StepPlan([seq("a", a, 0, ta), seq("b", b, 0, tb)]))
    # Step 2: two decodes (context 21 and 10, so the padded batch is ragged) and a new prefill.
    got = step_logits(runner, StepPlan([seq("c", c, 0, tc), seq("a", [7], 20, ta), seq("b", [8], 9, tb)]))
    torch.testing.assert_close(got["a"][0], dense_logits(runner.model, a + [7])[-1], **tol)
    torch.testing.assert_close(got["b"][0], dense_logits(runner.model, b + [8])[-1], **tol)
    torch.testing.assert_close(got["c"], dense_logits(runner.model, c), **tol)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_on_cached_prefix_reads_the_pool(block_size: int) -> None:
    runner, blocks = make_runner(block_size), Blocks(256, block_size, seed=7)
    shared = prompt(2 * 16, 8)              # a whole number of blocks for every block size
    ta = blocks.grow([], len(shared) + 3)
    step_logits(runner, StepPlan([seq("a", shared + [5, 6, 7], 0, ta)]))
    # b shares a's prefix blocks and computes only its own suffix, starting at position 32.
    suffix = prompt(11, 9)
    tb = blocks.grow(ta[:len(shared) // block_size], len(shared) + len(suffix))
    plan = StepPlan([seq("b", suffix, len(shared), tb)])
    got = step_logits(runner, plan)["b"]
    torch.testing.assert_close(got, dense_logits(runner.model, shared + suffix)[len(shared):], **F32_TOL)
    # Poisoning the shared blocks changes the result: the prefix really is read from the pool.
    runner.kv_cache[ta[0]] += 1.0
    poisoned = step_logits(runner, plan)["b"]
    assert not torch.allclose(poisoned, got, atol=1e-3)


@DECODE_PATHS
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chunked_prefill_over_several_steps(block_size: int, native: bool) -> None:
    runner, blocks = make_runner(block_size, native=native), Blocks(256, block_size, seed=11)
    p = prompt(45, 12)
    dense = dense_logits(runner.model, p)
    table: list[int] = []
    start = 0
    for chunk in (7, 1, 12, 3, 22):          # unaligned starts, and a 1-token chunk (decode path)
        blocks.grow(table, start + chunk)
        got = step_logits(runner, StepPlan([seq("x", p[start:start + chunk], start, table)]))["x"]
        torch.testing.assert_close(got, dense[start:start + chunk], **F32_TOL)
        start += chunk


@pytest.mark.parametrize("dtype,tol", [("float32", F32_TOL), ("bfloat16", BF16_TOL)])
def test_short_chunk_on_a_cached_prefix_attends_as_decode_rows(dtype: str, tol: dict) -> None:
    runner, blocks = make_runner(16, dtype), Blocks(256, 16, seed=13)
    a, b, c = prompt(20, 14), prompt(37, 15), prompt(9, 16)
    ta, tb, tc = blocks.grow([], 21), blocks.grow([], 41), blocks.grow([], 9)
    step_logits(runner, StepPlan([seq("a", a, 0, ta), seq("b", b[:33], 0, tb)]))
    # One decode, a 4-token chunk over b's 33 cached tokens (crossing a block edge), a fresh prefill.
    plan = StepPlan([seq("a", [7], 20, ta), seq("b", b[33:], 33, tb), seq("c", c, 0, tc)])
    inputs = runner.prepare_inputs(plan, all_rows=True)
    short_rows = runner.decode_kernel is not None
    assert inputs.attn.decode.num_seqs == (5 if short_rows else 1)
    assert inputs.sample_rows == [0, 4, 13]          # a's token, b's last token, c's last token
    got = step_logits(runner, plan)
    torch.testing.assert_close(got["a"][0], dense_logits(runner.model, a + [7])[-1], **tol)
    torch.testing.assert_close(got["b"], dense_logits(runner.model, b)[33:], **tol)
    torch.testing.assert_close(got["c"], dense_logits(runner.model, c), **tol)
    # The same step with every chunk through the prefill path gives the same greedy tokens.
    sampled = runner.execute(plan).sampled
    runner.inputs.decode_rows_max = 1
    assert runner.prepare_inputs(plan, all_rows=True).attn.decode.num_seqs == 1
    assert runner.execute(plan).sampled == sampled


@DECODE_PATHS
@pytest.mark.parametrize("dtype,tol", [("float32", F32_TOL), ("bfloat16", BF16_TOL)])
def test_sampled_rows_alone_match_every_row(native: bool, dtype: str, tol: dict) -> None:
    """The last layer runs attention, projection and MLP for the sampled rows only: their hidden
    states and every row's K/V equal those of a forward over every row."""
    runs = []
    for all_rows in (True, False):
        runner, blocks = make_runner(16, dtype, native=native), Blocks(256, 16, seed=21)
        a, b, c, d, e = prompt(20, 22), prompt(37, 23), prompt(9, 24), prompt(40, 25), prompt(70, 26)
        ta, tb, tc, td, te = (blocks.grow([], n) for n in (21, 41, 9, 40, 70))
        runner.execute(StepPlan([seq("a", a, 0, ta), seq("b", b[:33], 0, tb), seq("e", e[:50], 0, te)]))
        # A decode, a short chunk on a cached prefix, a fresh prompt, a chunk nobody samples, and
        # a long chunk on a cached prefix.
        plan = StepPlan([seq("a", [7], 20, ta), seq("b", b[33:], 33, tb), seq("c", c, 0, tc),
                         seq("d", d[:24], 0, td, sample=False), seq("e", e[50:], 50, te)])
        inputs = runner.prepare_inputs(plan, all_rows=all_rows)
        out = inputs.attn.out_rows
        assert (out is None) == all_rows
        if out is not None:
            assert out.rows.tolist() == inputs.sample_rows
            assert (out.attn is not None) == (runner.prefill_kernel is not None)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
        if all_rows:
            hidden = hidden[inputs.sample_rows]
        assert hidden.shape[0] == len(inputs.sample_rows)
        runs.append((hidden, runner.kv_cache.clone(), runner.execute(plan).sampled))
    torch.testing.assert_close(runs[1][0], runs[0][0], **tol)
    torch.testing.assert_close(runs[1][1], runs[0][1], **tol)
    if dtype == "float32":      # bf16 rows may round differently in a smaller batch: near ties can flip
        assert runs[1][2] == runs[0][2]


def test_a_step_nobody_samples_still_writes_the_last_layer() -> None:
    """A middle chunk of a long prompt: no row is sampled, yet every layer's K/V lands in the pool."""
    pools = []
    for all_rows in (True, False):
        runner, blocks = make_runner(16), Blocks(256, 16, seed=27)
        plan = StepPlan([seq("x", prompt(40, 28), 0, blocks.grow([], 40), sample=False)])
        inputs = runner.prepare_inputs(plan, all_rows=all_rows)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache)
        assert hidden.shape[0] == (40 if all_rows else 0)
        assert runner.execute(plan).sampled == {}
        pools.append(runner.kv_cache.clone())
    assert pools[1][:, -1].abs().sum() > 0
    torch.testing.assert_close(pools[1], pools[0], **F32_TOL)


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "sdpa"])
def test_long_chunks_on_a_cached_prefix_match_dense(blocked: bool, monkeypatch) -> None:
    """Prefill chunks spanning several query blocks of the blocked attention, first and cached-prefix."""
    monkeypatch.setattr(attention, "PREFILL_QUERY_BLOCK", 8)
    monkeypatch.setattr(attention, "PREFILL_BLOCKED_NEW_TOKENS", (2, 10 ** 9) if blocked else (2, 0))
    runner, blocks = make_runner(4), Blocks(256, 4, seed=17)
    p = prompt(90, 18)
    dense = dense_logits(runner.model, p)
    table: list[int] = []
    start = 0
    for chunk in (37, 29, 24):
        blocks.grow(table, start + chunk)
        got = step_logits(runner, StepPlan([seq("x", p[start:start + chunk], start, table)]))["x"]
        torch.testing.assert_close(got, dense[start:start + chunk], **F32_TOL)
        start += chunk


def test_blocks_are_self_contained_across_layers() -> None:
    """Moving a sequence's blocks to other block ids (as an offload + reload does) keeps its result."""
    runner, blocks = make_runner(4), Blocks(256, 4, seed=13)
    p = prompt(18, 14)
    table = blocks.grow([], 19)
    step_logits(runner, StepPlan([seq("a", p, 0, table)]))
    before = step_logits(runner, StepPlan([seq("a", [9], 18, table)]))["a"]
    moved = [blocks.free.pop() for _ in table]
    runner.kv_cache[moved] = runner.kv_cache[table]
    runner.kv_cache[table] = 0.0
    after = step_logits(runner, StepPlan([seq("a", [9], 18, moved)]))["a"]
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    untouched = set(range(256)) - set(moved) - set(table)
    assert runner.kv_cache[sorted(untouched)].abs().sum() == 0


@DECODE_PATHS
@pytest.mark.parametrize("pack", [False, True], ids=["dense", "packed"])
def test_greedy_generation_matches_dense(pack: bool, native: bool) -> None:
    runner = make_runner(4, pack=pack, native=native)
    prompts = {"a": prompt(11, 20), "b": prompt(3, 21), "c": prompt(26, 22)}
    got = generate(runner, prompts, 8, join_at={"b": 2, "c": 5})
    for rid, p in prompts.items():
        assert got[rid] == dense_greedy(runner.model, p, 8), rid


def test_torch_element_wise_ops_match_dense() -> None:
    """The torch composites (CUDA, or no compiler) in place of the fused C++ ops: same greedy tokens."""
    model = tiny_model()
    model.ops = TorchOps()
    runner = make_runner(4, model=model, native=False)
    prompts = {"a": prompt(11, 20), "b": prompt(26, 22)}
    got = generate(runner, prompts, 8, join_at={"b": 3})
    for rid, p in prompts.items():
        assert got[rid] == dense_greedy(model, p, 8), rid


def test_seeded_sampling_is_reproducible_and_released() -> None:
    model = tiny_model()
    p = {"a": prompt(10, 30), "b": prompt(10, 30)}
    hot = SamplingParams(temperature=3.0, seed=1234)
    first = generate(make_runner(4, model=model), p, 12, {}, {"a": hot, "b": hot})
    assert first["a"] == first["b"]             # same seed, same prompt: same tokens in one batch
    again = generate(make_runner(16, model=model), p, 12, {}, {"a": hot, "b": hot}, seed=5)
    assert again["a"] == first["a"]
    other = SamplingParams(temperature=3.0, seed=4321)
    assert generate(make_runner(4, model=model), {"a": p["a"]}, 12, {}, {"a": other})["a"] != first["a"]

    runner = make_runner(4, model=model)
    one = generate(runner, {"a": p["a"]}, 4, {}, {"a": hot})["a"]
    runner.release(["a"])                        # a finished: its generator restarts from the seed
    assert generate(runner, {"a": p["a"]}, 4, {}, {"a": hot})["a"] == one


def test_top_k_one_equals_greedy() -> None:
    model = tiny_model()
    p = {"a": prompt(14, 40)}
    greedy = generate(make_runner(4, model=model), p, 10, {})
    top1 = generate(make_runner(4, model=model), p, 10, {}, {"a": SamplingParams(temperature=1.0, top_k=1)})
    assert top1 == greedy


def test_argmax_rows_is_torchs_argmax_on_either_path() -> None:
    """numpy's argmax (float32 on CPU) and torch's (bfloat16, the fallback any host runs) agree with
    torch.argmax, ties going to the first maximum, -inf rows of a grammar mask included."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(13, 49152, generator=gen)
    logits[1, 7] = logits[1, 40000] = logits[1].max() + 1          # a tie: the first index
    logits[2, :100] = float("-inf")
    logits[3] = float("-inf")
    logits[3, 5] = 0.0
    for rows in (logits, logits[:, ::3], logits.to(torch.bfloat16), logits.to(torch.float64)):
        assert argmax_rows(rows) == rows.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[1] == 7 and argmax_rows(logits.to(torch.bfloat16))[3] == 5
    assert argmax_rows(torch.zeros(0, 8)) == []
    with torch.inference_mode():
        assert argmax_rows(logits[4:6]) == logits[4:6].argmax(dim=-1).tolist()


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = SamplingParams(temperature=5.0, top_k=2)
    assert set(sample_tokens(logits, [top2] * 200, [gen] * 200)) == {0, 1}
    # p(0) = 0.64 at temperature 1: top_p 0.5 keeps token 0 alone, top_p 0.7 keeps tokens 0 and 1.
    narrow, wide = SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_p=0.7)
    assert set(sample_tokens(logits, [narrow] * 200, [gen] * 200)) == {0}
    assert set(sample_tokens(logits, [wide] * 200, [gen] * 200)) == {0, 1}


def test_only_sampled_sequences_get_tokens() -> None:
    runner, blocks = make_runner(4), Blocks(64, 4)
    plan = StepPlan([seq("a", prompt(9, 50), 0, blocks.grow([], 9), sample=False),
                     seq("b", prompt(5, 51), 0, blocks.grow([], 5))])
    assert set(runner.execute(plan).sampled) == {"b"}


def test_block_budget() -> None:
    config = tiny_config()
    per_block = ModelRunner.kv_bytes_per_block(config, 16, "bfloat16")
    assert per_block == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 16 * 2
    assert ModelRunner.num_blocks_for_bytes(config, 16, "bfloat16", 10 * per_block + 1) == 10
    runner = make_runner(16, num_blocks=10)
    assert runner.kv_cache.shape == (10, config.num_layers, 2, 16, config.num_kv_heads, config.head_dim)
    assert runner.kv_cache.nbytes == 10 * ModelRunner.kv_bytes_per_block(config, 16, "float32")


@pytest.mark.skipif(not HAS_KERNEL, reason="no C++ compiler for the decode kernel")
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (64, 6, 2)], ids=["generic", "hd64-g3"])
@pytest.mark.parametrize("dtype,tol", [("float32", F32_TOL), ("bfloat16", BF16_TOL)])
def test_decode_kernel_equals_sdpa_over_long_ragged_contexts(dtype: str, tol: dict, head_dim: int, heads: int,
                                                             kv_heads: int) -> None:
    """Contexts spanning several 256-key kernel chunks, of different lengths, in one decode batch."""
    config = tiny_config(max_position_embeddings=2048, head_dim=head_dim, num_heads=heads, num_kv_heads=kv_heads)
    model = tiny_model(config, dtype=dtype)
    lengths = {"a": 700, "b": 257, "c": 1030, "d": 5}
    results = []
    for native in (True, False):
        runner, blocks = make_runner(16, dtype, num_blocks=200, model=model, native=native), Blocks(200, 16)
        tables = {r: blocks.grow([], n + 1) for r, n in lengths.items()}
        prompts = {r: prompt(n, i) for i, (r, n) in enumerate(lengths.items())}
        step_logits(runner, StepPlan([seq(r, p, 0, tables[r], sample=False) for r, p in prompts.items()]))
        results.append(step_logits(runner, StepPlan([seq(r, [9], n, tables[r]) for r, n in lengths.items()])))
    for r in lengths:
        torch.testing.assert_close(results[0][r], results[1][r], **tol)


@pytest.mark.skipif(not HAS_KERNEL, reason="no C++ compiler for the decode kernel")
@pytest.mark.parametrize("dtype,tol", [("float32", F32_TOL), ("bfloat16", BF16_TOL)])
def test_decode_kernel_over_a_shared_prefix_equals_sdpa(dtype: str, tol: dict) -> None:
    """Sequences whose tables share a cached prefix's blocks (the kernel reads them once for all)."""
    config = tiny_config(max_position_embeddings=2048, head_dim=64, num_heads=6, num_kv_heads=2)
    model = tiny_model(config, dtype=dtype)
    shared = prompt(600, 30)                  # 37 blocks of 16 and a partial one, which is not shared
    own = {"a": 0, "b": 9, "c": 40, "d": 300, "e": 9}
    results = []
    for native in (True, False):
        runner, blocks = make_runner(16, dtype, num_blocks=200, model=model, native=native), Blocks(200, 16)
        first = blocks.grow([], len(shared) + 1)
        step_logits(runner, StepPlan([seq("a", shared, 0, first, sample=False)]))
        cached = len(shared) // 16 * 16
        tables = {r: first if r == "a" else blocks.grow(first[:cached // 16], len(shared) + n + 1) for r, n in own.items()}
        suffixes = {r: shared[cached:] + prompt(n, 31 + i) for i, (r, n) in enumerate(own.items()) if r != "a"}
        step_logits(runner, StepPlan([seq(r, t, cached, tables[r], sample=False) for r, t in suffixes.items()]))
        lengths = {r: len(shared) + n for r, n in own.items()}
        results.append(step_logits(runner, StepPlan([seq(r, [9], n, tables[r]) for r, n in lengths.items()])))
    for r in own:
        torch.testing.assert_close(results[0][r], results[1][r], **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_matches_cpu_dense_reference() -> None:
    model = LlamaModel.random_init(tiny_config(), seed=0, device="cuda")
    runner = ModelRunner(model, model.config, num_blocks=64, block_size=4, device="cuda")
    assert runner.decode_kernel is None
    reference, blocks = tiny_model(seed=0), Blocks(64, 4)
    a, b = prompt(20, 60), prompt(9, 61)
    ta, tb = blocks.grow([], 21), blocks.grow([], 9)
    step_logits(runner, StepPlan([seq("a", a, 0, ta)]))
    got = step_logits(runner, StepPlan([seq("a", [7], 20, ta), seq("b", b, 0, tb)]))
    torch.testing.assert_close(got["a"][0].cpu(), dense_logits(reference, a + [7])[-1], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got["b"].cpu(), dense_logits(reference, b), atol=1e-3, rtol=1e-3)
    hot = SamplingParams(temperature=2.0, top_p=0.9, top_k=50, seed=3)
    assert generate(runner, {"c": prompt(5, 62)}, 4, {}, {"c": hot}) == \
        generate(ModelRunner(model, model.config, 64, 4, device="cuda"), {"c": prompt(5, 62)}, 4, {}, {"c": hot})


def test_without_a_compiler_decode_falls_back_to_sdpa(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("kvhive.model.native.shutil.which", lambda name: None)
    assert CpuDecodeKernel.load(cache_dir=str(tmp_path)) is None
    model = tiny_model()
    runner = ModelRunner(model, model.config, num_blocks=64, block_size=4)
    assert runner.decode_kernel is None
    assert generate(runner, {"a": prompt(6, 70)}, 5, {}) == {"a": dense_greedy(model, prompt(6, 70), 5)}


def test_a_block_table_outside_the_pool_is_refused() -> None:
    """The C++ attention kernels read blocks unchecked: the runner refuses block ids past the pool first."""
    runner = make_runner(16, num_blocks=8)
    with pytest.raises(ValueError, match="outside the KV pool"):
        runner.prepare_inputs(StepPlan([seq("r", prompt(20, 1), 0, [3, 8])]))
