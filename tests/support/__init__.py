"""The machinery the tests share; a test module imports these, never another test module.

- ``servers``: the test server as a subprocess on a free port (``start_server``, ``stop_server``,
  ``kill_server``), the fault markers it understands, the log files of every subprocess, and small
  polling helpers (``wait_until``, ``healthy``, ``free_port``).
- ``serve_faulty``: the script that server process runs (the tiny or the default model, optionally
  with injected faults).
- ``kvhive_serve``: ``kvhive serve`` itself on the default model, for the tier and restart tests.
- ``redis_server``: a real ``redis-server`` subprocess the test can stop, pause and restart.
- ``cluster``: replicas (default model or tiny) and a ``kvhive gateway`` in front of them.
- ``api``: requests that must succeed, hostile bodies, and the check of OpenAI's error shape.
- ``tiny``: a tiny random-weight Llama and its dense reference forward.
- ``engines``, ``runners``: the tiny model in an engine or a bare runner, driven in process.
- ``sessions``, ``responses``, ``scheduler_parts``: model-free building blocks for the session
  registry's, the stored responses' and the scheduler's tests.
- ``tier_sinks``: a store-tier event sink that records what it hears and the view it builds.

Fixtures built on these live in ``tests/conftest.py``.
"""
