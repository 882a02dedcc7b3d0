"""Opt-in CORS for ``kvhive serve`` and ``kvhive gateway``: the flags (vLLM's names and value format),
the validated settings, and the middleware they install.

Without ``--allowed-origins`` no CORS header is ever sent (browsers then refuse cross-origin calls);
with it, Starlette's ``CORSMiddleware`` answers preflight ``OPTIONS`` requests and adds the
``access-control-*`` headers to the actual ones. Torch-free: the gateway imports it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

# Bounds on what a flag may list: entries, and characters per entry.
MAX_CORS_ENTRIES = 256
MAX_CORS_ENTRY_CHARS = 2048


def cors_list(text: str) -> tuple[str, ...]:
    """argparse type of the CORS list flags: a JSON list of strings (vLLM's form, ``'["*"]'``) or a
    comma-separated list (``https://a.example,https://b.example``)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        except RecursionError:
            raise argparse.ArgumentTypeError("not a JSON list: arrays nested too deep") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        entries = [v.strip() for v in value]
    else:
        entries = [part.strip() for part in stripped.split(",")]
    entries = [e for e in entries if e]
    if not entries:
        raise argparse.ArgumentTypeError("the list is empty")
    if len(entries) > MAX_CORS_ENTRIES:
        raise argparse.ArgumentTypeError(f"at most {MAX_CORS_ENTRIES} entries, got {len(entries)}")
    too_long = next((e for e in entries if len(e) > MAX_CORS_ENTRY_CHARS), None)
    if too_long is not None:
        raise argparse.ArgumentTypeError(f"an entry is longer than {MAX_CORS_ENTRY_CHARS} characters")
    return tuple(entries)


@dataclass(frozen=True)
class CorsConfig:
    """Which browser origins may call the API, with which methods, headers and credentials."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if not self.allowed_origins:
            raise ValueError("--allowed-origins must name at least one origin")
        if self.allow_credentials and "*" in self.allowed_origins:
            # Browsers refuse credentials with a wildcard origin; Starlette would echo any origin instead.
            raise ValueError("--allow-credentials needs --allowed-origins to name the origins, not '*'")


def add_cors_args(group: argparse._ArgumentGroup) -> None:
    """Add ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` and
    ``--allow-credentials`` to ``group``."""
    group.add_argument("--allowed-origins", type=cors_list, default=None, metavar="LIST",
                       help="browser origins allowed to call the API (CORS), as a JSON list (vLLM's form, "
                            "'[\"https://app.example\"]', '[\"*\"]' for any) or a comma list; without it no "
                            "CORS header is sent (default: off)")
    group.add_argument("--allowed-methods", type=cors_list, default=None, metavar="LIST",
                       help="HTTP methods allowed from those origins, same forms; needs --allowed-origins "
                            "(default: [\"*\"] once --allowed-origins is given)")
    group.add_argument("--allowed-headers", type=cors_list, default=None, metavar="LIST",
                       help="request headers allowed from those origins, same forms; needs --allowed-origins "
                            "(default: [\"*\"] once --allowed-origins is given)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="let those origins send cookies and Authorization with credentials mode; needs "
                            "--allowed-origins naming the origins (not '*') (default: off)")


def cors_from_args(args: argparse.Namespace) -> CorsConfig | None:
    """The CORS settings of parsed flags, or None (off); ValueError when a flag needs another."""
    if args.allowed_origins is None:
        dependent = [flag for flag, value in (("--allowed-methods", args.allowed_methods),
                                              ("--allowed-headers", args.allowed_headers),
                                              ("--allow-credentials", args.allow_credentials or None))
                     if value is not None]
        if dependent:
            raise ValueError(f"{', '.join(dependent)} needs --allowed-origins")
        return None
    return CorsConfig(allowed_origins=args.allowed_origins,
                      allowed_methods=args.allowed_methods or ("*",),
                      allowed_headers=args.allowed_headers or ("*",),
                      allow_credentials=args.allow_credentials)


def install_cors(app: FastAPI, cors: CorsConfig | None) -> None:
    """Add the CORS middleware to ``app`` (nothing when ``cors`` is None). Add it last, so it runs
    first: a preflight is answered before an API key or a body limit is checked."""
    if cors is None:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials, expose_headers=["x-session-id"])
