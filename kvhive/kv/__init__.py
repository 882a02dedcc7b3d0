"""Paged KV cache: block pool and KV cache manager (torch-free)."""
