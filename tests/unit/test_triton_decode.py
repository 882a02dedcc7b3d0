"""The Triton paged decode kernel against a torch reference, run on CPU tensors by Triton's interpreter.

The kernel tests run in a process started with ``TRITON_INTERPRET=1`` (``support.triton_interpret``
says why); without it, ``test_under_the_interpreter`` runs this module again in such a child. Either
``PYTHONPATH=$PWD python -m pytest -q tests/unit/test_triton_decode.py`` (a child) or the same with
``TRITON_INTERPRET=1`` in front (in process) checks them; skipped where triton is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import pytest
import torch
from support.triton_interpret import HAS_TRITON, INTERPRETING, interpreted, interpreter_run_passes

from kvhive.model.attention import AttnMetadata, DecodeBatch
from kvhive.model.window_attention import ScoredDecodeKernel, ScoreRule, masked_paged_attention

MODULE = "kvhive.model.triton_decode"


def test_under_the_interpreter() -> None:
    interpreter_run_passes(__file__, min_passed=20)


@pytest.fixture(scope="module")
def kernel_module():
    """``kvhive.model.triton_decode``, interpreted (this process was started with TRITON_INTERPRET=1)."""
    return importlib.import_module(MODULE)


@dataclass
class Case:
    """A pool, a batch of decode rows over it, and their queries."""

    q: torch.Tensor                 # [n, heads, head_dim]
    pool: torch.Tensor              # [blocks, layers, 2, block_size, kv_heads, head_dim]
    tables: torch.Tensor            # [n, max_blocks] int64, padding block 0
    lens: torch.Tensor              # [n] int64
    first: torch.Tensor | None      # [n] int64: position of each table's first entry


def make_case(lens: list[int], heads: int, kv_heads: int, head_dim: int = 16, block_size: int = 4,
              dtype: torch.dtype = torch.float32, first: list[int] | None = None, layers: int = 2,
              shared_table: bool = False, seed: int = 0) -> Case:
    """Rows with context lens ``lens`` (absolute positions; with ``first``, row i's table covers
    positions first[i]..lens[i]-1), random pool blocks, block 0 left as padding."""
    gen = torch.Generator().manual_seed(seed)
    first_keys = first or [0] * len(lens)
    widths = [-(-(n - f) // block_size) for n, f in zip(lens, first_keys, strict=True)]
    num_blocks = 1 + (max(widths) if shared_table else sum(widths))
    pool = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(lens), max(widths), dtype=torch.long)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = order[:w] if shared_table else order[used:used + w]
        used += w
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return Case(q, pool, tables, torch.tensor(lens), None if first is None else torch.tensor(first))


def reference(c: Case, layer: int, scale: float | None = None, softcap: float | None = None,
              window: int | None = None) -> torch.Tensor:
    """Gather each row's keys, mask them, softmax in float64: [n, heads * head_dim]."""
    n, heads, head_dim = c.q.shape
    kv_heads = c.pool.shape[4]
    out = []
    for i in range(n):
        k = c.pool[c.tables[i], layer, 0].reshape(-1, kv_heads, head_dim).double()
        v = c.pool[c.tables[i], layer, 1].reshape(-1, kv_heads, head_dim).double()
        first = 0 if c.first is None else int(c.first[i])
        positions = first + torch.arange(k.shape[0])
        pos = int(c.lens[i]) - 1
        seen = positions <= pos
        if window is not None:
            seen &= positions > pos - window
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("hd,khd->hk", c.q[i].double(), k) * (head_dim ** -0.5 if scale is None else scale)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        out.append(torch.einsum("hk,khd->hd", p, v).reshape(-1))
    return torch.stack(out)


def run(module, c: Case, layer: int = 1, partition_keys: int = 16, **rules) -> torch.Tensor:
    """The kernel with small partitions (several per row) over case ``c``."""
    kernel = module.TritonDecodeKernel(partition_keys=partition_keys, block_keys=16)
    return kernel.attend(c.q, c.pool, layer, c.tables, c.lens, first_keys=c.first, **rules)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """got (the kernel's, in the pool dtype) equals want within that dtype's rounding."""
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@interpreted
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_ragged_rows_across_block_and_partition_edges(kernel_module, heads: int, kv_heads: int) -> None:
    # 1 key; one block exactly; one key past a block; a partition exactly (16); across partitions.
    c = make_case([1, 4, 5, 16, 17, 37], heads, kv_heads)
    check(run(kernel_module, c), reference(c, 1), torch.float32)


@interpreted
def test_more_partitions_than_one_merge_step(kernel_module) -> None:
    c = make_case([300, 2, 150], 2, 1)              # 19 partitions of 16 keys: merged 16 at a time
    check(run(kernel_module, c), reference(c, 1), torch.float32)


@interpreted
def test_one_partition_and_the_default_geometry(kernel_module) -> None:
    c = make_case([3, 9, 30], 4, 2, head_dim=32, block_size=8)
    want = reference(c, 0)
    check(run(kernel_module, c, layer=0, partition_keys=64), want, torch.float32)     # the single-pass path
    got = kernel_module.TritonDecodeKernel().attend(c.q, c.pool, 0, c.tables, c.lens)
    check(got, want, torch.float32)


@interpreted
def test_rows_of_one_sequence_and_padding_rows(kernel_module) -> None:
    # A short chunk's rows share one table, each at its own position; a graph's padding rows see key 0.
    c = make_case([18, 19, 20, 21], 4, 1, shared_table=True)
    c.tables = torch.cat([c.tables, torch.zeros(2, c.tables.shape[1], dtype=torch.long)])
    c.lens = torch.cat([c.lens, torch.ones(2, dtype=torch.long)])
    c.q = torch.cat([c.q, torch.randn(2, *c.q.shape[1:])])
    check(run(kernel_module, c), reference(c, 1), torch.float32)


@interpreted
def test_strided_queries(kernel_module) -> None:
    c = make_case([7, 22], 4, 2)
    qk = torch.randn(2, 6, 16)
    c.q = qk[:, :4]                     # a view into the fused q/k rows, as the model passes it
    check(run(kernel_module, c), reference(c, 1), torch.float32)


@interpreted
@pytest.mark.parametrize("window", [1, 4, 5, 13])
def test_sliding_window_edges(kernel_module, window: int) -> None:
    c = make_case([1, 4, 5, 13, 14, 40], 4, 2)
    check(run(kernel_module, c, window=window), reference(c, 1, window=window), torch.float32)


@interpreted
def test_first_key_offsets_with_a_window(kernel_module) -> None:
    # Window tables: row i's table starts at the block its window reaches (as window_kv builds them).
    c = make_case([9, 30, 41], 4, 2, first=[4, 20, 32])
    check(run(kernel_module, c, window=8), reference(c, 1, window=8), torch.float32)


@interpreted
def test_scale_and_soft_cap(kernel_module) -> None:
    c = make_case([6, 35], 4, 2)
    c.q = c.q * 8                       # scores large enough for the cap to bend them
    rules = dict(scale=0.0625, softcap=5.0)
    got = run(kernel_module, c, **rules)
    check(got, reference(c, 1, **rules), torch.float32)
    assert not torch.allclose(got.double(), reference(c, 1, scale=0.0625), atol=1e-3)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_pools(kernel_module, dtype: torch.dtype) -> None:
    c = make_case([2, 16, 33], 8, 2, dtype=dtype)
    check(run(kernel_module, c), reference(c, 1), dtype)


@interpreted
def test_head_dim_padded_to_a_power_of_two(kernel_module) -> None:
    c = make_case([5, 21], 6, 2, head_dim=24)
    check(run(kernel_module, c), reference(c, 1), torch.float32)
    # The largest head: K/V tiles of 32 keys (half of block_keys), two partitions of 64.
    c = make_case([3, 70], 2, 1, head_dim=256)
    got = kernel_module.TritonDecodeKernel(partition_keys=64, block_keys=64).attend(c.q, c.pool, 0, c.tables, c.lens)
    check(got, reference(c, 0), torch.float32)


@interpreted
def test_the_decode_batch_interface(kernel_module) -> None:
    c = make_case([3, 20], 4, 2)
    dec = DecodeBatch(2, c.tables, c.lens, mask=None, kernel=None, workspace=None)
    got = kernel_module.TritonDecodeKernel(partition_keys=16, block_keys=16)(c.q, c.pool, 1, dec)
    check(got, reference(c, 1), torch.float32)


@interpreted
def test_supports_and_load(kernel_module) -> None:
    kernel_class = kernel_module.TritonDecodeKernel
    assert kernel_class.supports(torch.bfloat16, 32, 8, 128)
    assert kernel_class.supports(torch.float32, 9, 3, 64)
    assert not kernel_class.supports(torch.float32, 9, 3, 512)         # head_dim over 256
    assert not kernel_class.supports(torch.float64, 4, 2, 64)
    assert not kernel_class.supports(torch.float32, 6, 4, 64)          # heads not a multiple of KV heads
    with pytest.raises(ValueError, match="block_keys"):
        kernel_class(partition_keys=24, block_keys=16)
    kernel = kernel_class.load("cpu")
    assert kernel is not None and kernel.describe(torch.device("cpu")) == "Triton paged (cpu)"
    assert kernel.num_partitions(3, 16) == 1 and kernel.num_partitions(33, 16) == 2


@interpreted
@pytest.mark.parametrize("window,first", [(None, None), (8, [4, 20, 32])])
def test_the_window_layers_decode_rows_match_the_torch_path(kernel_module, window, first) -> None:
    c = make_case([9, 30, 41], 4, 2, first=first)
    kernel = kernel_module.TritonDecodeKernel(partition_keys=16, block_keys=16)
    assert isinstance(kernel, ScoredDecodeKernel)
    rule = ScoreRule(scale=0.2, softcap=3.0, window=window)
    kv_new = torch.randn(3, 2, 2, 16)
    slot_rows = torch.tensor([[2, 6], [1, 5], [3, 7]])      # block 0 (padding, never read unmasked)
    outputs = []
    for path in (kernel, None):
        dec = DecodeBatch(3, c.tables, c.lens, mask=None, kernel=path, workspace=None)
        pool = c.pool.clone()
        outputs.append(masked_paged_attention(c.q, kv_new, pool, 1, AttnMetadata(slot_rows, dec, ()), rule, c.first))
        torch.testing.assert_close(pool[0, 1, :, 1:4].transpose(0, 1), kv_new[[1, 0, 2]])
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-5, rtol=2e-5)
    check(outputs[0], reference(c, 1, scale=0.2, softcap=3.0, window=window), torch.float32)


def on_cuda(c: Case) -> Case:
    """``c`` with every tensor on the GPU."""
    return dataclasses.replace(c, **{f.name: getattr(c, f.name).cuda() for f in dataclasses.fields(c)
                                     if getattr(c, f.name) is not None})


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()) or INTERPRETING,
                    reason="needs CUDA and compiled (not interpreted) Triton")
def test_compiled_on_cuda_and_replayed_in_a_cuda_graph() -> None:
    module = importlib.import_module(MODULE)
    kernel = module.TritonDecodeKernel.load("cuda")
    assert kernel is not None
    for dtype in (torch.float32, torch.bfloat16):
        c = make_case([1, 17, 300, 1100], 32, 8, head_dim=128, block_size=16, dtype=dtype)
        g = on_cuda(c)
        check(kernel.attend(g.q, g.pool, 1, g.tables, g.lens).cpu(), reference(c, 1), dtype)
        check(kernel.attend(g.q, g.pool, 1, g.tables, g.lens, window=64).cpu(), reference(c, 1, window=64), dtype)
    # Recorded once with some context lengths, replayed with others: nothing depends on their values.
    c = make_case([40, 1100, 600], 8, 2, head_dim=64, block_size=16)
    g = on_cuda(c)
    dec = DecodeBatch(3, g.tables, g.lens, mask=None, kernel=kernel, workspace=None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernel(g.q, g.pool, 1, dec)                   # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(g.q, g.pool, 1, dec)
    for lens in ([40, 1100, 600], [1, 700, 590]):
        g.lens.copy_(torch.tensor(lens))
        graph.replay()
        torch.cuda.synchronize()
        check(out.cpu(), reference(dataclasses.replace(c, lens=torch.tensor(lens)), 1), torch.float32)


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING, reason="compiles the GPU kernels, which the interpreter replaces")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
@pytest.mark.parametrize("dtype,head_dim,group,single", [("bf16", 128, 4, False), ("fp16", 256, 8, True),
                                                          ("fp32", 64, 3, False)])
def test_compiles_for_an_h100(dtype: str, head_dim: int, group: int, single: bool) -> None:
    """Both decode kernels compile to sm_90 cubins with no GPU here (what the interpreter cannot check:
    the tile shapes ``tl.dot`` accepts, the types the loops carry), with the tiles a launch uses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module(MODULE)
    kernel = module.TritonDecodeKernel()
    block_d = max(16, triton.next_power_of_2(head_dim))
    constexprs = dict(HAS_FIRST=True, HAS_WINDOW=True, HAS_SOFTCAP=True, SINGLE=single,
                      PART_KEYS=kernel.partition_keys, BLOCK_N=kernel._tile_keys(block_d),
                      BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
                      PRECISION="ieee" if dtype == "fp32" else "tf32")
    scratch = f"*{dtype}" if single else "*fp32"
    kinds = dict(q_ptr=f"*{dtype}", pool_ptr=f"*{dtype}", out_ptr=f"*{dtype}", tables_ptr="*i64", ctx_ptr="*i64",
                 first_ptr="*i64", m_ptr=scratch, l_ptr=scratch, acc_ptr=scratch, qk_scale="fp32", softcap="fp32")
    target = GPUTarget("cuda", 90, 32)
    for fn, given in ((module._decode_partition, constexprs), (module._merge_partitions,
                                                                dict(BLOCK_P=16, BLOCK_D=block_d))):
        kinds_here = dict(kinds, m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32") if fn is module._merge_partitions \
            else kinds
        signature = {name: "constexpr" if name in given else kinds_here.get(name, "i32") for name in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, signature, given), target=target)
        assert compiled.asm["cubin"] and compiled.metadata.shared <= 228 * 1024
