"""Tiny tokenizers of each model family, trained at test time and written as a HF directory and a GGUF.

A family is its tokenizer kind (byte-level BPE with the family's split, or SentencePiece), its
special tokens and its published chat template (``tests/data/chat_templates``). The vocabulary is
learned from a small corpus with the ``tokenizers`` trainers, so merges, scores and byte fallback
are real; the GGUF carries the fields llama.cpp's converter writes (tokens, scores or merges, token
types, pre-tokenizer, bos/eos ids, add_bos/add_space_prefix flags, chat template). The HF directory
holds the family's ``tokenizer.json`` shape (SentencePiece in the Llama 2 / Mistral v0.1 form:
space prefix by normalizer, byte fallback) and a ``tokenizer_config.json`` with the template.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello, world! How are you today? I'm fine, thanks; we'll see, they're here.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }\n\tindented\n\n  two spaces",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159 1,000,000",
    "café naïve résumé über straße Ärger Привет мир Γειά σου 日本語 中文 한국어",
    "What is the capital of France? Paris. And of Japan? Tokyo. Write code, be brief.",
    "system user assistant model tool function call arguments name content role",
]


@dataclass(frozen=True)
class Family:
    """One model family's tokenizer shape."""

    name: str
    kind: str                         # "bpe" (byte-level) or "spm" (SentencePiece)
    template: str                     # file in tests/data/chat_templates
    bos: str | None
    eos: str
    control: tuple[str, ...]          # special tokens besides bos/eos/unk
    pre: str = ""                     # GGUF tokenizer.ggml.pre of a byte-level family
    split: str = ""                   # its split regex (tokenizer.json)
    add_bos: bool = False
    add_space_prefix: bool = True


FAMILIES = (
    Family("llama3", "bpe", "llama-3.2-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>",
           ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>"),
           pre="llama-bpe", split=_LLAMA3_SPLIT, add_bos=True),
    Family("qwen2.5", "bpe", "qwen2.5-instruct.jinja", None, "<|im_end|>",
           ("<|endoftext|>", "<|im_start|>"), pre="qwen2", split=_QWEN2_SPLIT),
    Family("qwen3", "bpe", "qwen3.jinja", None, "<|im_end|>",
           ("<|endoftext|>", "<|im_start|>", "<think>", "</think>"), pre="qwen2", split=_QWEN2_SPLIT),
    Family("mistral", "spm", "mistral-7b-instruct-v0.1.jinja", "<s>", "</s>", (), add_bos=True),
    # Mistral's tool-calling form ([AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS]), byte-level BPE.
    Family("mistral3", "bpe", "mistral-small-3.1-instruct.jinja", "<s>", "</s>",
           ("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), pre="pixtral", split=_LLAMA3_SPLIT, add_bos=True),
    Family("phi3", "spm", "phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>",
           ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), add_bos=False),
    Family("gemma", "spm", "gemma-2-it.jinja", "<bos>", "<eos>",
           ("<pad>", "<start_of_turn>", "<end_of_turn>"), add_bos=True, add_space_prefix=False),
)


@dataclass(frozen=True)
class Vocab:
    """A trained vocabulary in id order, with what a GGUF stores for it."""

    tokens: list[str]
    scores: list[float]
    types: list[int]                  # GGUF token types: 1 normal, 2 unknown, 3 control, 6 byte
    merges: list[tuple[str, str]]


def template_text(family: Family) -> str:
    """The family's published chat template."""
    return (TEMPLATES / family.template).read_text(encoding="utf-8")


def build_vocab(family: Family, vocab_size: int = 600) -> Vocab:
    """Train the family's tokenizer on CORPUS; specials first, then what the trainer learned."""
    if family.kind == "bpe":
        return _byte_level_vocab(family, vocab_size)
    return _sentencepiece_vocab(family, vocab_size)


def _specials(family: Family) -> list[str]:
    head = ["<unk>"] if family.kind == "spm" else []
    return list(dict.fromkeys([*head, *(t for t in (family.bos, family.eos) if t), *family.control]))


def _byte_level_vocab(family: Family, vocab_size: int) -> Vocab:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = _byte_level_split(family)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    learned = json.loads(backend.to_str())["model"]
    by_id = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    specials = _specials(family)
    tokens = [t for t, _ in by_id] + specials
    types = [1] * len(by_id) + [3] * len(specials)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    return Vocab(tokens, [0.0] * len(tokens), types, merges)


def _sentencepiece_vocab(family: Family, vocab_size: int) -> Vocab:
    backend = BackendTokenizer(models.BPE())
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    learned = json.loads(backend.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    merged = list(dict.fromkeys(a + b for a, b in merges))
    chars = [t for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if t not in set(merged)]
    specials = _specials(family)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = merged + chars              # SentencePiece's order: merged pieces by merge order, then characters
    tokens = specials + byte_tokens + pieces
    types = [2 if t == "<unk>" else 3 for t in specials] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return Vocab(tokens, scores, types, [])


def _byte_level_split(family: Family) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(family.split), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def hf_tokenizer_json(family: Family, vocab: Vocab) -> BackendTokenizer:
    """The family's tokenizer.json built from ``vocab`` (SentencePiece merges by transformers' rule)."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if family.kind == "bpe":
        backend = BackendTokenizer(models.BPE(ids, vocab.merges, ignore_merges=family.pre == "llama-bpe"))
        backend.pre_tokenizer = _byte_level_split(family)
        backend.decoder = decoders.ByteLevel()
    else:
        from transformers.tokenization_utils_base import generate_merges

        scores = {t: s for t, s in zip(vocab.tokens, vocab.scores, strict=True)}
        merges = generate_merges(ids, scores)
        backend = BackendTokenizer(models.BPE(ids, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        escape = normalizers.Replace(" ", "\u2581")
        backend.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), escape])
                              if family.add_space_prefix else escape)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        backend.decoder = decoders.Sequence(
            [*steps, decoders.Strip(" ", 1, 0)] if family.add_space_prefix else steps)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(vocab.tokens, vocab.types, strict=True) if k in (2, 3)])
    if family.add_bos and family.bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, ids[family.bos])])
    return backend


def write_hf_dir(family: Family, vocab: Vocab, directory: str | os.PathLike[str]) -> str:
    """tokenizer.json + tokenizer_config.json (with the chat template) in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    hf_tokenizer_json(family, vocab).save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template_text(family),
              "bos_token": family.bos, "eos_token": family.eos, "clean_up_tokenization_spaces": False}
    if family.kind == "spm":
        config["unk_token"] = "<unk>"
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return os.fspath(directory)


def family_tokenizer(name: str, directory: str | os.PathLike[str]):  # -> kvhive.core.tokenizer.Tokenizer
    """The tokenizer of family ``name`` ("qwen3", "llama3", ...; "default": the default model's), its
    files written to ``directory``."""
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer

    if name == "default":
        return Tokenizer.from_model_path(default_model_path())
    family = next(f for f in FAMILIES if f.name == name)
    return Tokenizer.from_hf_dir(write_hf_dir(family, build_vocab(family), directory))


def write_gguf(family: Family, vocab: Vocab, path: str | os.PathLike[str], model: str | None = None,
               omit: tuple[str, ...] = ()) -> str:
    """A GGUF holding the tokenizer fields llama.cpp's converter writes (no tensors); ``model``
    replaces tokenizer.ggml.model, ``omit`` names fields left out."""
    import gguf

    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    spm = family.kind == "spm"
    fields: list[tuple[str, object, object]] = [
        ("tokenizer.ggml.model", model or ("llama" if spm else "gpt2"), gguf.GGUFValueType.STRING),
        ("tokenizer.ggml.tokens", vocab.tokens, gguf.GGUFValueType.ARRAY),
        ("tokenizer.ggml.token_type", vocab.types, gguf.GGUFValueType.ARRAY),
        ("tokenizer.ggml.eos_token_id", ids[family.eos], gguf.GGUFValueType.UINT32),
        ("tokenizer.ggml.add_bos_token", family.add_bos, gguf.GGUFValueType.BOOL),
        ("tokenizer.ggml.add_eos_token", False, gguf.GGUFValueType.BOOL),
        ("tokenizer.chat_template", template_text(family), gguf.GGUFValueType.STRING),
    ]
    if family.bos:
        fields.append(("tokenizer.ggml.bos_token_id", ids[family.bos], gguf.GGUFValueType.UINT32))
    if spm:
        fields += [("tokenizer.ggml.scores", vocab.scores, gguf.GGUFValueType.ARRAY),
                   ("tokenizer.ggml.unknown_token_id", ids["<unk>"], gguf.GGUFValueType.UINT32),
                   ("tokenizer.ggml.add_space_prefix", family.add_space_prefix, gguf.GGUFValueType.BOOL)]
    else:
        fields += [("tokenizer.ggml.pre", family.pre, gguf.GGUFValueType.STRING),
                   ("tokenizer.ggml.merges", [f"{a} {b}" for a, b in vocab.merges], gguf.GGUFValueType.ARRAY)]
    for key, value, vtype in fields:
        if key not in omit:
            writer.add_key_value(key, value, vtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)
