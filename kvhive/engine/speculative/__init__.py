"""Speculative decoding: a decode step drafts tokens, the target model verifies them in one pass.

``ngram_index``: the prompt-lookup drafter's incremental n-gram index over one request's tokens;
``tenant_history``: the "history" drafter's per-tenant store of finished requests' tokens;
``draft_length``: each request's draft length, adapted to its acceptance; ``draft_proposals``: the
scheduler's side (which requests draft, what, and the counters); ``draft_verification``: the
runner's side (accepting drafts against the target model's tokens). See docs/speculative_decoding.md.
"""
