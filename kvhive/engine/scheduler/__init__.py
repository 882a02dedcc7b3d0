"""The scheduler (torch-free): continuous batching with chunked prefill, preemption by recompute,
session spill, KV-connector transfers and prompt-logprobs spans, one module per policy.

- ``queues``: the waiting queue and running list every unit works on.
- ``batching``: the step's token budget, running requests' decodes and chunks, FCFS admission.
- ``preemption``: which running request gives way when blocks run out, and how.
- ``session_spill``: releasing idle sessions' blocks under pressure (``SessionCopy``).
- ``transfers``: the connector's scheduler-side state (lookups, loads, saves, held blocks).
- ``prompt_logprobs``: which prompt rows each chunk reports.
- ``sampling_inputs``: the token history of penalties and the tokens ``min_tokens`` suppresses.
- ``core``: ``Scheduler``, which composes them and applies each step's results.
"""

from __future__ import annotations

from kvhive.engine.scheduler.scheduler import Scheduler, SchedulerStats
from kvhive.engine.scheduler.session_spill import SessionCopy, TierSessionCopy

__all__ = ["Scheduler", "SchedulerStats", "SessionCopy", "TierSessionCopy"]
