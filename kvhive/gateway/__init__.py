"""The ``kvhive gateway`` process: an OpenAI-compatible proxy that routes each request to a replica
with the routing library (``kvhive.routing``); never imports torch, and runs without the server
extra.

``cli`` (flags and entry point), ``gateway_config`` (its frozen config), ``wiring`` (its parts built
from the config), ``app`` (the routes), ``gateway`` (the routing decision and the forwarding of one
request), ``pd`` (disaggregated prefill/decode routing), ``proxy`` (relaying an answer) over
``upstream`` (the lean HTTP/1.1 client), ``replicas`` (health and load from each replica's
/metrics), ``discovery`` (replicas registered in Redis), ``outlier`` (ejecting failing replicas),
``event_watch`` (replicas whose KV events never arrive), ``tokenize_api`` (its /tokenize and
/detokenize) and ``metrics``.
"""
