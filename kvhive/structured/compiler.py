"""``GrammarCompiler``: a ``StructuredSpec`` compiled once into a ``CompiledGrammar`` (a bounded
LRU keyed by the spec, failures included), and the ``GrammarMatcher`` each request decodes under.

What bounds a compile: the spec's text (``grammars.MAX_SPEC_CHARS``), llguidance's own limits
(``LIMITS``: lexer fuel for the regexes, grammar size, Earley items per step), which turn a huge,
deeply nested or pathological schema or regex into an error instead of unbounded work, and a wall
time (``COMPILE_TIME_LIMIT_S``): a compile that takes longer is a failure (cached like any other),
and ``EngineClient.check_structured`` stops waiting for it then. The limits do not bound every
shape (the lexer of a schema with thousands of ``pattern`` properties takes seconds to build), the
wall time does. A ``$ref`` cycle or any grammar that admits no output fails at the first token mask,
which compiling computes. A mask step that runs out of fuel later puts that request's matcher in
an error state.

Threads: ``compile`` runs on any thread (the server calls it off its event loop) and llguidance
drops the GIL while it works; the cache's lock is never held while compiling. A matcher belongs to
one request and is used by one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvhive.core.structured_spec import StructuredSpec
from kvhive.core.tokenizer import Tokenizer
from kvhive.structured.errors import StructuredOutputError
from kvhive.structured.grammars import grammar_text
from kvhive.structured.vocab import ll_tokenizer, special_token_texts

# Distinct specs kept compiled (a compiled grammar is its text and one matcher: kilobytes to a few MB).
DEFAULT_CACHE_SIZE = 256
# llguidance's parser limits (its defaults, spelled out; verbose errors off so that an error names
# the problem without echoing the whole grammar back).
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
              verbose_errors=False)
# What llguidance's errors say when one of LIMITS is reached (its error state has no kind of its
# own: ``stop_reason`` reads "InternalError" for all of them).
LIMIT_ERRORS = ("max is", "too many", "fuel", "too big", "limit")
# A compile that takes longer than this (seconds) is refused; an ordinary schema takes milliseconds.
COMPILE_TIME_LIMIT_S = 2.0


class GrammarMatcher:
    """One request's position in its grammar: fills its token bitmask, accepts the sampled token."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and an error state from then on) when the grammar rejects it."""
        return self._m.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (drafts looked ahead over)."""
        if num_tokens:
            self._m.rollback(num_tokens)

    @property
    def is_complete(self) -> bool:
        """True when the output is done: the grammar admits nothing more (or only end-of-sequence was
        left and it was taken)."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state (a rejected token, a step out of fuel), or None."""
        return self._m.get_error() if self._m.is_error() else None

    @property
    def hit_limit(self) -> bool:
        """Whether its error is one of ``LIMITS`` reached (items in a row, lexer states or fuel,
        grammar size), not a token refused or no token left."""
        error = self.error
        return error is not None and any(mark in error for mark in LIMIT_ERRORS)

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32 words, bit i of word w = token 32w + i)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @property
    def raw(self):
        """The llguidance matcher itself (the tests fill masks through the library's own batch call with it)."""
        return self._m


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec's grammar, checked: the template every request's matcher is copied from."""

    spec: StructuredSpec
    grammar: str
    _template: object

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (a copy of the template: microseconds)."""
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles specs for one model's vocabulary, each distinct spec once (LRU of ``cache_size``)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, time_limit_s: float = COMPILE_TIME_LIMIT_S) -> None:
        """``vocab_size``: the model's logits width (masks cover it and the tokenizer's vocabulary);
        ``time_limit_s``: the longest a compile may take before its spec is refused."""
        if cache_size < 1:
            raise ValueError(f"the grammar cache needs at least 1 entry, got {cache_size}")
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.time_limit_s = time_limit_s
        self._lock = threading.Lock()          # the cache and the counters
        self._setup_lock = threading.Lock()    # the vocabulary, built once
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._lltok = None              # built on first use: 0.1 s for a 49k vocabulary, ~1 s for 150k
        self._special: dict[str, int] = {}
        self.hits = self.misses = 0

    @property
    def mask_words(self) -> int:
        """int32 words in one token bitmask."""
        return (self.vocab_size + 31) // 32

    def cached(self, spec: StructuredSpec) -> CompiledGrammar | None:
        """The compiled grammar of ``spec`` if the cache holds it (None if not; microseconds, any
        thread); raises the cached StructuredOutputError of a spec that failed."""
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
        if isinstance(found, StructuredOutputError):
            raise StructuredOutputError(found.message, found.param)     # a fresh one: no traceback piles up
        return found

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache when it was compiled before; raises
        StructuredOutputError (also cached) when it cannot be served."""
        found = self.cached(spec)
        if found is None:
            found = self._compile(spec)
            with self._lock:
                self.misses += 1
                self._cache[spec] = found
                self._cache.move_to_end(spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(found, StructuredOutputError):
            raise StructuredOutputError(found.message, found.param)
        return found

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar | StructuredOutputError:
        try:
            import llguidance
        except ImportError:
            return StructuredOutputError("structured outputs need the llguidance package "
                                         "(pip install 'kvhive[server]')", spec.source)
        lltok = self._ll_tokenizer()
        started = time.perf_counter()
        try:
            grammar = grammar_text(spec, self._special)
        except StructuredOutputError as exc:
            return exc
        template = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        error = template.get_error() if template.is_error() else None
        if error is None:
            # The first mask: a grammar that admits no output ($ref cycles) fails here, not mid-request.
            probe = template.deep_copy()
            row = np.zeros(self.mask_words, dtype=np.int32)
            probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            error = probe.get_error() if probe.is_error() else (None if row.any() else "NoExtension")
        if error is not None:
            return StructuredOutputError(f"the {spec.kind} constraint cannot be used: {_explain(error)}",
                                         spec.source)
        elapsed = time.perf_counter() - started
        if elapsed > self.time_limit_s:
            return StructuredOutputError(f"compiling the {spec.kind} constraint took {elapsed:.1f} s; the limit "
                                         f"is {self.time_limit_s:g} s", spec.source)
        return CompiledGrammar(spec, grammar, template)

    def _ll_tokenizer(self):
        with self._setup_lock:
            if self._lltok is None:
                self._lltok = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._special = special_token_texts(self.tokenizer)
            return self._lltok


def _explain(error: str) -> str:
    """llguidance's error in words a client can act on."""
    if error.startswith("NoExtension"):
        return "its grammar admits no output (a $ref cycle, or constraints nothing satisfies)"
    return " ".join(line.strip() for line in error.splitlines() if line.strip())[:500]
