"""Disaggregated prefill and decode: a prefill instance pushes a request's KV to a decode instance.

``config`` (roles and endpoints), ``params`` (the request's ``kv_transfer_params``), ``wire``
(framing, checked like a store record), ``transport`` (the TCP channel), ``scheduler`` and
``worker`` (the two connector halves). docs/disaggregation.md describes the protocol.
"""
