"""``FailureLog``: a failure that may repeat many times a second, logged once per interval with a count.

The first failure is logged at once; later ones are counted and logged at the first failure after
``interval_s`` has passed since the last line, as one line with how many failed since then and the
last error. ``total`` counts every failure, for metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 30.0


class FailureLog:
    """Counts failures of one kind and logs them once per ``interval_s`` (thread-safe)."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"failure log interval must be >= 0, got {interval_s}")
        self.logger = logger
        self.what = what                   # e.g. "disk tier: block writes failed"
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0                     # every failure since start
        self._lock = threading.Lock()
        self._unlogged = 0                 # failures since the last line
        self._last_line: float | None = None

    def record(self, error: BaseException | str) -> None:
        """Count one failure; log a line if none was logged in the last ``interval_s``."""
        with self._lock:
            self.total += 1
            self._unlogged += 1
            now = self.clock()
            if self._last_line is not None and now - self._last_line < self.interval_s:
                return
            count, self._unlogged, since = self._unlogged, 0, self._last_line
            self._last_line = now
        window = "" if since is None else f" in the last {now - since:.0f} s"
        self.logger.warning("%s: %d%s (last error: %s)", self.what, count, window, error)
