"""Flags given as data: a mapping of flag names (without dashes, ``-`` or ``_``) to values, turned
into the argv a command's parser reads, so every value passes the very checks the command line's do.

``kvhive serve --config FILE.yaml`` and ``kvhive gateway --config FILE.yaml`` read such a mapping
from YAML (vLLM's ``--config`` format); the Ray Serve application's ``args`` are one too.
Torch-free; PyYAML is imported only when a file is read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from typing import Any

# A flag file larger than this is refused before it is parsed.
MAX_FLAG_FILE_BYTES = 1 << 20


class FlagValueError(ValueError):
    """A flag mapping, or one of its values, a command refuses; the message names the key."""


def json_flag_object(option: str, text: str) -> dict[str, Any]:
    """The JSON object a flag's value holds (``--kv-events-config``, ``--speculative-config``);
    ValueError naming ``option`` when it is not valid JSON or not an object."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option}: not valid JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:
        raise ValueError(f"{option}: not valid JSON (arrays and objects nested too deep)") from None
    if not isinstance(values, dict):
        raise ValueError(f"{option}: must be a JSON object, got {type(values).__name__}")
    return values


def finite_float(text: str) -> float:
    """argparse type of the commands' number flags: a float that is finite (``nan``, ``inf`` and
    ``1e999`` are refused, so no range check downstream meets one); argparse exits 2 naming the flag."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def auto_or_count(value: str, noun: str, low: int, high: int | None = None) -> int | None:
    """An argparse value that is ``auto`` (None) or a whole ``noun`` count in ``low..high`` (no upper
    bound when ``high`` is None); argparse.ArgumentTypeError otherwise."""
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a {noun} count, got {value!r}") from None
    if count < low or (high is not None and count > high):
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise argparse.ArgumentTypeError(f"must be auto or {bounds}, got {count}")
    return count


def dest_name(key: str) -> str:
    """A mapping key as an argparse dest: ``kv-cache-gb`` and ``kv_cache_gb`` are ``kv_cache_gb``."""
    return key.replace("-", "_")


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's flags by dest (positional arguments and --help left out)."""
    return {a.dest: a for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


def flag_argv(action: argparse.Action, name: str, value: Any, noun: str = "field") -> list[str]:
    """The argv that sets ``name`` (a ``noun`` of the mapping: field, key) to ``value`` through
    ``action``'s flag; None sets nothing (the flag's default stays)."""
    flag = action.option_strings[0]
    if value is None:
        return []
    if isinstance(action, argparse._StoreConstAction):      # store_true / store_false
        if not isinstance(value, bool):
            raise FlagValueError(f"{noun} {name!r} must be true or false, got {value!r}")
        return [flag] if value == action.const else []
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, (dict, list, bool)) for v in values):
            raise FlagValueError(f"{noun} {name!r} takes a value or a list of values, got {value!r}")
        return [part for v in values for part in (flag, str(v))]
    if isinstance(value, bool):
        raise FlagValueError(f"{noun} {name!r} takes a value, not {value!r}")
    if isinstance(value, (list, dict)):
        # A list or mapping for a flag that takes one value: its JSON text, which the flag checks
        # (the CORS lists, --kv-events-config, --kv-transfer-config).
        import json

        return [flag, json.dumps(value)]
    return [flag, str(value)]


def load_flag_file(path: str) -> dict[str, Any]:
    """The mapping of a YAML flag file; FlagValueError when it is unreadable, too large, not YAML or
    not a mapping of names."""
    import yaml

    try:
        size = os.path.getsize(path)
        if size > MAX_FLAG_FILE_BYTES:
            raise FlagValueError(f"{path} is {size} bytes; a flag file holds at most {MAX_FLAG_FILE_BYTES}")
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise FlagValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise FlagValueError(f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise FlagValueError(f"{path} is not valid YAML: collections nested too deep") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
        raise FlagValueError(f"{path} must be a mapping of flag names to values, e.g. 'port: 8001'")
    return dict(data)


def mapping_argv(parser: argparse.ArgumentParser, mapping: Mapping[str, Any], skip: frozenset[str] = frozenset(),
                 noun: str = "key") -> list[str]:
    """The argv setting each of ``mapping``'s flags on ``parser`` (dests in ``skip`` left out);
    FlagValueError naming an unknown key."""
    actions = option_actions(parser)
    argv: list[str] = []
    for key, value in mapping.items():
        dest = dest_name(key)
        if dest not in actions or dest == "config":
            raise FlagValueError(f"unknown {noun} {key!r}: not a flag of '{parser.prog}' "
                                 f"(keys are flag names without the dashes, e.g. port)")
        if dest not in skip:
            argv.extend(flag_argv(actions[dest], key, value, noun))
    return argv


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> frozenset[str]:
    """The dests of the flags and positionals ``argv`` sets on ``parser`` (a bad value exits with
    ``parser``'s usage, as the whole parse would)."""
    unset = object()
    # An append flag starts from None (it appends to a copy of what is there); the others from ``unset``.
    appended = {a.dest for a in parser._actions if isinstance(a, argparse._AppendAction)}
    namespace = argparse.Namespace(**{a.dest: None if a.dest in appended else unset for a in parser._actions})
    parsed, _ = parser.parse_known_args(argv, namespace)
    return frozenset(dest for dest, value in vars(parsed).items()
                     if value is not unset and not (dest in appended and value is None))
