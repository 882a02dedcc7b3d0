"""kvhive.engine.constrained: a row's mask, filled row by row on the worker, blocks exactly the
tokens its grammar does not allow (as the library's own batch fill says), the masked logits set
exactly those to -inf and leave every other value bit for bit, on the worker, inline, and inline
after the worker failed; a row with no allowed token below the logits' width counts as empty."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest
import torch

from kvhive.core.structured_spec import StructuredSpec
from kvhive.engine.constrained import GrammarRows, _empty_rows, _masked, _unpacked_blocked
from kvhive.structured import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def allowed_of(words: np.ndarray, width: int) -> np.ndarray:
    """[width] bool from the bitmask's definition, token by token: bit t % 32 of word t // 32."""
    return np.array([(int(words[t // 32]) >> (t % 32)) & 1 == 1 for t in range(width)])


def expected(logits: np.ndarray, rows: list[int], bitmask: np.ndarray, width: int) -> np.ndarray:
    out = logits.copy()
    for j, row in enumerate(rows):
        out[row, :width][~allowed_of(bitmask[j], width)] = -np.inf
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


def masks(words: int, seed: int = 0) -> np.ndarray:
    """Packed masks of the shapes grammars give: a few tokens, most tokens, none, all, random bits,
    and words with only the sign bit (token 32w + 31) or only bit 0 set."""
    rng = np.random.default_rng(seed)
    few = np.zeros(words, dtype=np.int32)
    few[rng.choice(words, 5, replace=False)] = rng.integers(-2**31, 2**31, 5, dtype=np.int64).astype(np.int32)
    most = np.full(words, -1, dtype=np.int32)
    most[rng.choice(words, 7, replace=False)] = np.array([0, 1, -2, 2**30, -2**31, 12345, -77], dtype=np.int32)
    edges = np.zeros(words, dtype=np.int32)
    edges[::3] = np.int32(-2**31)
    edges[1::3] = 1
    rand = rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32)
    return np.stack([few, most, np.zeros(words, dtype=np.int32), np.full(words, -1, dtype=np.int32), edges, rand])


@pytest.mark.parametrize("width,words", [(4096, 128), (1000, 32), (4000, 126)],
                         ids=["whole words", "a partial last word", "bits past the logits"])
def test_unpacked_flags_block_exactly_the_unset_bits(width, words) -> None:
    bitmask = masks(words)
    blocked = _unpacked_blocked(bitmask, width)
    assert blocked.shape == (len(bitmask), width)
    for j, row in enumerate(bitmask):
        assert np.array_equal(blocked[j], ~allowed_of(row, width))
    assert np.array_equal(_empty_rows(bitmask, width), blocked.all(axis=1))


def test_masked_logits_change_only_the_blocked_tokens() -> None:
    rng = np.random.default_rng(1)
    width, bitmask = 1000, masks(32)
    logits = rng.standard_normal((len(bitmask) + 2, width)).astype(np.float32)
    logits[0, :5] = [np.nan, np.inf, -np.inf, -0.0, 3e38]        # odd values stay as they are
    raw = logits.copy()
    rows = [0, 2, 3, 4, 5, 7]
    got = _masked(torch.from_numpy(logits), rows, _unpacked_blocked(bitmask, width)).numpy()
    assert same_bits(got, expected(raw, rows, bitmask, width))
    assert same_bits(logits, raw)                                  # the raw logits stay for logprobs
    wide = torch.from_numpy(raw).double()                          # other dtypes: torch's ops
    got = _masked(wide, rows, _unpacked_blocked(bitmask, width)).numpy()
    assert np.array_equal(got, expected(raw.astype(np.float64), rows, bitmask, width), equal_nan=True)


def test_a_row_allowing_only_tokens_past_the_logits_is_empty() -> None:
    bitmask = np.zeros((4, 32), dtype=np.int32)
    bitmask[0, 31] = np.int32(1 << 8)        # token 1000: past a width of 1000
    bitmask[1, 31] = np.int32(1 << 7)        # token 999: the last one inside
    bitmask[2, 0] = np.int32(-2**31)         # token 31
    assert _empty_rows(bitmask, 1000).tolist() == [True, False, False, True]
    assert _empty_rows(bitmask, 1001).tolist() == [False, False, False, True]


def grammar_matchers(compiler: GrammarCompiler, tokenizer) -> list:
    """Matchers of a json_schema between values, inside a string and in a number."""
    spec = StructuredSpec("json_schema", schema=json.dumps(SCHEMA))
    text = tokenizer.encode('{"name": "Ada", "age": 3')
    matchers = []
    for n in (0, 1, 4, 6, len(text)):
        m = compiler.compile(spec).matcher()
        assert all(m.accept(t) for t in text[:n])
        matchers.append(m)
    return matchers


def test_the_rows_masks_are_the_grammar_s_allowed_tokens(tokenizer) -> None:
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    matchers = grammar_matchers(compiler, tokenizer)
    blocked, empty = GrammarRows(compiler, vocab, overlap=False)._masks(matchers)
    want = np.zeros((len(matchers), compiler.mask_words), dtype=np.int32)
    # The reference: the library's own batch fill, on its executor, all rows at once.
    llnp.fill_next_token_bitmask_par(llguidance.LLExecutor(num_threads=2), [(m.raw, i) for i, m in enumerate(matchers)],
                                     want)
    assert not empty.any()
    for j in range(len(matchers)):
        assert np.array_equal(blocked[j], ~allowed_of(want[j], vocab))
    assert len({row.tobytes() for row in blocked}) > 2             # the states differ


def test_worker_inline_and_failed_worker_masks_give_the_same_logits(tokenizer, monkeypatch) -> None:
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    logits = torch.randn(6, vocab)
    seqs = [SimpleNamespace(request_id=f"r{i}", sampling=SimpleNamespace(structured=None)) for i in range(6)]
    got = []
    for overlap, broken in ((True, False), (False, False), (True, True)):
        rows = GrammarRows(compiler, vocab, overlap=overlap)
        matchers = grammar_matchers(compiler, tokenizer)
        rows._matchers = {f"r{i + 1}": m for i, m in enumerate(matchers)}
        for i in range(1, 6):
            seqs[i].sampling.structured = True
        monkeypatch.setattr(rows, "matcher_for", lambda s, failed, rows=rows: rows._matchers[s.request_id])
        if broken:
            compute = rows._masks

            def fail_on_worker(ms, compute=compute):
                if threading.current_thread().name.startswith("kvhive-grammar"):
                    raise RuntimeError("worker broke")
                return compute(ms)
            monkeypatch.setattr(rows, "_masks", fail_on_worker)
        failed: dict[str, str] = {}
        job = rows.start(seqs, failed)
        got.append(rows.mask_logits(job, logits, failed).numpy())
        rows.close()
        assert not failed and (rows.times.inline_seconds > 0) == (broken or not overlap)
    assert same_bits(got[0], got[1]) and same_bits(got[0], got[2])
    assert same_bits(got[0][0], logits.numpy()[0])
    assert np.isinf(got[0][1:]).sum() > 0
