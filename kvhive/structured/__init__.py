"""Constrained decoding's grammar side, torch-free, on the llguidance library.

- ``errors.py``: ``StructuredOutputError``, the one error a spec that cannot be served raises.
- ``grammars.py``: a ``StructuredSpec`` as the grammar text llguidance reads (JSON schema, regex,
  choice, Lark, tool calls), with the size bound every spec's text is held to.
- ``vocab.py``: the model's kvhive ``Tokenizer`` as llguidance's tokenizer (token bytes, special
  tokens, end-of-sequence ids).
- ``compiler.py``: ``GrammarCompiler``, spec -> ``CompiledGrammar`` once per distinct spec (a
  bounded LRU), and the per-request ``GrammarMatcher`` that fills token bitmasks and accepts tokens.
"""

from kvhive.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarMatcher
from kvhive.structured.errors import StructuredOutputError

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "StructuredOutputError"]
