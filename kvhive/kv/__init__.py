"""Paged KV cache (torch-free), one module per concept.

- ``pool``: the device blocks, their ref counts, the prefix-cache map and the free queue
  (``free_queue``: the eviction order; ``pool_invariants``: its invariants, checked).
- ``manager``: ``KVCacheManager``, per-request block tables and chained-hash prefix caching,
  composing ``session_holdings`` (blocks sessions keep between requests) and ``partial_copies``
  (partial-block reuse from a cached sibling).
- ``window_group``: the window layers' own pool and tables; ``retention_policy``: retention
  priorities of freed blocks; ``held_blocks``: events for the blocks a reset keeps.
- ``tier_events``: KV events for what the store tiers hold.
"""
