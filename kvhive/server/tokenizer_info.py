"""``GET /tokenizer_info`` (vLLM's endpoint, served with ``--enable-tokenizer-info-endpoint``): the
tokenizer's settings in the keys of a Hugging Face ``tokenizer_config.json``, so a client that renders
prompts itself (a training or evaluation harness) uses the server's chat template and special tokens.
"""

from __future__ import annotations

from typing import Any

from kvhive.core.tokenizer import Tokenizer

# kvhive tokenizes with the ``tokenizers`` library, as transformers' fast tokenizer does.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's settings: its class, context length, chat template (None without one), each
    named special token (``bos_token``, ``eos_token``, ...), and the ids generation stops on."""
    template = tokenizer.chat_template
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "model_max_length": max_model_len,
        "chat_template": None if template is None else template.source,
        **tokenizer.special_tokens,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "vocab_size": tokenizer.vocab_size,
    }
