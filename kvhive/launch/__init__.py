"""How a replica is put together, in one place: ``build_replica`` (``replica.py``) opens the durable
state once, hands its KV tiers to the engine and its record backends to the session service and the
Responses API (``services.py``), and wraps it all in the HTTP app. ``kvhive serve`` and the Ray
replica both start here.
"""
