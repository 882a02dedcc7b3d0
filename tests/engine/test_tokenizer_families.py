"""Every family's tokenizer and chat template, from a GGUF and from a HF directory, against references.

The references: transformers (HF directory ids, chat templates rendered by ``apply_chat_template``,
the pre-tokenizer splits it knows), a plain-Python copy of llama.cpp's SentencePiece merge rule, and
llama.cpp's split rule (regexes applied in turn) run with the ``regex`` module. The gateway's prompt
tokenizer must give the engine's ids for every family.
"""

from __future__ import annotations

import dataclasses
import heapq
import os

import pytest
from support.tokenizer_families import FAMILIES, Family, Vocab, build_vocab, write_gguf, write_hf_dir

from kvhive.core.chat_template import ChatTemplateError
from kvhive.core.gguf_vocab import PRE_TOKENIZER_RULES, gguf_pre_tokenizer
from kvhive.core.tokenizer import Tokenizer
from kvhive.routing.prompts import Prompt, PromptTokenizer, chat_messages

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "I'm sure you're right; they'll see.",
    "   leading spaces", "trailing spaces   ", "tabs\t\tand\n\n\nnewlines\r\n", "a  b   c    d", "", " ", "\n",
    "x = 12345 + 678 * 9.0", "2024-01-31T12:00:00Z", "café naïve résumé", "Привет, мир! 日本語 한국어",
    "😀👍🏽 emoji 🇫🇷 👨‍👩‍👧‍👦", "mixed 中文 and English 123", "def f(x):\n    return x  # done\n",
    "unseen ẞ ŉ ǅ letters", "a\u00a0b\u200bc", "zero\u0000byte",
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And of Japan? 日本"}],
    [{"role": "user", "content": "  spaces and\n\nnewlines  "}, {"role": "assistant", "content": " 😀 "},
     {"role": "user", "content": "count:  1 2  3"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]


@dataclasses.dataclass(frozen=True)
class Built:
    family: Family
    vocab: Vocab
    gguf: str
    hf_dir: str


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    root = tmp_path_factory.mktemp("tokenizer_families")
    out = {}
    for family in FAMILIES:
        vocab = build_vocab(family)
        out[family.name] = Built(family, vocab, write_gguf(family, vocab, root / f"{family.name}.gguf"),
                                 write_hf_dir(family, vocab, root / family.name))
    return out


NAMES = [f.name for f in FAMILIES]
SPM_NAMES = [f.name for f in FAMILIES if f.kind == "spm"]


@pytest.mark.parametrize("name", NAMES)
def test_gguf_and_hf_dir_give_transformers_ids(built: dict[str, Built], name: str) -> None:
    b = built[name]
    from_gguf, from_dir = Tokenizer.from_model_path(b.gguf), Tokenizer.from_model_path(b.hf_dir)
    reference = transformers.AutoTokenizer.from_pretrained(b.hf_dir)
    specials = "".join(t for t in (b.family.bos, b.family.eos, *b.family.control) if t)
    for text in [*TEXTS, f"x{specials}y", f"{b.family.eos} after", f"before {b.family.eos}"]:
        expected = reference.encode(text, add_special_tokens=False)
        assert from_gguf.encode(text) == expected, text
        assert from_dir.encode(text) == expected, text
        assert from_gguf.encode(text, add_special_tokens=True) == reference.encode(text), text
        assert from_gguf.decode(expected) == reference.decode(expected, skip_special_tokens=True), text
    assert from_gguf.eos_token_ids[0] == reference.convert_tokens_to_ids(b.family.eos)


def _llama_cpp_spm(vocab: Vocab, text: str, add_space_prefix: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenization of one piece of text with no special tokens in it."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    text = ((" " if add_space_prefix else "") + text).replace(" ", "\u2581")
    symbols = list(text)                       # symbols[i] is None once merged into its left neighbour
    nxt, prv = list(range(1, len(symbols))) + [-1], list(range(-1, len(symbols) - 1))
    heap: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (joined := symbols[left] + symbols[right]) in ids:
            heapq.heappush(heap, (-vocab.scores[ids[joined]], left, right, joined))

    for i in range(len(symbols) - 1):
        push(i, i + 1)
    while heap:
        _, left, right, joined = heapq.heappop(heap)
        if symbols[left] is None or symbols[right] is None or symbols[left] + symbols[right] != joined:
            continue
        symbols[left], symbols[right] = joined, None
        nxt[left] = nxt[right]
        if nxt[left] >= 0:
            prv[nxt[left]] = left
        push(prv[left], left)
        push(left, nxt[left])
    out: list[int] = []
    for piece in (s for s in symbols if s is not None):
        out += [ids[piece]] if piece in ids else [ids[f"<0x{byte:02X}>"] for byte in piece.encode()]
    return out


@pytest.mark.parametrize("name", SPM_NAMES)
def test_sentencepiece_follows_llama_cpp_merge_rule(built: dict[str, Built], name: str) -> None:
    b = built[name]
    tok = Tokenizer.from_model_path(b.gguf)
    for text in TEXTS:
        if text:
            assert tok.encode(text) == _llama_cpp_spm(b.vocab, text, b.family.add_space_prefix), text
    # After a special token llama.cpp puts the space before the text again.
    eos = b.family.eos
    expected = _llama_cpp_spm(b.vocab, "a b", b.family.add_space_prefix)
    assert tok.encode(f"{eos}a b") == [tok.eos_token_ids[0], *expected]


@pytest.mark.parametrize("name", SPM_NAMES)
def test_sentencepiece_token_bytes_are_exact(built: dict[str, Built], name: str) -> None:
    tok = Tokenizer.from_model_path(built[name].gguf)
    prefix = " " if built[name].family.add_space_prefix else ""
    for text in TEXTS:
        if text:
            assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == (prefix + text).encode(), text


def _render_reference(reference, chat, **kwargs):
    try:
        return reference.apply_chat_template(chat, tokenize=False, **kwargs)
    except Exception as exc:          # noqa: BLE001 - the template raised: kvhive must refuse too
        return exc


@pytest.mark.parametrize("name", NAMES)
def test_chat_templates_render_as_transformers(built: dict[str, Built], name: str) -> None:
    b = built[name]
    reference = transformers.AutoTokenizer.from_pretrained(b.hf_dir)
    tools_cases = [None, TOOLS] if name in ("llama3", "qwen2.5", "qwen3") else [None]
    for tok in (Tokenizer.from_model_path(b.gguf), Tokenizer.from_model_path(b.hf_dir)):
        for chat in CHATS:
            for generation in (True, False):
                for tools in tools_cases:
                    expected = _render_reference(reference, chat, add_generation_prompt=generation, tools=tools)
                    if isinstance(expected, Exception):
                        with pytest.raises(ChatTemplateError):
                            tok.apply_chat_template(chat, generation, tools=tools)
                        continue
                    assert tok.apply_chat_template(chat, generation, tools=tools) == expected, (chat, tools)
                    assert tok.encode_chat(chat, generation, tools=tools) == reference.encode(
                        expected, add_special_tokens=False)


@pytest.mark.parametrize("source", ["gguf", "hf_dir"])
@pytest.mark.parametrize("name", NAMES)
def test_gateway_gives_the_engine_ids(built: dict[str, Built], name: str, source: str) -> None:
    engine = Tokenizer.from_model_path(getattr(built[name], source))
    gateway = PromptTokenizer(Tokenizer.from_model_path(getattr(built[name], source)), chunk_chars=16)
    try:
        long_texts = [" ".join(TEXTS) * 2, "word " * 200, "Привет мир " * 30]
        for text in [*TEXTS, *long_texts]:
            if text:
                assert gateway.token_ids(Prompt(text=text)) == engine.encode(text, add_special_tokens=True), text
                assert gateway.token_ids(Prompt(text=text, add_special_tokens=False)) == engine.encode(text), text
        for chat in CHATS[:1] + CHATS[2:]:
            messages = chat_messages(chat)
            assert gateway.token_ids(Prompt(messages=messages)) == engine.encode_chat(chat), chat
    finally:
        gateway.close()


def _llama_cpp_split(regexes: tuple[str, ...], text: str) -> list[str]:
    """llama.cpp's split: each regex in turn cuts every piece into its matches and what lies between."""
    import regex

    pieces = [text]
    for pattern in regexes:
        cut = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                cut += [piece[pos:m.start()]] if m.start() > pos else []
                cut += [m.group()] if m.end() > m.start() else []
                pos = m.end()
            cut += [piece[pos:]] if pos < len(piece) else []
        pieces = cut
    return pieces


def test_each_pre_tokenizer_name_splits_as_llama_cpp() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    spell = bytes_to_unicode()
    for pre, rule in PRE_TOKENIZER_RULES.items():
        pre_tokenizer = gguf_pre_tokenizer(pre)[0]
        for text in TEXTS:
            got = [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]
            expected = ["".join(spell[b] for b in p.encode()) for p in _llama_cpp_split(rule.regexes, text)]
            assert got == expected, (pre, text)
            if pre in GGUF_PRE_TOKENIZER_SPLITS:    # transformers' own table agrees where it has the name
                theirs = _llama_cpp_split((GGUF_PRE_TOKENIZER_SPLITS[pre],), text)
                assert got == ["".join(spell[b] for b in p.encode()) for p in theirs], (pre, text)


@pytest.mark.parametrize(("name", "change", "field"), [
    ("llama3", {"model": "bert"}, "tokenizer.ggml.model"),
    ("mistral", {"model": "t5"}, "tokenizer.ggml.model"),
    ("llama3", {"pre": "made-up"}, "tokenizer.ggml.pre"),
    ("qwen2.5", {"pre": "deepseek-llm"}, "tokenizer.ggml.pre"),
    ("mistral", {"omit": ("tokenizer.ggml.scores",)}, "tokenizer.ggml.scores"),
    ("llama3", {"omit": ("tokenizer.ggml.merges",)}, "tokenizer.ggml.merges"),
])
def test_unsupported_tokenizer_fields_are_refused(built: dict[str, Built], tmp_path, name: str,
                                                  change: dict, field: str) -> None:
    b = built[name]
    family = dataclasses.replace(b.family, pre=change["pre"]) if "pre" in change else b.family
    path = write_gguf(family, b.vocab, tmp_path / "bad.gguf", model=change.get("model"),
                      omit=change.get("omit", ()))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as exc:
        Tokenizer.from_model_path(path)
    assert os.fspath(path) in str(exc.value)


def test_sentencepiece_with_a_pre_tokenizer_is_refused(built: dict[str, Built], tmp_path) -> None:
    import gguf

    b = built["mistral"]
    path = write_gguf(b.family, b.vocab, tmp_path / "spm.gguf")
    reader_fields = {k: v for k, v in gguf.GGUFReader(path).fields.items()}
    assert "tokenizer.ggml.pre" not in reader_fields
    writer = gguf.GGUFWriter(os.fspath(tmp_path / "spm_pre.gguf"), "llama")
    for key, field in reader_fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    writer.add_tokenizer_pre("llama-bpe")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre 'llama-bpe'"):
        Tokenizer.from_model_path(os.fspath(tmp_path / "spm_pre.gguf"))
