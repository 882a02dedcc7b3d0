"""The Triton prefill kernel over the paged pool, run on CPU tensors by Triton's interpreter, against
a torch reference (gather the context, masked softmax in float64).

Triton decides when a ``@triton.jit`` function is decorated whether it is interpreted, and that
holds for triton.language's own jit functions (``tl.max``, ``tl.zeros``) too, decorated when
``triton`` is first imported, which importing torch's attention modules (hence kvhive) already
does. So the cases run where ``TRITON_INTERPRET=1`` was set before the process started: a plain
run of this module has one test, ``test_cases_under_the_interpreter``, that runs the module again
in a subprocess with the variable set (where the cases run and that test skips itself), and skips
the cases in its own process. ``TRITON_INTERPRET=1 pytest tests/unit/test_triton_prefill.py`` runs
the cases directly. Skipped whole only when ``triton`` is not importable.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import replace
from types import ModuleType

import pytest
import torch
from support.runners import Blocks, make_runner, prompt, seq
from support.triton_interpret import INTERPRETING, interpreter_run_passes

from kvhive.engine.attention_kernels import AttentionKernels
from kvhive.engine.step import StepPlan
from kvhive.model.attention import (
    AttnMetadata,
    DecodeBatch,
    PrefillSpan,
    decode_mask,
    output_rows,
    paged_attention,
)
from kvhive.model.window_attention import ScoreRule, masked_paged_attention
from kvhive.model.window_kv import window_kv

triton = pytest.importorskip("triton")

MODULE = "kvhive.model.triton_prefill"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def test_cases_under_the_interpreter() -> None:
    """Every case of this module passes in a TRITON_INTERPRET=1 subprocess (where the tests that need
    the plain kernel skip)."""
    interpreter_run_passes(__file__, min_passed=20, timeout_s=600)


@pytest.mark.skipif(INTERPRETING, reason="compiles the GPU kernel, which the interpreter replaces")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
@pytest.mark.parametrize("dtype,head_dim,group,rules", [("bf16", 128, 4, False), ("fp16", 64, 3, True)])
def test_compiles_for_an_h100(dtype: str, head_dim: int, group: int, rules: bool) -> None:
    """The launch's kernel compiles to an sm_90 cubin with no GPU here (what the interpreter cannot
    check: tile shapes tl.dot accepts, types the loops carry), with the default tiles of that head size."""
    compiler = pytest.importorskip("triton.compiler")
    target = pytest.importorskip("triton.backends.compiler").GPUTarget("cuda", 90, 32)
    module = importlib.import_module(MODULE)
    rows, block_n, warps = module.TritonPrefillKernel()._tiles(head_dim)
    group_pad = 1 << (group - 1).bit_length()
    constexprs = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_M=rows // group_pad, BLOCK_N=block_n,
                      HEAD_DIM=head_dim, BLOCK_SIZE=16, HAS_SOFTCAP=rules, HAS_WINDOW=rules, F32_DOT=False,
                      PRECISION="tf32")
    kinds = dict(q_ptr=f"*{dtype}", kv_ptr=f"*{dtype}", out_ptr=f"*{dtype}", table_ptr="*i64", cu_ptr="*i32",
                 start_ptr="*i32", scale_log2="fp32", softcap="fp32")
    fn = module._prefill_varlen_kernel
    signature = {name: "constexpr" if name in constexprs else kinds.get(name, "i32") for name in fn.arg_names}
    compiled = triton.compile(compiler.ASTSource(fn, signature, constexprs), target=target,
                              options=dict(num_warps=warps))
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 228 * 1024


@pytest.fixture(scope="module")
def tp() -> ModuleType:
    """``kvhive.model.triton_prefill``, interpreted (the cases run only where TRITON_INTERPRET=1)."""
    if not INTERPRETING:
        pytest.skip("run by test_cases_under_the_interpreter in a TRITON_INTERPRET=1 subprocess")
    return importlib.import_module(MODULE)


@pytest.fixture(scope="module")
def kernel(tp: ModuleType):
    """Small tiles (16 query rows, 16 keys), so that short chunks span several of each."""
    return tp.TritonPrefillKernel(rows=16, block_n=16)


def make_pool(blocks: int, block_size: int, kv_heads: int, hd: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random two-layer pool [blocks, 2, 2, block_size, kv_heads, hd] (the tests read layer 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, 2, 2, block_size, kv_heads, hd, generator=g).to(dtype)


def make_q(n: int, heads: int, kv_heads: int, hd: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """q [n, heads, hd] as a strided view of fused qkv rows, as the runner passes it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads + 2 * kv_heads, hd, generator=g).to(dtype)[:, :heads]


def table(context: int, block_size: int, blocks: int, seed: int = 2) -> torch.Tensor:
    """Shuffled pool blocks for positions 0..context-1 (int64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(blocks, generator=g)[:-(-context // block_size)]


def reference(q: torch.Tensor, pool: torch.Tensor, layer: int, ids: torch.Tensor, start: int,
              rule: ScoreRule | None = None) -> torch.Tensor:
    """Gather the context, scale, soft-cap, mask (causal, window), softmax in float64 -> [n, heads * hd]."""
    n, heads, hd = q.shape
    ctx = start + n
    k, v = (pool[:, layer, i].index_select(0, ids).flatten(0, 1)[:ctx].double() for i in (0, 1))
    k, v = (t.repeat_interleave(heads // pool.shape[4], dim=1) for t in (k, v))
    rule = rule or ScoreRule(hd ** -0.5)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * rule.scale
    if rule.softcap is not None:
        scores = rule.softcap * torch.tanh(scores / rule.softcap)
    qpos, keys = torch.arange(start, ctx)[:, None], torch.arange(ctx)[None, :]
    seen = keys <= qpos
    if rule.window is not None:
        seen &= keys > qpos - rule.window
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * hd)


def check(kernel, n: int, start: int, block_size: int, heads: int, kv_heads: int, hd: int = 16,
          dtype: torch.dtype = torch.float32, rule: ScoreRule | None = None) -> None:
    """One chunk of n new tokens over start cached ones, kernel against reference."""
    blocks = -(-(start + n) // block_size) + 3
    pool, q = make_pool(blocks, block_size, kv_heads, hd, dtype), make_q(n, heads, kv_heads, hd, dtype)
    ids = table(start + n, block_size, blocks)
    got = kernel(q, pool, 1, ids, start, rule)
    assert got.shape == (n, heads * hd) and got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(q, pool, 1, ids, start, rule), **TOL[dtype])


@pytest.mark.parametrize("n,start,block_size,heads,kv_heads", [
    (37, 0, 16, 2, 2),       # first chunk, several query and key tiles
    (20, 32, 16, 4, 2),      # over a cached prefix of whole blocks
    (19, 21, 8, 8, 2),       # a hit ending mid-block, group 4
    (30, 13, 6, 6, 2),       # blocks of 6 under tiles of 16 keys, group 3 (padded to 4)
    (25, 40, 32, 2, 1),      # blocks larger than a key tile
    (1, 0, 4, 4, 1),         # one-token first chunk
    (1, 29, 4, 4, 2),        # one new token over a prefix ending mid-block
])
def test_chunk_matches_reference(kernel, n: int, start: int, block_size: int, heads: int, kv_heads: int) -> None:
    check(kernel, n, start, block_size, heads, kv_heads)


def test_wide_heads_and_default_tiles(tp: ModuleType) -> None:
    """head_dim 64 with the kernel's own tile sizes (one query tile, one key tile)."""
    check(tp.TritonPrefillKernel(), 9, 14, 16, 4, 2, hd=64)


@pytest.mark.parametrize("rule", [
    ScoreRule(0.25, window=8),                 # window edges inside and across key tiles
    ScoreRule(0.25, window=1),                 # each query sees itself only
    ScoreRule(0.25, window=500),               # wider than the context: plain causal
    ScoreRule(1.0, softcap=2.0),               # scores well past the cap
    ScoreRule(0.5, softcap=3.0, window=13),    # both (Gemma 2's window layers)
])
def test_score_rules(kernel, rule: ScoreRule) -> None:
    check(kernel, 21, 27, 4, 4, 2, rule=rule)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_pools(kernel, dtype: torch.dtype) -> None:
    check(kernel, 18, 23, 8, 4, 1, hd=32, dtype=dtype)


def test_varlen_runs_ragged_chunks_in_one_launch(tp: ModuleType, kernel) -> None:
    """Chunks of 1, 17 and 33 tokens over 50, 0 and 13 cached, each on its own table, in one launch."""
    block_size, kv_heads, heads, hd = 8, 2, 4, 16
    pool = make_pool(40, block_size, kv_heads, hd, torch.float32)
    chunks = [(1, 50), (17, 0), (33, 13)]
    ids = [table(n + start, block_size, 40, seed=i) for i, (n, start) in enumerate(chunks)]
    q = make_q(sum(n for n, _ in chunks), heads, kv_heads, hd, torch.float32)
    batch = tp.varlen_prefill([n for n, _ in chunks], [s for _, s in chunks], ids, block_size, pool.device)
    got = kernel.attend_varlen(q, pool, 1, batch)
    row = 0
    for (n, start), blocks in zip(chunks, ids, strict=True):
        want = reference(q[row:row + n], pool, 1, blocks, start)
        torch.testing.assert_close(got[row:row + n].double(), want, **TOL[torch.float32])
        row += n


def step_meta(kernel, block_size: int, kv_heads: int) -> tuple[AttnMetadata, torch.Tensor]:
    """A step of two decode rows, then chunks of 19 new over 11 cached and 24 new from position 0, with
    ``kernel`` as its prefill kernel (block ids set for every chunk, as the runner sets them);
    returns it with the slot rows' pool blocks in use."""
    blocks = torch.randperm(30, generator=torch.Generator().manual_seed(5))
    dec_tables, a, b = blocks[:6].view(2, 3), blocks[6:10], blocks[10:14]
    context_lens = torch.tensor([9, 20])
    rows_per_block = 2 * 2 * block_size                    # two layers
    slots = [dec_tables[i, (c - 1) // block_size] * rows_per_block + (c - 1) % block_size
             for i, c in enumerate(context_lens.tolist())]
    slots += [a[p // block_size] * rows_per_block + p % block_size for p in range(11, 30)]
    slots += [b[p // block_size] * rows_per_block + p % block_size for p in range(24)]
    base = torch.stack([torch.as_tensor(s) for s in slots])
    decode = DecodeBatch(2, dec_tables, context_lens, decode_mask(context_lens, 3 * block_size), None, None)
    spans = (PrefillSpan(2, 21, 11, a, None), PrefillSpan(21, 45, 0, b, None))
    meta = AttnMetadata(torch.stack([base, base + block_size], 1), decode, spans, prefill_kernel=kernel)
    return meta, blocks


def test_paged_attention_calls_one_launch_per_layer(tp: ModuleType, monkeypatch) -> None:
    """paged_attention sends every chunk of a step to the kernel at once and matches torch's path;
    the launch inputs are built once per step, every layer reusing them."""
    kernel = tp.TritonPrefillKernel(rows=16, block_n=16)
    block_size, kv_heads, heads, hd = 8, 2, 4, 16
    meta, _ = step_meta(kernel, block_size, kv_heads)
    pool = make_pool(30, block_size, kv_heads, hd, torch.float32)
    q, kv_new = make_q(45, heads, kv_heads, hd, torch.float32), torch.randn(45, 2, kv_heads, hd)
    calls, builds = [], []
    original, build = kernel.attend_varlen, tp.varlen_prefill
    monkeypatch.setattr(kernel, "attend_varlen", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(tp, "varlen_prefill", lambda *a, **k: builds.append(1) or build(*a, **k))
    got = [paged_attention(q, kv_new, pool, layer, meta) for layer in (0, 1)]
    want = [paged_attention(q, kv_new, pool, layer, replace(meta, prefill_kernel=None)) for layer in (0, 1)]
    assert calls == [1, 1] and builds == [1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_masked_path_sends_its_rule_to_the_kernel(kernel, monkeypatch) -> None:
    """A soft-capped window layer's chunks run through the kernel in one launch and match the
    gathered masked attention (float32, so both score in float32)."""
    block_size, kv_heads, heads, hd = 8, 2, 4, 16
    meta, _ = step_meta(kernel, block_size, kv_heads)
    pool = make_pool(30, block_size, kv_heads, hd, torch.float32)
    q, kv_new = make_q(45, heads, kv_heads, hd, torch.float32), torch.randn(45, 2, kv_heads, hd)
    rule = ScoreRule(0.5, softcap=3.0, window=7)
    calls = []
    original = kernel.attend_varlen
    monkeypatch.setattr(kernel, "attend_varlen", lambda *a, **k: calls.append(a[-1]) or original(*a, **k))
    got = masked_paged_attention(q, kv_new, pool.clone(), 1, meta, rule)
    want = masked_paged_attention(q, kv_new, pool.clone(), 1, replace(meta, prefill_kernel=None), rule)
    assert calls == [rule]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_restricted_output_rows_read_the_pool(kernel) -> None:
    """``output_rows`` with the kernel set: each chunk becomes one query at its last position (a chunk
    from position 0 included), and its attention equals the full step's last row of that chunk."""
    block_size, kv_heads, heads, hd = 8, 2, 4, 16
    meta, _ = step_meta(kernel, block_size, kv_heads)
    pool = make_pool(30, block_size, kv_heads, hd, torch.float32)
    q, kv_new = make_q(45, heads, kv_heads, hd, torch.float32), torch.randn(45, 2, kv_heads, hd)
    full = paged_attention(q, kv_new, pool, 1, meta)
    rows = [1, 20, 44]
    restricted = output_rows(meta, rows, q.device).attn
    assert restricted is not None and [s.start_pos for s in restricted.prefills] == [29, 23]
    got = paged_attention(q[rows], kv_new, pool, 1, restricted)
    torch.testing.assert_close(got, full[rows], atol=1e-5, rtol=1e-5)


def test_supports_and_refusals(tp: ModuleType, kernel) -> None:
    """What ``supports`` refuses, and the clear errors for what cannot run."""
    assert kernel.supports(torch.bfloat16, 32, 8, 128) and kernel.supports(torch.float32, 9, 3, 64)
    assert not kernel.supports(torch.float32, 4, 2, 96)           # head_dim not a power of two
    assert not kernel.supports(torch.float32, 4, 2, 512)          # past 256
    assert not kernel.supports(torch.float64, 4, 2, 64)
    assert not kernel.supports(torch.float32, 6, 4, 64)           # heads not a multiple of KV heads
    assert not kernel.supports(torch.float32, 64, 2, 64)          # a group of 32
    pool = make_pool(4, 8, 2, 24, torch.float32)
    with pytest.raises(ValueError, match="unsupported shape"):
        kernel(make_q(3, 4, 2, 24, torch.float32), pool, 0, torch.tensor([0]), 0)
    pool = make_pool(4, 8, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="cannot hold"):
        kernel(make_q(3, 4, 2, 16, torch.float32), pool, 0, torch.tensor([0]), 7)
    with pytest.raises(ValueError, match="dtype"):
        kernel(make_q(3, 4, 2, 16, torch.bfloat16), pool, 0, torch.tensor([0, 1]), 7)
    for tiles in (dict(rows=8), dict(block_n=48)):
        with pytest.raises(ValueError, match="power of two"):
            tp.TritonPrefillKernel(**tiles)


def test_load_checks_a_launch_and_falls_back(tp: ModuleType, monkeypatch, caplog) -> None:
    """``load`` gives the kernel where a tiny launch matches torch; None, logged, where it fails; and
    ``supports`` refuses a configuration whose own launch fails (once, remembered)."""
    assert isinstance(tp.TritonPrefillKernel.load(torch.device("cpu")), tp.TritonPrefillKernel)
    calls = []

    def broken(self, *args, **kwargs):
        calls.append(1)
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(tp.TritonPrefillKernel, "attend_varlen", broken)
    with caplog.at_level(logging.INFO, logger=MODULE):
        assert tp.TritonPrefillKernel.load(torch.device("cpu")) is None
        fresh = tp.TritonPrefillKernel()
        assert not fresh.supports(torch.bfloat16, 8, 2, 64) and not fresh.supports(torch.bfloat16, 8, 2, 64)
    assert "cannot run" in caplog.text and "shared memory" in caplog.text and len(calls) == 2


def test_load_refuses_wrong_results(tp: ModuleType, monkeypatch, caplog) -> None:
    """A launch that runs but disagrees with torch is refused too."""
    original = tp.TritonPrefillKernel.attend_varlen
    monkeypatch.setattr(tp.TritonPrefillKernel, "attend_varlen", lambda *a, **k: original(*a, **k) * 1.01)
    with caplog.at_level(logging.WARNING, logger=MODULE):
        assert tp.TritonPrefillKernel.load(torch.device("cpu")) is None
    assert "wrong results" in caplog.text


@torch.inference_mode()
def test_runner_steps_match_torch(kernel, monkeypatch) -> None:
    """The tiny model's steps, the runner's inputs built with the kernel as its prefill kernel (block
    ids set from position 0 on), against the same steps on torch's gather path: first chunks, then
    chunks over their cached prefix beside a decode row, every row's hidden state, then the sampled
    rows alone (the last layer restricted to them)."""
    torch_runner, triton_runner = make_runner(8, native=False), make_runner(8, native=False)
    monkeypatch.setattr(triton_runner.inputs, "kernels", AttentionKernels(None, kernel))
    blocks = Blocks(torch_runner.num_blocks, 8)
    a, b, c = prompt(38, 1), prompt(52, 2), prompt(20, 3)
    ta, tb, tc = blocks.grow([], 38), blocks.grow([], 52), blocks.grow([], 20)
    steps = [[seq("a", a[:23], 0, ta), seq("b", b[:40], 0, tb), seq("c", c[:19], 0, tc)],
             [seq("c", c[19:], 19, tc), seq("a", a[23:], 23, ta, sample=False), seq("b", b[40:], 40, tb)]]
    for seqs in steps:
        for all_rows in (True, False):
            hidden = []
            for runner in (torch_runner, triton_runner):
                inputs = runner.prepare_inputs(StepPlan(seqs), all_rows=all_rows)
                assert all(s.block_ids is not None for s in inputs.attn.prefills) or runner is torch_runner
                hidden.append(runner.model(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_cache))
            torch.testing.assert_close(hidden[1], hidden[0], atol=1e-4, rtol=1e-4)


def test_window_pool_tables_read_in_place(kernel) -> None:
    """With the window layers' own pool, chunks read their window tables in place: the released
    entries (the null block, filled with NaN here) are never read, and the result matches the
    gathered masked attention."""
    block_size, kv_heads, heads, hd, window = 4, 2, 4, 16, 6
    pool = make_pool(12, block_size, kv_heads, hd, torch.float32)
    pool[0] = float("nan")                                  # the null block of the window pool
    # Chunk x: 9 new over 13 cached; its window starts at key 8, so blocks 0 and 1 are released.
    x = replace(seq("x", prompt(9, 1), 13, [1, 2, 3, 4, 5, 6]), window_table=[0, 0, 5, 7, 3, 9])
    y = replace(seq("y", prompt(10, 2), 0, [7, 8, 9]), window_table=[4, 6, 8])
    spans = (PrefillSpan(0, 9, 13, torch.tensor(x.block_table), None),
             PrefillSpan(9, 19, 0, torch.tensor(y.block_table), None))
    meta = AttnMetadata(torch.zeros(19, 2, dtype=torch.long), None, spans, prefill_kernel=kernel)
    win = window_kv(meta, [], [x, y], pool, window)
    assert win.meta.prefill_kernel is kernel
    q, kv_new = make_q(19, heads, kv_heads, hd, torch.float32), torch.randn(19, 2, kv_heads, hd)
    rule = ScoreRule(hd ** -0.5, window=window)
    got = masked_paged_attention(q, kv_new, pool.clone(), 1, win.meta, rule)
    want = masked_paged_attention(q, kv_new, pool.clone(), 1, replace(win.meta, prefill_kernel=None), rule)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
