"""A tiny-model replica that can be made sick while its /health stays 200 (``serve_faulty
--fault-mode``): its POSTs answered with garbage, 500s, or never."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from support.cluster import TinyReplica
from support.servers import TINY_MAX_MODEL_LEN, serve_command


@dataclass
class SickReplica(TinyReplica):
    """The tiny-model test server behind ``serve_faulty.FaultModes``, starting in ``mode``."""

    mode: str = "none"

    def start(self) -> None:
        """Start it (not waiting for it)."""
        self._start("sick-replica", serve_command("tiny", self.port, "--max-model-len", str(TINY_MAX_MODEL_LEN),
                                                  "--fault-mode", self.mode))

    def set_mode(self, mode: str) -> None:
        """Switch its fault mode while it runs: none, garbage, 500 or hang."""
        response = httpx.put(f"{self.url}/fault-mode", content=mode, timeout=10)
        assert response.status_code == 200, response.text
        self.mode = mode
