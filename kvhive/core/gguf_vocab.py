"""A GGUF file's tokenizer metadata as a `tokenizers` backend that gives llama.cpp's ids (torch-free).

Two vocabulary kinds (`tokenizer.ggml.model`), each built from the GGUF fields alone:

- ``gpt2``: byte-level BPE from `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`. The text is
  first split the way llama.cpp splits it for `tokenizer.ggml.pre` (that is how the merges were
  learned): one or more regexes applied in turn, each cutting every piece into its matches and the
  text between them. A `pre` value llama.cpp does not know, or one kvhive has no split for, is refused.
- ``llama``: SentencePiece (Llama 2, Mistral v0.1, Phi-3, Gemma). llama.cpp merges adjacent pieces
  by the score (`tokenizer.ggml.scores`) of the token they form, best first; a BPE whose merges are
  every split of every token into two tokens, ranked by the whole token's score, merges the same
  way. Spaces are written as U+2581, a space is put before the text (and after each special token,
  as llama.cpp does) when `tokenizer.ggml.add_space_prefix` says so, and characters outside the
  vocabulary fall back to the `<0xNN>` byte tokens.

Control and unknown tokens are special (whole wherever they appear, dropped by decode); user-defined
tokens are added tokens that decode as their text. Both keep the ids they have in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

SPACE_MARK = "\u2581"               # SentencePiece's visible space

# llama.cpp's splits (llama-vocab.cpp), by the regexes applied in turn.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizerRule:
    """How llama.cpp splits text for one group of `tokenizer.ggml.pre` names."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False       # a whole pre-token that is in the vocabulary is one token
    add_bos: bool = False             # BOS added when the file has no tokenizer.ggml.add_bos_token


_RULES: dict[tuple[str, ...], PreTokenizerRule] = {
    ("default",): PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4", "gigachat", "a.x-4.0", "mellum"):
        PreTokenizerRule((_GPT2,)),
    ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"):
        PreTokenizerRule((r"\p{N}", _GPT2)),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"):
        PreTokenizerRule((_LLAMA3,), ignore_merges=True, add_bos=True),
    ("dbrx", "smaug-bpe"): PreTokenizerRule((_LLAMA3,)),
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"):
        PreTokenizerRule((_QWEN2,)),
    ("falcon",): PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
}
PRE_TOKENIZER_RULES: dict[str, PreTokenizerRule] = {name: rule for names, rule in _RULES.items() for name in names}


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF's tokenizer: the backend, the named special tokens, and the extra end-of-generation ids."""

    backend: BackendTokenizer
    special_tokens: dict[str, str | None]
    extra_eos_token_ids: tuple[int, ...]
    sentencepiece: bool


def read_gguf_vocab(meta: Mapping[str, Any], path: str) -> GGUFVocab:
    """The tokenizer a GGUF's metadata describes; ValueError naming the field it cannot use."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported "
                         "(only 'gpt2', byte-level BPE, and 'llama', SentencePiece)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: the GGUF lacks tokenizer.ggml.tokens")
    types = _token_types(meta, tokens, path)
    if kind == "gpt2":
        backend, add_bos = _byte_level_bpe(meta, tokens, types, path)
    else:
        backend = _sentencepiece_bpe(meta, tokens, types, path)
        add_bos = True                  # llama.cpp's default for a SentencePiece vocabulary
    special = {name: _token_at(meta, tokens, f"tokenizer.ggml.{key}") for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    backend.post_processor = _bos_eos_processor(
        special["bos_token"] if meta.get("tokenizer.ggml.add_bos_token", add_bos) else None,
        special["eos_token"] if meta.get("tokenizer.ggml.add_eos_token", False) else None,
        backend,
    )
    extra_eos = tuple(int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                      if k in meta)
    return GGUFVocab(backend, special, extra_eos, sentencepiece=kind == "llama")


def gguf_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, PreTokenizerRule]:
    """llama.cpp's text split for `tokenizer.ggml.pre` as a byte-level pre-tokenizer, and its rule."""
    rule = PRE_TOKENIZER_RULES.get(pre)
    if rule is None:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZER_RULES))}")
    splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in rule.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level]), rule


def _token_types(meta: Mapping[str, Any], tokens: list[str], path: str) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return types


def _token_at(meta: Mapping[str, Any], tokens: list[str], key: str) -> str | None:
    token_id = meta.get(key)
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                    path: str) -> tuple[BackendTokenizer, bool]:
    """The byte-level BPE of a `gpt2` vocabulary, and whether its `pre` adds BOS by default."""
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{path}: the GGUF lacks tokenizer.ggml.merges")
    try:
        pre_tokenizer, rule = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=rule.ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    _add_typed_tokens(backend, tokens, types, special_types=(TOKEN_TYPE_CONTROL,))
    return backend, rule.add_bos


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                       path: str) -> BackendTokenizer:
    """The SentencePiece model of a `llama` vocabulary as a BPE with byte fallback."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre != "default":
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported for a SentencePiece "
                         "vocabulary (llama.cpp splits none)")
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise ValueError(f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)      # llama.cpp's text -> id map keeps the first of equal texts
    unk = _token_at(meta, tokens, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab, merges_from_scores(tokens, scores, vocab), unk_token=unk,
                       fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(model)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", SPACE_MARK)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE_MARK), escape])
                          if add_space_prefix else escape)
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    _add_typed_tokens(backend, tokens, types, special_types=(TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN))
    return backend


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float],
                       vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best-scored whole token first (llama.cpp's order:
    the pair whose joined text has the higher score merges first)."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, token in enumerate(tokens):
        if vocab.get(token) != token_id:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[token_id]), token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_typed_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int],
                      special_types: tuple[int, ...]) -> None:
    """Register control-like tokens as special and user-defined ones as added tokens (same ids)."""
    typed = list(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k in special_types])
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == TOKEN_TYPE_USER_DEFINED])


def _bos_eos_processor(
    bos: str | None, eos: str | None, backend: BackendTokenizer
) -> processors.PostProcessor | None:
    """A post-processor adding `bos` before and `eos` after the text, or None when neither is asked for."""
    if bos is None and eos is None:
        return None
    single = [*([bos] if bos else []), "$A", *([eos] if eos else [])]
    pair = [*single, *([bos] if bos else []), "$B", *([eos] if eos else [])]
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
