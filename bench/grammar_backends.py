#!/usr/bin/env python3
"""Which grammar library kvhive decodes under: xgrammar against llguidance, measured on this CPU.

    python bench/grammar_backends.py            # prints a table, writes bench/results/grammar_backends.json

xgrammar is no dependency of kvhive: install it (``pip install xgrammar==0.2.8``) to compare.

For the default model's vocabulary (SmolLM2, 49,152 tokens, read through kvhive's own Tokenizer)
and a Qwen-sized one (151,936 tokens: SmolLM2's plus byte strings joined from pairs of its tokens,
so the token trie has a real shape), and for three JSON schemas (a small object, a nested object
with arrays and enums, an anyOf over 20 tool calls) and one regex, it times:

- tokenizer setup: the library's vocabulary object built once per model;
- compile: from the schema text to a grammar the first request can use (xgrammar's
  ``compile_json_schema``; llguidance's grammar text, validation and an ``LLMatcher``), then the
  first mask (llguidance builds its lexer lazily, so its first mask carries part of the work);
- per-token mask: the mean, p50 and max time to fill one token bitmask while a matcher walks the
  tokens of a valid instance (kvhive's tokenization of it), accepting each token.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import run_info  # noqa: E402

from kvhive.core.model_files import default_model_path  # noqa: E402
from kvhive.core.tokenizer import Tokenizer  # noqa: E402

RESULT = os.path.join(HERE, "results", "grammar_backends.json")
QWEN_VOCAB = 151_936


def _tool(i: int) -> dict:
    props = {f"arg{j}": {"type": ["string", "integer", "boolean", "number"][j % 4]} for j in range(1 + i % 5)}
    props["unit"] = {"enum": ["celsius", "fahrenheit", "kelvin"]}
    return {"type": "object", "properties": {
        "name": {"const": f"tool_{i}"},
        "arguments": {"type": "object", "properties": props, "required": sorted(props),
                      "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}


SCHEMAS = {
    "small_object": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False},
    "nested_arrays_enums": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0}, "email": {"type": "string", "maxLength": 64},
            "role": {"enum": ["admin", "editor", "viewer"]}}, "required": ["id", "email", "role"]},
        "items": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer"},
            "price": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["sku", "qty", "price"]}},
        "status": {"enum": ["open", "paid", "shipped"]}}, "required": ["user", "items", "status"]},
    "tools20_anyof": {"anyOf": [_tool(i) for i in range(20)]},
}
INSTANCES = {
    "small_object": {"name": "Ada Lovelace", "age": 36},
    "nested_arrays_enums": {"user": {"id": 7, "email": "ada@example.com", "role": "editor"},
                            "items": [{"sku": "ABC-1234", "qty": 2, "price": 9.5, "tags": ["red", "big"]},
                                      {"sku": "XYZ-0001", "qty": 1, "price": 120.0, "tags": []}],
                            "status": "paid"},
    "tools20_anyof": {"name": "tool_13", "arguments": {"arg0": "Paris", "arg1": 3, "arg2": True, "arg3": 1.5,
                                                       "unit": "celsius"}},
}
REGEX = (r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}", "2024-05-17T09:30")


def vocabularies(tok: Tokenizer) -> dict[str, tuple[list[bytes], set[int]]]:
    """name -> (token bytes, special ids): the default model's and a Qwen-sized synthetic one."""
    special = {i for i, t in tok._backend.get_added_tokens_decoder().items() if t.special}
    base = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    rng = random.Random(0)
    plain = [b for i, b in enumerate(base) if i not in special and b]
    seen, big = set(base), list(base)
    while len(big) < QWEN_VOCAB:
        joined = rng.choice(plain) + rng.choice(plain)
        if joined not in seen:
            seen.add(joined)
            big.append(joined)
    return {f"smollm2_{len(base)}": (base, special), f"synthetic_{len(big)}": (big, special)}


class _Encoder:
    """What llguidance's TokenizerWrapper asks of a tokenizer."""

    def __init__(self, tok: Tokenizer, tokens: list[bytes], special: set[int]) -> None:
        self.tok, self.tokens = tok, [b"\xff" + b if i in special else b for i, b in enumerate(tokens)]
        self.eos_token_id, self.bos_token_id = tok.eos_token_ids[0], tok.bos_token_id
        self.special_token_ids = sorted(special)

    def __call__(self, text: bytes) -> list[int]:
        return self.tok.encode(text.decode("utf-8", errors="replace"))


def bench_llguidance(tok: Tokenizer, tokens: list[bytes], special: set[int]) -> dict:
    import llguidance
    import llguidance.numpy as llnp

    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Encoder(tok, tokens, special)))
    out: dict = {"tokenizer_setup_ms": (time.perf_counter() - started) * 1e3, "grammars": {}}
    mask = llnp.allocate_token_bitmask(1, len(tokens))
    for name, grammar, text in _grammars():
        started = time.perf_counter()
        if name == "regex":
            g = llguidance.LLMatcher.grammar_from_regex(grammar)
        else:
            g = llguidance.LLMatcher.grammar_from_json_schema(grammar)
        err = llguidance.LLMatcher.validate_grammar(g, lltok)
        assert not err, err
        matcher = llguidance.LLMatcher(lltok, g, log_level=0)
        compiled = time.perf_counter()
        llnp.fill_next_token_bitmask(matcher, mask)
        first = time.perf_counter()
        times = []
        for t in tok.encode(text):
            s = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - s)
            assert matcher.consume_token(t), matcher.get_error()
        assert matcher.is_accepting()
        started_copy = time.perf_counter()
        llguidance.LLMatcher(lltok, g, log_level=0)
        again = time.perf_counter() - started_copy
        out["grammars"][name] = _figures(compiled - started, first - compiled, times) | {
            "second_matcher_ms": again * 1e3}
    return out


def bench_xgrammar(tok: Tokenizer, tokens: list[bytes], special: set[int]) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo([b"" if i in special else b for i, b in enumerate(tokens)],
                             xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[tok.eos_token_ids[0]])
    compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
    out: dict = {"tokenizer_setup_ms": (time.perf_counter() - started) * 1e3, "grammars": {}}
    mask = xgr.allocate_token_bitmask(1, len(tokens))
    for name, grammar, text in _grammars():
        started = time.perf_counter()
        compiled = (compiler.compile_regex(grammar) if name == "regex"
                    else compiler.compile_json_schema(grammar, any_whitespace=True))
        matcher = xgr.GrammarMatcher(compiled)
        done = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        first = time.perf_counter()
        times = []
        for t in tok.encode(text):
            s = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - s)
            assert matcher.accept_token(t)
        out["grammars"][name] = _figures(done - started, first - done, times)
    return out


def _grammars():
    for name, schema in SCHEMAS.items():
        yield name, json.dumps(schema), json.dumps(INSTANCES[name])
    yield "regex", REGEX[0], REGEX[1]


def _figures(compile_s: float, first_s: float, times: list[float]) -> dict:
    us = [t * 1e6 for t in times]
    return {"compile_ms": compile_s * 1e3, "first_mask_ms": first_s * 1e3, "tokens": len(us),
            "mask_mean_us": statistics.fmean(us), "mask_p50_us": statistics.median(us), "mask_max_us": max(us)}


def install_weight() -> dict:
    """Import time of each library in a fresh interpreter, and what it pulls in."""
    import subprocess

    out = {}
    for lib in (n for n in ("llguidance", "xgrammar") if importlib.util.find_spec(n) is not None):
        code = f"import time,sys; s=time.perf_counter(); import {lib}; print(time.perf_counter()-s, 'torch' in sys.modules, 'triton' in sys.modules)"
        secs, torch_in, triton_in = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout.split()
        out[lib] = {"import_s": float(secs), "imports_torch": torch_in == "True", "imports_triton": triton_in == "True"}
    return out


def main() -> None:
    tok = Tokenizer.from_model_path(default_model_path())
    record = {"machine": run_info.machine(), "command": run_info.command(__file__), "install": install_weight(),
              "vocabularies": {}}
    has_xgrammar = importlib.util.find_spec("xgrammar") is not None
    if not has_xgrammar:
        print("xgrammar is not installed (it is no dependency of kvhive): pip install xgrammar==0.2.8 to compare")
    for vocab, (tokens, special) in vocabularies(tok).items():
        record["vocabularies"][vocab] = {"llguidance": bench_llguidance(tok, tokens, special)}
        if has_xgrammar:
            record["vocabularies"][vocab]["xgrammar"] = bench_xgrammar(tok, tokens, special)
    for vocab, libs in record["vocabularies"].items():
        print(vocab)
        for lib, r in libs.items():
            print(f"  {lib}: tokenizer setup {r['tokenizer_setup_ms']:.0f} ms")
            for g, f in r["grammars"].items():
                print(f"    {g:22s} compile {f['compile_ms']:8.1f} ms  first mask {f['first_mask_ms']:7.2f} ms  "
                      f"mask mean {f['mask_mean_us']:7.1f} us  p50 {f['mask_p50_us']:7.1f}  max {f['mask_max_us']:8.1f}")
    print(json.dumps(record["install"]))
    with open(RESULT, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
