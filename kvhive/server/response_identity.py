"""What names a response apart from its content: a fresh id (also its engine request's id) and the
time it was created."""

from __future__ import annotations

import time
import uuid


def new_request_id(prefix: str) -> str:
    """A fresh response id, also used as the engine request id (unique per request)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_time() -> int:
    """``created`` field value."""
    return int(time.time())
