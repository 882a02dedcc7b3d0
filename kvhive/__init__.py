"""kvhive: an LLM inference server whose KV cache is a long-lived, shared, tiered resource."""

__version__ = "0.1.0"
