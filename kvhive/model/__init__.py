"""Llama-family model, weight loaders and attention over the paged KV cache."""
