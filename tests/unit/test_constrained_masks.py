"""kvhive.engine.constrained: the packed token masks applied to the logits set exactly the tokens a
mask does not allow to -inf and leave every other value bit for bit, on the packed path and on the
unpacked one it falls back to; a row with no allowed token below the logits' width counts as empty."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvhive.core.structured_spec import StructuredSpec
from kvhive.engine import constrained
from kvhive.engine.constrained import GrammarRows, _empty_rows, _masked
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


@pytest.fixture(params=[True, False], ids=["packed", "unpacked"])
def path(request, monkeypatch) -> bool:
    monkeypatch.setattr(constrained, "PACKED_APPLY", request.param)
    return request.param


@pytest.mark.parametrize("width,words", [(4096, 128), (1000, 32), (4000, 126)],
                         ids=["whole words", "a partial last word", "bits past the logits"])
def test_masked_logits_block_exactly_the_unset_bits(path, width, words) -> None:
    rng = np.random.default_rng(1)
    bitmask = masks(words)
    logits = rng.standard_normal((len(bitmask) + 2, width)).astype(np.float32)
    logits[0, :5] = [np.nan, np.inf, -np.inf, -0.0, 3e38]        # odd values stay as they are
    logits[3, 7:9] = [np.nan, np.inf]
    raw = logits.copy()
    rows = [0, 2, 3, 4, 5, 7]
    got = _masked(torch.from_numpy(logits), rows, bitmask, width).numpy()
    assert same_bits(got, expected(raw, rows, bitmask, width))
    assert same_bits(logits, raw)                                  # the raw logits stay for logprobs


def test_the_packed_and_unpacked_paths_give_the_same_logits(monkeypatch) -> None:
    rng = np.random.default_rng(2)
    bitmask = masks(1536, seed=3)
    logits = torch.from_numpy(rng.standard_normal((8, 49152)).astype(np.float32))
    rows = [1, 2, 3, 5, 6, 7]
    packed = _masked(logits, rows, bitmask, 49152).numpy()
    monkeypatch.setattr(constrained, "PACKED_APPLY", False)
    assert same_bits(packed, _masked(logits, rows, bitmask, 49152).numpy())


def test_other_dtypes_take_the_unpacked_path() -> None:
    bitmask = masks(32)
    logits = torch.randn(8, 1000, dtype=torch.float64)
    got = _masked(logits, [0, 1, 2, 3, 4, 5], bitmask, 1000)
    want = expected(logits.numpy(), [0, 1, 2, 3, 4, 5], bitmask, 1000)
    assert np.array_equal(got.numpy(), want, equal_nan=True)


def test_a_row_allowing_only_tokens_past_the_logits_is_empty() -> None:
    bitmask = np.zeros((4, 32), dtype=np.int32)
    bitmask[0, 31] = np.int32(1 << 8)        # token 1000: past a width of 1000
    bitmask[1, 31] = np.int32(1 << 7)        # token 999: the last one inside
    bitmask[2, 0] = np.int32(-2**31)         # token 31
    assert _empty_rows(bitmask, 1000).tolist() == [True, False, False, True]
    assert _empty_rows(bitmask, 1001).tolist() == [False, False, False, True]


def test_a_grammar_s_rows_keep_exactly_its_allowed_tokens(tokenizer, path) -> None:
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    rows = GrammarRows(compiler, vocab, overlap=False)
    spec = StructuredSpec("json_schema", schema=json.dumps(SCHEMA))
    text = tokenizer.encode('{"name": "Ada", "age": 3')
    matchers = []
    for n in (0, 1, 4, 6, len(text)):               # between values, inside a string, in a number
        m = compiler.compile(spec).matcher()
        assert all(m.accept(t) for t in text[:n])
        matchers.append(m)
    bitmask, empty = rows._masks(matchers)
    assert not empty.any()
    logits = torch.randn(len(matchers) + 1, vocab)
    masked = _masked(logits, list(range(1, len(matchers) + 1)), bitmask, vocab).numpy()
    for j, m in enumerate(matchers):
        words = np.zeros(compiler.mask_words, dtype=np.int32)
        m.fill_mask(words)
        allowed = allowed_of(words, vocab)
        assert np.array_equal(np.isfinite(masked[j + 1]), allowed)
        assert np.array_equal(masked[j + 1][allowed], logits.numpy()[j + 1][allowed])
    assert same_bits(masked[0], logits.numpy()[0])                # an unconstrained row
