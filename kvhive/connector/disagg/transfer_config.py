"""How an instance takes part in disaggregated serving: its role and its transfer endpoint."""

from __future__ import annotations

from dataclasses import dataclass

from kvhive.core.flag_values import json_flag_object

ROLES = ("prefill", "decode", "both")
MAX_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-role`` and ``--kv-transfer-config``: the role, where a decode instance listens,
    how long a decode waits for a silent transfer, and how many bytes it buffers."""

    role: str = "both"
    host: str = "0.0.0.0"                  # decode: the address the transfer endpoint binds
    port: int = 0                          # decode: the transfer port (0: any free port)
    timeout_s: float = 10.0                # decode: a transfer silent this long fails (recompute)
    buffer_bytes: int = 1 << 30            # decode: KV held for transfers not yet claimed
    unclaimed_ttl_s: float = 120.0         # decode: a finished transfer nobody claims is dropped

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--kv-role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"kv transfer port must be in [0, 65535], got {self.port}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"kv transfer timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {self.timeout_s}")
        if self.buffer_bytes <= 0:
            raise ValueError(f"kv transfer buffer_bytes must be positive, got {self.buffer_bytes}")
        if not 0 < self.unclaimed_ttl_s <= 3600:
            raise ValueError(f"kv transfer unclaimed_ttl_s must be in (0, 3600], got {self.unclaimed_ttl_s}")

    @property
    def disaggregated(self) -> bool:
        """True for a prefill or decode instance (``both`` serves whole requests as before)."""
        return self.role != "both"


_JSON_FIELDS = {"kv_role": "role", "kv_ip": "host", "kv_port": "port", "timeout_s": "timeout_s",
                "buffer_bytes": "buffer_bytes", "unclaimed_ttl_s": "unclaimed_ttl_s"}


def parse_kv_transfer_config(text: str | None, role: str | None, port: int | None) -> KVTransferConfig:
    """The config from ``--kv-transfer-config`` JSON (vLLM-like names: kv_role, kv_ip, kv_port,
    timeout_s, buffer_bytes, unclaimed_ttl_s) and the ``--kv-role`` / ``--kv-transfer-port`` flags,
    which win; ValueError naming a bad field."""
    values: dict = {}
    if text:
        raw = json_flag_object("--kv-transfer-config", text)
        unknown = sorted(set(raw) - set(_JSON_FIELDS))
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown field {unknown[0]!r} "
                             f"(known: {', '.join(_JSON_FIELDS)})")
        values = {_JSON_FIELDS[k]: v for k, v in raw.items()}
    if role is not None:
        values["role"] = role
    if port is not None:
        values["port"] = port
    for name, kind in (("port", int), ("buffer_bytes", int), ("timeout_s", (int, float)),
                       ("unclaimed_ttl_s", (int, float)), ("role", str), ("host", str)):
        if name in values and (not isinstance(values[name], kind) or isinstance(values[name], bool)):
            raise ValueError(f"--kv-transfer-config: {name} has the wrong type: {values[name]!r}")
    return KVTransferConfig(**values)
