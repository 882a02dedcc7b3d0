"""The model's kvhive ``Tokenizer`` as llguidance's tokenizer: each id's exact bytes
(``Tokenizer.token_bytes``), special tokens marked as llguidance marks them (a leading 0xFF byte:
they never match grammar text, only a grammar's ``<[id]>``), and the end-of-sequence ids."""

from __future__ import annotations

from collections.abc import Sequence

from kvhive.core.tokenizer import Tokenizer

# llguidance reads a token whose bytes start with this byte as a special token.
SPECIAL_MARK = b"\xff"


class _VocabView:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        special = set(tokenizer.special_token_ids)
        n = max(vocab_size, tokenizer.vocab_size)
        # Ids past the tokenizer's vocabulary (a model's padded embedding rows) stand for nothing.
        self.tokens = [SPECIAL_MARK + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
                       for i in range(n)]
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"))


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """An ``llguidance.LLTokenizer`` over ``vocab_size`` ids (at least the tokenizer's own), whose
    end-of-sequence ids are ``eos_token_ids`` (ValueError when there are none)."""
    import llguidance

    if not eos_token_ids:
        raise ValueError("constrained decoding needs the model's end-of-sequence token ids")
    view = _VocabView(tokenizer, vocab_size, eos_token_ids)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=len(view.tokens),
                                  eos_token=list(eos_token_ids))


def special_token_texts(tokenizer: Tokenizer) -> dict[str, int]:
    """The vocabulary's special tokens by their text."""
    return {tokenizer.token_bytes(i).decode("utf-8", errors="replace"): i for i in tokenizer.special_token_ids}
