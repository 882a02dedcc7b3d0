"""The ``kvhive gateway``: KV-aware routing across replicas (never imports torch).

One module per concept, as in llm-d's kv-cache manager: ``index`` (which replica holds which block),
``ingest`` (KV events -> index), ``tokenize`` (request body -> token ids, with a prefix store),
``indexer`` (tokens -> block keys -> lookup -> KV scores), ``scorer`` (scoring policies and the pick),
``replicas`` (health and load), ``sessions`` (session -> replica), ``proxy`` (forwarding),
``gateway`` (the routing decision), ``metrics``, ``config``, ``app`` and ``cli``.
"""
