"""The routing library: which replica should answer a request, from the KV blocks each one holds
(torch-free). The ``kvhive gateway`` process (``kvhive.gateway``) and the Ray integration
(``kvhive.integrations.ray``) both build on it; it imports neither.

One module per concept, as in llm-d's kv-cache manager: ``index`` (which replica holds which block),
``ingest`` (KV events -> index, one subscriber per replica), ``block_keys`` (a replica's block
hashes -> kvhive block keys), ``prompts`` (request body -> token ids, with a prefix store and a
tokenizer pool), ``indexer`` (tokens -> block keys -> lookup -> KV scores), ``scorer`` (scoring
policies and the pick), ``affinity`` (session, response and prompt_cache_key -> replica),
``redis_link`` (the Redis several front doors share) and ``dialects`` (a path's API dialect and
the errors in its shape). The KV events themselves are ``kvhive.core.kv_events``.
"""
