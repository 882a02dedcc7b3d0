"""A SessionRegistry without a model: fake block hashes, recorders of the pins and forks it (and a
SessionService) asks for, and sessions one turn old."""

from __future__ import annotations

from kvhive.config import SessionConfig
from kvhive.sessions.registry import Session, SessionRegistry

BLOCK_SIZE, BLOCK_BYTES = 16, 8192
CONFIG = SessionConfig(max_ttl_s=3600, max_pinned_gb=None)       # no per-key KV limit unless a test sets one


def hashes(prefix: str, n: int) -> list[str]:
    """``n`` distinct 32-hex-digit block hashes starting with ``prefix``."""
    return [f"{prefix}{i:04x}".ljust(32, "0") for i in range(n)]


class Pins:
    """Records what the registry asks the engine to pin (``on_load``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, session: Session) -> None:
        self.calls.append((session.engine_id, list(session.block_hashes)))


class Holder:
    """Records what a SessionService asks the engine to hold and release."""

    def __init__(self) -> None:
        self.held: list[tuple[str, list[bytes]]] = []
        self.released: list[str] = []
        self.forked: list[tuple[str, str, int]] = []

    def hold_session(self, session_id: str, block_hashes) -> None:
        self.held.append((session_id, list(block_hashes)))

    def release_session(self, session_id: str) -> None:
        self.released.append(session_id)

    async def fork_session(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        self.forked.append((parent_id, child_id, num_tokens))
        return num_tokens // BLOCK_SIZE * BLOCK_SIZE


def registry(backend=None, keeper=None, pins=None, config=CONFIG) -> SessionRegistry:
    """A registry over ``backend`` (none: in memory only) with the test block geometry."""
    return SessionRegistry(config, BLOCK_BYTES, BLOCK_SIZE, backend=backend, keeper=keeper, on_load=pins)


def run_turn(reg: SessionRegistry, owner: str | None, blocks: list[str], ttl: int = 600,
             session_id: str | None = None) -> Session:
    """Create a session and end its first turn holding ``blocks``."""
    session = reg.create(owner, "m", ttl, session_id=session_id)
    reg.end_turn(session, len(blocks) * BLOCK_SIZE + 3, blocks)
    return session
