"""A request's ``kv_transfer_params`` (the body field vLLM uses), validated once (torch-free).

A prefill request: ``{"do_remote_decode": true, "transfer_id": ID, "decode_endpoint": "HOST:PORT"}``;
its response carries ``{"do_remote_prefill": true, "transfer_id": ID, ...}`` for the decode request.
A decode request: ``{"do_remote_prefill": true, "transfer_id": ID}``, optionally with
``"prefill_cached_tokens": N``, the prompt tokens the prefill reused (its own prefix hits), so the
decode side reports what either side reused as ``cached_tokens``. Other keys (vLLM's
``remote_engine_id``, ``remote_block_ids`` ...) are accepted and ignored, up to ``MAX_KEYS``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MAX_KEYS = 16
MAX_TRANSFER_ID = 128
MAX_CACHED_TOKENS = 1 << 31
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:-]+")
_ENDPOINT = re.compile(r"(?P<host>[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:]{2,39}\]):(?P<port>[0-9]{1,5})")


class KVTransferParamsError(ValueError):
    """``kv_transfer_params`` is malformed; ``field`` names the bad key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class KVTransferParams:
    """One request's part in a transfer: it computes the prompt for a remote decode, or it decodes
    from a remote prefill's KV."""

    transfer_id: str
    do_remote_decode: bool = False          # prefill side: push the prompt's KV to decode_endpoint
    do_remote_prefill: bool = False         # decode side: the prompt's KV arrives from a prefill
    decode_endpoint: tuple[str, int] | None = None
    prefill_cached_tokens: int = 0          # decode side: prompt tokens the prefill reused

    def for_decode(self) -> dict[str, Any]:
        """The params a prefill response hands on to the decode request."""
        out: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                               "transfer_id": self.transfer_id}
        if self.decode_endpoint is not None:
            out["decode_endpoint"] = f"{self.decode_endpoint[0]}:{self.decode_endpoint[1]}"
        return out


def parse_endpoint(text: Any, field: str = "decode_endpoint") -> tuple[str, int]:
    """``"host:port"`` as (host, port); KVTransferParamsError naming ``field`` otherwise."""
    match = _ENDPOINT.fullmatch(text) if isinstance(text, str) else None
    if match is None or not 0 < int(match["port"]) <= 65535:
        raise KVTransferParamsError(field, f"kv_transfer_params.{field} must be \"host:port\"")
    return match["host"].strip("[]"), int(match["port"])


def parse_kv_transfer_params(raw: Any, role: str) -> KVTransferParams | None:
    """The params of a request body (None: absent, or neither flag set), checked against this
    instance's ``role``; KVTransferParamsError naming the bad key."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_KEYS:
        raise KVTransferParamsError("kv_transfer_params", f"kv_transfer_params must be an object of at "
                                    f"most {MAX_KEYS} keys")
    remote_decode, remote_prefill = raw.get("do_remote_decode", False), raw.get("do_remote_prefill", False)
    for name, flag in (("do_remote_decode", remote_decode), ("do_remote_prefill", remote_prefill)):
        if not isinstance(flag, bool):
            raise KVTransferParamsError(name, f"kv_transfer_params.{name} must be a boolean")
    if not (remote_decode or remote_prefill):
        return None
    if remote_decode and remote_prefill:
        raise KVTransferParamsError("do_remote_decode", "kv_transfer_params: a request is either the "
                                    "prefill (do_remote_decode) or the decode (do_remote_prefill)")
    wanted = "prefill" if remote_decode else "decode"
    if role != wanted:
        flag = "do_remote_decode" if remote_decode else "do_remote_prefill"
        raise KVTransferParamsError(flag, f"kv_transfer_params.{flag} needs an instance started with "
                                    f"--kv-role {wanted}; this one is --kv-role {role}")
    transfer_id = raw.get("transfer_id")
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID \
            or not _TRANSFER_ID.fullmatch(transfer_id):
        raise KVTransferParamsError("transfer_id", f"kv_transfer_params.transfer_id must be 1 to "
                                    f"{MAX_TRANSFER_ID} characters of [A-Za-z0-9._:-]")
    endpoint = parse_endpoint(raw.get("decode_endpoint")) if remote_decode else None
    cached = raw.get("prefill_cached_tokens", 0) if remote_prefill else 0
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached < MAX_CACHED_TOKENS:
        raise KVTransferParamsError("prefill_cached_tokens", f"kv_transfer_params.prefill_cached_tokens must be "
                                    f"an integer from 0 to {MAX_CACHED_TOKENS - 1}")
    return KVTransferParams(transfer_id, remote_decode, remote_prefill, endpoint, cached)
