"""Tiny random chat models that ``kvhive serve`` runs as it runs a real one: a transformers checkpoint
of a family (``support.families``) in a Hugging Face directory with that family's tokenizer, trained
at test time, and its published chat template (``support.tokenizer_families``).

Their answers are noise, so a test over them checks what the server guarantees whatever the model
says (a grammar keeps the output valid, a template renders the history), never the model's skill.
"""

from __future__ import annotations

import os

from support.families import hf_model, save_hf
from support.tokenizer_families import FAMILIES, build_vocab, write_hf_dir

# Model family (support.families) of each tokenizer family that has a servable chat model here.
MODEL_FAMILY = {"qwen3": "qwen3", "qwen2.5": "qwen2", "llama3": "llama", "mistral3": "mistral"}
MAX_POSITIONS = 4096


def tiny_chat_model(family: str, directory: str | os.PathLike[str], seed: int = 0) -> str:
    """A servable HF directory of ``family`` ("qwen3", "qwen2.5" or "llama3") in ``directory``."""
    tokenizer_family = next(f for f in FAMILIES if f.name == family)
    vocab = build_vocab(tokenizer_family)
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    bos = ids[tokenizer_family.bos] if tokenizer_family.bos else ids[tokenizer_family.eos]
    model = hf_model(MODEL_FAMILY[family], seed=seed, vocab_size=len(vocab.tokens),
                     max_position_embeddings=MAX_POSITIONS, bos_token_id=bos,
                     eos_token_id=ids[tokenizer_family.eos])
    save_hf(model, os.fspath(directory))
    return write_hf_dir(tokenizer_family, vocab, directory)
